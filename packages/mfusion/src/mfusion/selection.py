"""Which of mfusion's passes run: ``MFUSION_DISABLE``, ``MFUSION_CPU`` and the Python switches.

A pass is off when its name is in ``MFUSION_DISABLE`` (comma-separated short names such as
``rope,gelu``, or ``all``) or was given to :func:`disable_passes`, unless :func:`enable_passes`
named it later.

A pass whose ``on_cpu`` is False (its rewrite measured slower than Inductor's own C++ kernels
on CPU: the norms, RoPE, automatic fusion) leaves graphs whose inputs are all on the CPU
alone, unless ``MFUSION_CPU`` names it (or ``all``) or :func:`enable_passes` did.

The checks happen at each compile, and a pass reports another version under other switches,
so Inductor's FX graph cache never serves a graph rewritten under other switches; its version
also names spore-kernels', so it never serves one rewritten for another release's ops.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any

ENV = "MFUSION_DISABLE"
CPU_ENV = "MFUSION_CPU"
PREFIX = "mfusion."
ALL = "all"

log = logging.getLogger("mfusion")
_lock = threading.Lock()
_off: set[str] = set()
_on: set[str] = set()


def short_name(name: str) -> str:
    """``mfusion.rope`` or ``rope`` → ``rope``."""
    return name.removeprefix(PREFIX)


def known_names() -> list[str]:
    """The short names of every mfusion pass."""
    from mfusion.passes import all_passes

    return [p.name for p in all_passes()]


def _checked(names: tuple[str, ...]) -> set[str]:
    """The short names of ``names``, in any case (as the environment's); ``ValueError`` for
    one that names no pass, or that is not a str (a list: pass the names one by one)."""
    for n in names:
        if not isinstance(n, str):
            raise ValueError(
                f"mfusion pass names are strs, got {n!r}; pass each name as its own argument "
                f"(disable_passes('rope', 'gelu')); the passes are {', '.join(known_names())}"
            )
    wanted = {short_name(n.strip().lower()) for n in names}
    unknown = sorted(wanted - {ALL, *known_names()})
    if unknown:
        split = (
            "; pass each name as its own argument (disable_passes('rope', 'gelu'), as "
            "MFUSION_DISABLE splits on commas)"
            if any("," in n for n in unknown)
            else ""
        )
        raise ValueError(
            f"unknown mfusion pass {', '.join(map(repr, unknown))}; the passes are "
            f"{', '.join(known_names())} (or {ALL!r}){split}"
        )
    return wanted


def _switched(switch: str, names: tuple[str, ...]) -> set[str]:
    """:func:`_checked` for :func:`disable_passes`/:func:`enable_passes` (``switch``);
    ``TypeError`` for no name at all: the call would switch nothing."""
    if not names:
        raise TypeError(
            f"mfusion.{switch}() got no pass name and would switch nothing; pass {ALL!r} for "
            f"every pass or some of {', '.join(known_names())}"
        )
    return _checked(names)


def _from_env(var: str = ENV) -> set[str]:
    """The names ``var`` gives, in any case (``MFUSION_DISABLE=RoPE`` is ``rope``)."""
    raw = os.environ.get(var, "")
    names = {short_name(n.strip().lower()) for n in raw.split(",") if n.strip()}
    unknown = tuple(sorted(names - {ALL, *known_names()}))
    if unknown:
        _warn_unknown(var, unknown)
    return names


@functools.cache
def _warn_unknown(var: str, unknown: tuple[str, ...]) -> None:
    """Once a process for each value: the variable is read at every compile."""
    log.warning(
        "%s names unknown passes %s (ignored); the passes are %s",
        var,
        ", ".join(unknown),
        ", ".join(known_names()),
    )


def disable_passes(*names: str) -> None:
    """Switch passes off by short name (``"rope"``) or ``"all"``; ``ValueError`` for a typo,
    ``TypeError`` for no name."""
    wanted = _switched("disable_passes", names)
    with _lock:
        _off.update(wanted)
        _on.difference_update(wanted)


def enable_passes(*names: str) -> None:
    """Switch passes back on, including ones ``MFUSION_DISABLE`` names, and run them on CPU
    graphs too; ``"all"`` for every one (``TypeError`` for no name)."""
    wanted = _switched("enable_passes", names)
    with _lock:
        if ALL in wanted:
            _off.clear()
            _on.update({ALL, *known_names()})
            return
        if ALL in _off:  # "all" off, less these: every other pass by name
            _off.discard(ALL)
            _off.update(known_names())
        _off.difference_update(wanted)
        _on.update(wanted)


def reset() -> None:
    """Forget every :func:`disable_passes`/:func:`enable_passes` call (the environment stays)."""
    with _lock:
        _off.clear()
        _on.clear()


def is_enabled(name: str) -> bool:
    """Whether the pass called ``name`` (in any case) runs under the current switches;
    ``ValueError`` for a name of no pass."""
    (name,) = _checked((name,))
    with _lock:
        off, on = set(_off), set(_on)
    if name in on or ALL in on:
        return not (name in off or ALL in off)
    env = _from_env()
    return not ({name, ALL} & (off | env))


def forced_on_cpu(name: str) -> bool:
    """Whether the pass ``name`` runs on CPU graphs even where it does not pay off there
    (``MFUSION_CPU`` names it or ``all``, or :func:`enable_passes` did)."""
    name = short_name(name)
    with _lock:
        on = set(_on)
    return bool({name, ALL} & (on | _from_env(CPU_ENV)))


def cpu_graph(gm: Any) -> bool:
    """Whether every tensor input of ``gm`` is on the CPU; a graph without tensor inputs is a
    CPU graph in a process without an accelerator (where it can make tensors nowhere else),
    as :meth:`Switched.uuid` assumes."""
    import torch

    devices = set()
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val", node.meta.get("example_value"))
        if isinstance(value, torch.Tensor):
            devices.add(value.device.type)
    return devices == {"cpu"} or (not devices and not torch.accelerator.is_available())


def disabled_passes() -> list[str]:
    """The short names of the passes that are off now."""
    return [n for n in known_names() if not is_enabled(n)]


def _kernels_version() -> str:
    """spore-kernels' version: the fused ops' fake implementations (the strides a cached graph
    asserts) come with it, so a cached rewrite must not outlive an upgrade."""
    from spore_kernels import __version__

    return __version__


class Switched:
    """A pass that runs only while :func:`is_enabled` (and, if its ``on_cpu`` is False, on a
    CPU graph only when :func:`forced_on_cpu`); its version says which."""

    def __init__(self, pass_: Any) -> None:
        self.pass_ = pass_
        self.name = pass_.name
        self.on_cpu = bool(getattr(pass_, "on_cpu", True))

    @property
    def version(self) -> str:
        base = f"{getattr(self.pass_, 'version', '1')}+kernels{_kernels_version()}"
        if not is_enabled(self.name):
            return f"{base}+off"
        return base if self.on_cpu or not forced_on_cpu(self.name) else f"{base}+cpu"

    def uuid(self) -> Any:
        """The pass's own ``uuid()`` where it can change a graph in this process, else the
        version: an off pass changes nothing, nor does one that leaves CPU graphs alone in a
        process without an accelerator (so its ``uuid()`` cannot keep such graphs from the
        FX graph cache)."""
        own = getattr(self.pass_, "uuid", None)
        import torch

        runs_here = is_enabled(self.name) and (
            self.on_cpu or forced_on_cpu(self.name) or torch.accelerator.is_available()
        )
        return own() if callable(own) and runs_here else self.version

    def __call__(self, gm: Any) -> int:
        if not is_enabled(self.name):
            return 0
        if not self.on_cpu and not forced_on_cpu(self.name) and cpu_graph(gm):
            return 0
        return int(self.pass_(gm) or 0)

    def __repr__(self) -> str:
        return f"<mfusion pass {self.name} v{self.version}>"
