"""Custom ``torch.compile`` backends: the :class:`Backend` type and its entries in dynamo.

This is the mechanism behind :class:`spore.registry.BackendRegistry` (what plugins fill) and
``spore.register_custom_backend`` (user code): each backend added there is handed to
:func:`register_with_dynamo`, so ``torch.compile(model, backend=name)`` works. Dynamo keeps a
thin entry that calls whatever Spore holds for that name at compile time, so ``override=True``
takes effect and the same backend registered by a second plugin manager is harmless. With
``fallback=True`` a compiler that raises is reported as a warning and the graph runs eagerly;
otherwise the error propagates (dynamo raises ``BackendCompilerFailed`` ``from None``, the
error in its message and ``.inner_exception``).

Plugins may also declare dynamo's own ``torch_dynamo_backends`` entry point, so the backend is
found by ``torch.compile`` without importing Spore first.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spore.errors import DuplicateRegistrationError

CompilerFn = Callable[..., Any]

_lock = threading.Lock()
_active: dict[str, Backend] = {}
_given: set[str] = set()  # names whose dynamo entry is Spore's (:func:`_entry`), withdrawn or not


@dataclass(frozen=True)
class Backend:
    """A compile backend: ``compiler_fn(gm, example_inputs) -> callable``."""

    name: str
    compiler_fn: CompilerFn
    fallback: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"backend name must be a str, got {type(self.name).__name__}")
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


def _declared_by_entry_point(backend: Backend) -> bool:
    """Whether dynamo's ``torch_dynamo_backends`` entry point of this name loads
    ``backend.compiler_fn`` itself (a plugin declaring its backend both ways)."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="torch_dynamo_backends", name=backend.name):
        try:
            if ep.load() is backend.compiler_fn:
                return True
        except Exception:
            continue
    return False


def register_with_dynamo(backend: Backend) -> None:
    """Make ``backend`` what ``torch.compile(..., backend=backend.name)`` calls.

    The same name again replaces Spore's backend; a name dynamo has from elsewhere is refused,
    unless it is a ``torch_dynamo_backends`` entry point loading this very compiler function.
    """
    import torch._dynamo

    with _lock:
        if backend.name in _active or backend.name in _given:
            _active[backend.name] = backend  # dynamo's entry calls the one in _active
            return
        if backend.name in torch._dynamo.list_backends(exclude_tags=()):
            if _declared_by_entry_point(backend):
                _active[backend.name] = backend  # dynamo loads the same function itself
                return
            raise DuplicateRegistrationError(
                f"torch._dynamo already has a backend named {backend.name!r} that Spore did "
                f"not register; choose another name"
            )
        _active[backend.name] = backend
        torch._dynamo.register_backend(_entry(backend.name), name=backend.name)
        _given.add(backend.name)


def withdraw(names: list[str]) -> None:
    """Forget these backends; dynamo's entries for them then fail with a clear message."""
    with _lock:
        for name in names:
            _active.pop(name, None)


def active() -> dict[str, Backend]:
    """The backends Spore has registered with dynamo in this process, by name."""
    return dict(_active)
