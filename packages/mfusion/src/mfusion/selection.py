"""Which of mfusion's passes run: ``MFUSION_DISABLE`` and the Python switches.

A pass is off when its name is in ``MFUSION_DISABLE`` (comma-separated short names such as
``rope,gelu``, or ``all``) or was given to :func:`disable_passes`, unless :func:`enable_passes`
named it later. The check happens at each compile, and a pass that is off reports another
version, so Inductor's FX graph cache never serves a graph rewritten under other switches.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

ENV = "MFUSION_DISABLE"
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
    wanted = {short_name(n.strip()) for n in names}
    unknown = sorted(wanted - {ALL, *known_names()})
    if unknown:
        raise ValueError(
            f"unknown mfusion pass {', '.join(map(repr, unknown))}; the passes are "
            f"{', '.join(known_names())} (or {ALL!r})"
        )
    return wanted


def _from_env() -> set[str]:
    raw = os.environ.get(ENV, "")
    names = {short_name(n.strip()) for n in raw.split(",") if n.strip()}
    unknown = sorted(names - {ALL, *known_names()})
    if unknown:
        log.warning(
            "%s names unknown passes %s (ignored); the passes are %s",
            ENV,
            ", ".join(unknown),
            ", ".join(known_names()),
        )
    return names


def disable_passes(*names: str) -> None:
    """Switch passes off by short name (``"rope"``) or ``"all"``; ``ValueError`` for a typo."""
    wanted = _checked(names)
    with _lock:
        _off.update(wanted)
        _on.difference_update(wanted)


def enable_passes(*names: str) -> None:
    """Switch passes back on, including ones ``MFUSION_DISABLE`` names; ``"all"`` for every one."""
    wanted = _checked(names)
    with _lock:
        if ALL in wanted:
            _off.clear()
            _on.update({ALL, *known_names()})
            return
        _off.difference_update(wanted)
        _on.update(wanted)


def reset() -> None:
    """Forget every :func:`disable_passes`/:func:`enable_passes` call (the environment stays)."""
    with _lock:
        _off.clear()
        _on.clear()


def is_enabled(name: str) -> bool:
    """Whether the pass called ``name`` runs under the current switches."""
    name = short_name(name)
    with _lock:
        off, on = set(_off), set(_on)
    if name in on or ALL in on:
        return not (name in off or ALL in off)
    env = _from_env()
    return not ({name, ALL} & (off | env))


def disabled_passes() -> list[str]:
    """The short names of the passes that are off now."""
    return [n for n in known_names() if not is_enabled(n)]


class Switched:
    """A pass that runs only while :func:`is_enabled`; its version says when it is off."""

    def __init__(self, pass_: Any) -> None:
        self.pass_ = pass_
        self.name = pass_.name

    @property
    def version(self) -> str:
        base = str(getattr(self.pass_, "version", "1"))
        return base if is_enabled(self.name) else f"{base}+off"

    def __call__(self, gm: Any) -> int:
        if not is_enabled(self.name):
            return 0
        return int(self.pass_(gm) or 0)

    def __repr__(self) -> str:
        return f"<mfusion pass {self.name} v{self.version}>"
