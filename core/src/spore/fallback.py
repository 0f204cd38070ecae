"""``spore.FallbackTensor``: a wrapper tensor whose class sees every op it meets.

A subclass overrides ``__fallback__(cls, func, args, kwargs)`` (the default unwraps every
``FallbackTensor`` argument, runs ``func`` on the plain tensors and wraps the tensor results
again, carrying the metadata of the first wrapped argument) and may register per-op handlers
that win over it::

    class Tagged(spore.FallbackTensor):
        @classmethod
        def __fallback__(cls, func, args, kwargs):
            return super().__fallback__(func, args, kwargs)

    @Tagged.register(torch.ops.aten.mm.default)
    def _mm(cls, func, args, kwargs): ...

In-place ops return the wrapper they modified; view ops return a new wrapper around the view.
Autograd runs above the wrapper (gradients are wrappers too). ``torch.save`` stores the plain
data and the metadata; ``torch.load`` needs ``weights_only=False`` or the subclass added to
``torch.serialization.add_safe_globals`` (this module allows its own rebuild function, which
constructs only an allowed subclass). ``torch.compile`` traces wrappers through
``__tensor_flatten__``/``__tensor_unflatten__``: the metadata must be picklable constants and
handlers must be traceable (no data-dependent Python control flow).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import suppress
from typing import Any, ClassVar

import torch
from torch.utils._mode_utils import no_dispatch

Handler = Callable[[type, Any, tuple[Any, ...], dict[str, Any]], Any]


class FallbackTensor(torch.Tensor):
    """Wrapper tensor subclass with the ``__fallback__`` op hook (see the module docstring)."""

    _spore_handlers: ClassVar[dict[Any, Handler]] = {}
    _spore_data: torch.Tensor
    _spore_meta: dict[str, Any]

    @staticmethod
    def __new__(cls, data: torch.Tensor, meta: dict[str, Any] | None = None) -> FallbackTensor:
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"{cls.__name__} wraps a torch.Tensor, got {type(data).__name__}")
        requires_grad = data.requires_grad  # a wrapper's own: its data is kept detached
        if isinstance(data, FallbackTensor):
            data = data._spore_data
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
            layout=data.layout,
            requires_grad=requires_grad,
        )
        # the conjugate and negative bits live on the tensor, not in its data: copy them so
        # that torch resolves them above the wrapper as it would on ``data`` (issue #130646)
        torch._C._set_conj(out, data.is_conj())
        torch._C._set_neg(out, data.is_neg())
        out._spore_data = data.detach() if data.requires_grad else data
        out._spore_meta = dict(meta or {})
        return out

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._spore_handlers = {}

    # the user-facing surface ------------------------------------------------------------------
    @property
    def meta(self) -> dict[str, Any]:
        """The metadata this wrapper carries (propagated by the default fallback)."""
        return self._spore_meta

    def unwrap(self) -> torch.Tensor:
        """The plain tensor inside."""
        return self._spore_data

    @classmethod
    def register(cls, op: Any) -> Callable[[Handler], Handler]:
        """Decorator: ``handler(cls, func, args, kwargs)`` runs for ``op`` instead of the fallback.

        ``op`` is an overload (``torch.ops.aten.mm.default``), a packet (``torch.ops.aten.mm``,
        all overloads) or what ``torch.library.custom_op`` returns (its packet,
        ``torch.ops.<ns>.<name>``); anything else (``torch.mm``, ``torch.Tensor.mm``, a name) is
        a ``TypeError``: ``__torch_dispatch__`` sees only ops, so its handler would never run.
        """
        if isinstance(op, torch.library.CustomOpDef):
            op = op._opoverload.overloadpacket
        if not isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            raise TypeError(
                f"{cls.__name__}.register({op!r}): a handler is registered for an op, "
                f"an overload (torch.ops.aten.mm.default) or a packet (torch.ops.aten.mm); "
                f"a torch function, Tensor method or name never reaches __torch_dispatch__, so "
                f"its handler would never run{_op_hint(op)}"
            )

        def decorate(handler: Handler) -> Handler:
            cls._spore_handlers[op] = handler
            return handler

        return decorate

    @classmethod
    def __fallback__(cls, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Default: unwrap, run ``func``, wrap tensor results with the first argument's meta
        (a result the op wrote into, in place or ``out=``, is that argument's wrapper)."""
        first = _first_wrapper(args, kwargs)
        meta = first._spore_meta if first is not None else {}
        written = {
            id(w._spore_data): w
            for w in _written(func, args, kwargs)
            if isinstance(w, FallbackTensor)
        }
        out = func(*_map(_unwrap, args), **_map(_unwrap, kwargs))

        def wrap(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            wrapper = written.get(id(t))  # in place, out=: the wrapper it wrote into
            return cls(t, meta) if wrapper is None else wrapper

        return _map(wrap, out)

    # torch integration ------------------------------------------------------------------------
    @property  # type: ignore[override]
    def data(self) -> torch.Tensor:
        """As torch's; setting it replaces the wrapped tensor too (torch's setter changed only
        the wrapper's shape: its values stayed the old ones)."""
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        inner = value._spore_data if isinstance(value, FallbackTensor) else value
        torch.Tensor.data.__set__(self, value)
        self._spore_data = inner.detach()

    def __deepcopy__(self, memo: dict[int, Any]) -> FallbackTensor:
        """A copy of the wrapped tensor, its metadata, gradient and attributes, as
        ``torch.Tensor``'s own (which took a wrapper at an offset for a tensor with storage,
        and failed)."""
        if not self.is_leaf:
            raise RuntimeError(
                "Only Tensors created explicitly by the user (graph leaves) support the "
                "deepcopy protocol; detach() it first"
            )
        if id(self) in memo:
            return memo[id(self)]
        data = copy.deepcopy(self._spore_data, memo)
        out = _rebuild(type(self), data, copy.deepcopy(self._spore_meta, memo), self.requires_grad)
        memo[id(self)] = out
        if self.grad is not None:
            out.grad = copy.deepcopy(self.grad, memo)
        for name, value in self.__dict__.items():  # a subclass's attributes, nn.Parameter's mark
            if name not in ("_spore_data", "_spore_meta"):
                setattr(out, name, copy.deepcopy(value, memo))
        return out

    @classmethod
    def __torch_dispatch__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        for klass in cls.__mro__:
            handlers = klass.__dict__.get("_spore_handlers", {})
            handler = handlers.get(func) or handlers.get(getattr(func, "overloadpacket", None))
            if handler is not None:
                out = handler(cls, func, args, kwargs)
                break
        else:
            out = cls.__fallback__(func, args, kwargs)
        for written in _written(func, args, kwargs):
            if isinstance(written, FallbackTensor):
                _follow_inner(written)
        return out

    def __repr__(self) -> str:  # type: ignore[override]
        return f"{type(self).__name__}({self._spore_data!r}, meta={self._spore_meta!r})"

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        return ["_spore_data"], dict(self._spore_meta)

    @classmethod
    def __tensor_unflatten__(
        cls,
        inner: dict[str, torch.Tensor],
        meta: dict[str, Any],
        outer_size: Any,
        outer_stride: Any,
    ) -> FallbackTensor:
        return cls(inner["_spore_data"], meta)

    def __reduce_ex__(self, protocol: int) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self._spore_data, self._spore_meta, self.requires_grad))


