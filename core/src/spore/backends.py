"""Custom ``torch.compile`` backends: ``spore.register_custom_backend`` and the registry.

A backend registered here is registered with ``torch._dynamo`` under its name, so
``torch.compile(model, backend=name)`` works. Dynamo keeps a thin entry that calls whatever
Spore holds for that name at compile time, so ``override=True`` takes effect and registering
the same backend again (a plugin loaded twice) is harmless. With ``fallback=True`` a compiler
that raises is reported as a warning and the graph runs eagerly; otherwise the error
propagates (dynamo reports it as ``BackendCompilerFailed`` with the cause chained).

Plugins may also declare dynamo's own ``torch_dynamo_backends`` entry point, so the backend is
found by ``torch.compile`` without importing Spore first.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spore.registry import DuplicateRegistrationError, Registry

CompilerFn = Callable[..., Any]

_lock = threading.Lock()
_active: dict[str, Backend] = {}


@dataclass(frozen=True)
class Backend:
    """A compile backend: ``compiler_fn(gm, example_inputs) -> callable``."""

    name: str
    compiler_fn: CompilerFn
    fallback: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"backend name must be a Python identifier, got {self.name!r}")
        if not callable(self.compiler_fn):
            raise TypeError(f"backend {self.name!r}: compiler_fn must be callable")


def _entry(name: str) -> CompilerFn:
    """What dynamo holds for ``name``: calls Spore's current backend of that name."""

    def compile_graph(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        backend = _active.get(name)
        if backend is None:
            raise RuntimeError(
                f"spore backend {name!r} was withdrawn (the plugin that registered it failed "
                f"or was removed); `spore backends` lists the available ones"
            )
        try:
            return backend.compiler_fn(gm, example_inputs, **kwargs)
        except Exception as exc:
            if not backend.fallback:
                raise
            warnings.warn(
                f"spore backend {name!r} failed ({type(exc).__name__}: {exc}); this graph runs "
                f"eagerly because the backend was registered with fallback=True",
                RuntimeWarning,
                stacklevel=2,
            )
            return gm.forward

    compile_graph.__name__ = name
    compile_graph._spore_backend = name  # type: ignore[attr-defined]
    return compile_graph


def _register_with_dynamo(backend: Backend) -> None:
    import torch._dynamo

    with _lock:
        if backend.name in _active:
            _active[backend.name] = backend
            return
        if backend.name in torch._dynamo.list_backends(exclude_tags=()):
            raise DuplicateRegistrationError(
                f"torch._dynamo already has a backend named {backend.name!r} that Spore did "
                f"not register; choose another name"
            )
        _active[backend.name] = backend
        torch._dynamo.register_backend(_entry(backend.name), name=backend.name)


class BackendRegistry(Registry[Backend]):
    """What ``spore_register_backends`` receives: ``registry.add(Backend(...))``."""

    def add(self, value: Backend, *, name: str | None = None, override: bool = False) -> Backend:
        if not isinstance(value, Backend):
            raise TypeError(f"register a spore.backends.Backend, got {type(value).__name__}")
        if name not in (None, value.name):
            raise ValueError(f"backend {value.name!r} cannot be registered as {name!r}")
        super().add(value, override=override)
        _register_with_dynamo(value)
        return value

    def remove_owner(self, owner: str) -> None:
        """Forget ``owner``'s backends; dynamo's entries then fail with a clear message."""
        for name in self.names(owner=owner):
            _active.pop(name, None)
        super().remove_owner(owner)


def register_custom_backend(
    name: str, compiler_fn: CompilerFn, *, fallback: bool = False, override: bool = False
) -> Backend:
    """Register ``compiler_fn`` as ``torch.compile(..., backend=name)`` (owner: ``user``)."""
    from spore.plugins import get_manager

    backend = Backend(name, compiler_fn, fallback)
    get_manager().registry("backends").add(backend, override=override)
    return backend


def active() -> dict[str, Backend]:
    """The backends Spore has registered with dynamo in this process, by name."""
    return dict(_active)
