"""Spore: a small extension core for PyTorch; plugins bring the accelerations.

``import spore`` is cheap: it imports no plugin and neither torch._dynamo nor torch._inductor.
Plugins are found through the ``spore.plugins`` entry-point group and loaded the first time a
registry is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

from spore._version import __version__

if TYPE_CHECKING:
    from spore.registry import Registry

hookimpl = pluggy.HookimplMarker("spore")
"""Marker for plugin hook implementations: ``@spore.hookimpl def spore_doctor(report): ...``."""

_LAZY = {
    "Benchmark": "spore.bench",
    "DispatchMode": "spore.modes",
    "FallbackTensor": "spore.fallback",
    "GraphPass": "spore.passes",
    "PatternToPatternPass": "spore.passes",
    "OpCounter": "spore.modes",
    "OpLogger": "spore.modes",
    "PluginError": "spore.plugins",
    "PluginManager": "spore.plugins",
    "Report": "spore.doctor",
    "get_manager": "spore.plugins",
    "register_custom_backend": "spore.backends",
    "register_custom_pass": "spore.passes",
    "saved_tensors_hooks": "spore.memory",
}


def get_registry(kind: str) -> Registry[Any]:
    """The process-wide registry of ``kind`` (``ops``, ``passes``, ``backends``, ``benchmarks``).

    The first call loads the plugins.
    """
    from spore.plugins import get_manager

    return get_manager().registry(kind)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'spore' has no attribute {name!r}")


__all__ = ["__version__", "get_registry", "hookimpl", *_LAZY]