def _untraced(fn: Any) -> None:
    """Dynamo never traces ``fn``'s frames or those it calls: after a graph break an op runs
    through ``__torch_dispatch__``, which dynamo would trace as user code, and fail. Marked on
    the code object through torch's C eval-frame API, as ``torch._dynamo.disable`` would
    without importing dynamo (a second at import); a torch without that API leaves it traced."""
    with suppress(ImportError, AttributeError):
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )

        skip = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
        set_code_exec_strategy(fn.__code__, skip)


_untraced(FallbackTensor.__dict__["__torch_dispatch__"].__func__)


def _rebuild(
    cls: type[FallbackTensor], data: torch.Tensor, meta: dict[str, Any], requires_grad: bool = False
) -> Any:
    """Rebuild a saved wrapper (see ``__reduce_ex__``). ``torch.load(weights_only=True)`` calls
    it with a class the checkpoint names and the user allowed: it must be a ``FallbackTensor``
    subclass."""
    if not (isinstance(cls, type) and issubclass(cls, FallbackTensor)):
        raise TypeError(f"a saved FallbackTensor names {cls!r}, not a FallbackTensor subclass")
    out = cls(data, meta)
    return out.requires_grad_() if requires_grad else out


torch.serialization.add_safe_globals([_rebuild])


def _op_hint(value: Any) -> str:
    """`` (did you mean torch.ops.aten.<name>?)`` where ``value`` (a torch function, a Tensor
    method, an ``aten::`` name) is named as an aten op is; else empty."""
    name = value if isinstance(value, str) else getattr(value, "__name__", "")
    name = name.removeprefix("aten::").partition(".")[0] if isinstance(name, str) else ""
    if name.isidentifier() and hasattr(torch.ops.aten, name):
        return f" (did you mean torch.ops.aten.{name}?)"
    return ""


def _map(fn: Callable[[Any], Any], value: Any) -> Any:
    """``fn`` over the leaves of nested tuples, lists and dicts (op arguments and results)."""
    if isinstance(value, tuple):
        return tuple(_map(fn, v) for v in value)
    if isinstance(value, list):
        return [_map(fn, v) for v in value]
    if isinstance(value, dict):
        return {k: _map(fn, v) for k, v in value.items()}
    return fn(value)


def _unwrap(value: Any) -> Any:
    return value._spore_data if isinstance(value, FallbackTensor) else value


def _first_wrapper(args: tuple[Any, ...], kwargs: dict[str, Any]) -> FallbackTensor | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, FallbackTensor):
            return value
        if isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, FallbackTensor):
                    return item
    return None


_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}


def _writes(func: Any) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of each argument ``func`` writes (cached per op overload)."""
    known = _WRITES.get(func)
    if known is None:
        schema = getattr(func, "_schema", None)
        known = _WRITES[func] = tuple(
            (i, a.name)
            for i, a in enumerate(schema.arguments if schema else ())
            if a.alias_info is not None and a.alias_info.is_write
        )
    return known


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments ``func`` writes (``self`` of an in-place op, ``out=``), whose sizes and
    strides it may change (``t_``, ``resize_``, an ``out=`` resized)."""
    return [args[i] if i < len(args) else kwargs.get(name) for i, name in _writes(func)]


def _follow_inner(wrapper: FallbackTensor) -> None:
    """Give the wrapper its inner tensor's sizes, strides and offset (after an op that writes
    it changed them there). The wrapper's storage holds no data: growing it allocates nothing."""
    inner = wrapper._spore_data
    if (wrapper.shape, wrapper.stride(), wrapper.storage_offset()) == (
        inner.shape,
        inner.stride(),
        inner.storage_offset(),
    ):
        return
    with no_dispatch():
        span = sum((n - 1) * st for n, st in zip(inner.shape, inner.stride(), strict=True)) + 1
        needed = inner.storage_offset() + span if inner.numel() else 0
        if needed * inner.element_size() > torch.Tensor.untyped_storage(wrapper).nbytes():
            torch.Tensor.resize_(wrapper, (needed,))
        torch.Tensor.as_strided_(wrapper, inner.shape, inner.stride(), inner.storage_offset())
