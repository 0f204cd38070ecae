"""MindSpore frontend: Spore's mechanisms over MindSpore's own (2.6 and newer).

- :class:`DispatchMode` over ``mindspore.MsDispatchMode``: override
  ``__spore_dispatch__(func, args, kwargs)`` as with torch; :class:`OpCounter` counts op names.
- :func:`saved_tensors_hooks` over ``mindspore.saved_tensors_hooks``, composable like
  :func:`spore.saved_tensors_hooks` (inner hooks see what outer ones packed) and, as it,
  a :class:`SavedTensorsHooks` that can be entered again or decorate a function.
- :func:`register_custom_pass` / :func:`register_custom_backend` forward a compiled ``.so``
  plugin to ``mindspore.graph`` with clear errors.

Importing this module imports MindSpore; nothing else in Spore does.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

try:
    import mindspore
    import mindspore.graph as _graph
except ImportError as exc:  # pragma: no cover - exercised by the core session's test
    raise ImportError(
        "spore.frontends.mindspore needs MindSpore: pip install mindspore "
        "(2.6 or newer; it needs numpy<2)"
    ) from exc

from spore import memory
from spore.memory import Pack, Unpack

_local = threading.local()


class DispatchMode(mindspore.MsDispatchMode):
    """Subclass and override ``__spore_dispatch__(func, args, kwargs)``; default runs it."""

    def __spore_dispatch__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return func(*args, **kwargs)

    def __ms_dispatch__(self, func: Any, args: Any, kwargs: dict[str, Any] | None = None) -> Any:
        return self.__spore_dispatch__(func, tuple(args), kwargs or {})


class OpCounter(DispatchMode):
    """Counts the MindSpore ops run inside it, by ``func.name``."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __spore_dispatch__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.counts[func.name] += 1
        return func(*args, **kwargs)


def _installed() -> list[tuple[Pack, Unpack]]:
    if not hasattr(_local, "installed"):
        _local.installed = []
    return _local.installed


class SavedTensorsHooks(memory.SavedTensorsHooks):
    """:class:`spore.memory.SavedTensorsHooks` over ``mindspore.saved_tensors_hooks``: one
    object can be entered again, and decorates a function (each call a block)."""

    @staticmethod
    @contextmanager
    def _install(pack: Pack, unpack: Unpack) -> Iterator[None]:
        """``mindspore.saved_tensors_hooks``, remembered so that an inner pair composes with it."""
        _installed().append((pack, unpack))
        try:
            with mindspore.saved_tensors_hooks(pack, unpack):
                yield
        finally:
            _installed().pop()

    @staticmethod
    def _active() -> tuple[Pack, Unpack] | None:
        installed = _installed()
        return installed[-1] if installed else None


def saved_tensors_hooks(pack: Pack, unpack: Unpack) -> SavedTensorsHooks:
    """Composable ``mindspore.saved_tensors_hooks`` (see :func:`spore.saved_tensors_hooks`)."""
    return SavedTensorsHooks(pack, unpack)


def _plugin_path(path: str) -> str:
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise ValueError(f"MindSpore plugin {path!r} does not exist (looked at {full})")
    return full


def register_custom_pass(
    name: str, plugin_so: str, *, device: str = "all", full_graph: bool = False
) -> None:
    """Forward a ``.so`` pass plugin to ``mindspore.graph.register_custom_pass``.

    ``device``: ``cpu``, ``gpu``, ``ascend`` or ``all``; ``full_graph`` selects
    ``CustomPassType.FULL_GRAPH`` instead of ``PATTERN``.
    """
    if device not in ("cpu", "gpu", "ascend", "all"):
        raise ValueError(f"device must be cpu, gpu, ascend or all, got {device!r}")
    kind = _graph.CustomPassType.FULL_GRAPH if full_graph else _graph.CustomPassType.PATTERN
    if not _graph.register_custom_pass(name, _plugin_path(plugin_so), device, kind):
        raise RuntimeError(
            f"MindSpore refused pass {name!r} from {plugin_so!r}: the library did not load or "
            f"does not provide that pass (MindSpore's log above says why)"
        )


def register_custom_backend(name: str, plugin_so: str) -> None:
    """Forward a ``.so`` backend to ``mindspore.graph.register_custom_backend`` (for ``@jit``)."""
    if not _graph.register_custom_backend(name, _plugin_path(plugin_so)):
        raise RuntimeError(
            f"MindSpore refused backend {name!r} from {plugin_so!r}: the library did not load "
            f"or does not provide that backend"
        )
