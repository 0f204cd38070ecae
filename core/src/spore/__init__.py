"""Spore: a small extension core for PyTorch; plugins bring the accelerations.

``import spore`` is cheap: it imports no plugin and neither torch._dynamo nor torch._inductor.
Plugins are found through the ``spore.plugins`` entry-point group and loaded the first time a
registry is used.

This package is the host API: what it defines here (:func:`get_registry`,
:func:`register_custom_backend`) and what it re-exports on first access (``_LAZY``) may reach
the plugin manager. No module of Spore imports the package itself, so none of them can import
the manager through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spore._version import __version__
from spore.hookspecs import hookimpl

if TYPE_CHECKING:
    from spore.backends import Backend, CompilerFn
    from spore.registry import Registry

_LAZY = {
    "Benchmark": "spore.bench",
    "DispatchMode": "spore.modes",
    "FallbackTensor": "spore.fallback",
    "GraphPass": "spore.graph_passes",
    "PatternToPatternPass": "spore.graph_passes",
    "OpCounter": "spore.modes",
    "OpLogger": "spore.modes",
    "PluginError": "spore.errors",
    "PluginManager": "spore.plugins",
    "Report": "spore.doctor",
    "SearchForm": "spore.graph_passes",
    "get_manager": "spore.plugins",
    "register_custom_pass": "spore.passes",
    "saved_tensors_hooks": "spore.memory",
}


def get_registry(kind: str) -> Registry[Any]:
    """The process-wide registry of ``kind`` (``ops``, ``passes``, ``backends``, ``benchmarks``).

    The first call loads the plugins.
    """
    from spore.plugins import get_manager

    return get_manager().registry(kind)


def register_custom_backend(
    name: str, compiler_fn: CompilerFn, *, fallback: bool = False, override: bool = False
) -> Backend:
    """Register ``compiler_fn`` as ``torch.compile(..., backend=name)`` (owner: ``user``)."""
    from spore.backends import Backend

    backend = Backend(name, compiler_fn, fallback)
    get_registry("backends").add(backend, override=override)
    return backend


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'spore' has no attribute {name!r}")


__all__ = ["__version__", "get_registry", "hookimpl", "register_custom_backend", *_LAZY]
