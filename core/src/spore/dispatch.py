"""Ops defined once, with per-device kernels chosen per call, on top of ``torch.library``.

``define`` creates ``torch.ops.spore.<name>`` from a schema and a plain-torch reference (the
oracle), with a fake implementation (default: the reference) so ``torch.compile`` traces it as
one opaque op, and an autograd formula (default: the gradient of the reference, recomputed in
backward). Providers add kernels per device type with a priority and a ``supports`` predicate;
each call runs the highest-priority kernel whose predicate accepts the arguments, else the
reference. ``explain`` says which would run and why the others would not. An op may cast its
arguments under ``torch.autocast`` (``define(..., autocast=...)``): its kernels, and
``explain``, then see them cast.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd import forward_ad

from spore.errors import DuplicateRegistrationError, check_device_type, check_sub_provider

NAMESPACE = "spore"
REFERENCE = "reference"

_lock = threading.RLock()
_ops: dict[str, Op] = {}
_library: torch.library.Library | None = None


@dataclass(frozen=True)
class Kernel:
    """One provider's implementation of an op for one device type."""

    op: str
    device: str
    provider: str
    fn: Callable[..., Any]
    priority: int = 0
    supports: Callable[..., bool] | None = None


@dataclass(frozen=True)
class Candidate:
    """A kernel considered for a call, and the verdict."""

    provider: str
    priority: int
    chosen: bool
    reason: str


@dataclass(frozen=True)
class Explanation:
    """What :func:`explain` found: the device, the kernel that would run, every candidate."""

    op: str
    device: str
    chosen: str
    candidates: list[Candidate]

    def __str__(self) -> str:
        lines = [f"spore::{self.op} on {self.device}: runs {self.chosen}"]
        lines += [
            f"  {'*' if c.chosen else '-'} {c.provider} (priority {c.priority}): {c.reason}"
            for c in self.candidates
        ]
        return "\n".join(lines)


def _device_type(t: torch.Tensor) -> str:
    return "cpu" if t.is_cpu else t.device.type  # .device builds an object: a few µs a call


def _device_of(args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, torch.Tensor):
            return _device_type(value)
        if isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    return _device_type(item)
    return "cpu"


@dataclass
class Op:
    """An op defined through Spore: schema, reference, fake, autograd, kernels per device."""

    name: str
    schema: str
    reference: Callable[..., Any]
    kernels: dict[tuple[str, str], Kernel] = field(default_factory=dict)
    _ranked: dict[str, list[Kernel]] = field(default_factory=dict, repr=False, compare=False)
    _defaults: tuple[Any, ...] = field(default=(), repr=False, compare=False)
    _signature: inspect.Signature = field(
        default_factory=inspect.Signature, repr=False, compare=False
    )
    _tensors: tuple[tuple[str, bool], ...] = field(default=(), repr=False, compare=False)
    _required: tuple[int, ...] = field(default=(), repr=False, compare=False)
    _autocast: Callable[..., tuple[Any, ...]] | None = field(
        default=None, repr=False, compare=False
    )

    @property
    def qualname(self) -> str:
        return f"{NAMESPACE}::{self.name}"

    @property
    def packet(self) -> Any:
        """``torch.ops.spore.<name>``."""
        return getattr(getattr(torch.ops, NAMESPACE), self.name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.packet(*args, **kwargs)

    def candidates(self, device: str) -> list[Kernel]:
        """Kernels for ``device``, highest priority first (ties: provider name)."""
        cache = self._ranked  # read before the kernels: see _set_kernels
        ranked = cache.get(device)
        if ranked is None:
            found = [k for (dev, _), k in self.kernels.items() if dev == device]
            ranked = sorted(found, key=lambda k: (-k.priority, k.provider))
            cache[device] = ranked
        return list(ranked)

    def _set_kernels(self, kernels: dict[tuple[str, str], Kernel]) -> None:
        # The kernels first, then a new cache: a ranking of the old kernels can only be filled
        # into the old cache (a caller that read it before this swap), never the new one.
        self.kernels = kernels
        self._ranked = {}

    def select(self, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Kernel | None, str]:
        """The kernel that runs for these arguments (``None``: the reference) and the device."""
        device = _device_of(args, kwargs)
        ranked = self._ranked.get(device)
        for kernel in self.candidates(device) if ranked is None else ranked:
            if _accepts(kernel, args, kwargs)[0]:
                return kernel, device
        return None, device

    def complete(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``args`` with the trailing ones the dispatcher dropped (those equal to their schema
        default) put back: kernels, ``supports`` and the reference always get every argument.
        ``None`` for a non-optional Tensor (the dispatcher passes it on) is a ``TypeError``."""
        if len(args) < len(self._defaults):
            args = (*args, *self._defaults[len(args) :])
        for i in self._required:
            if args[i] is None:
                raise self._not_a_tensor(list(self._signature.parameters)[i], None)
        return args

    def as_called(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """A user's call's arguments as a kernel receives them: all by position (the schema has
        no keyword-only ones), the omitted ones at their defaults. A call the schema refuses
        (an argument missing or unknown, a non-tensor for a tensor) is a ``TypeError``."""
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.name}(): {exc} (schema: {self.name}{self.schema})") from None
        bound.apply_defaults()
        for name, optional in self._tensors:
            value = bound.arguments[name]
            if not isinstance(value, torch.Tensor) and not (optional and value is None):
                raise self._not_a_tensor(name, value)
        return tuple(bound.arguments.values())

    def _not_a_tensor(self, name: str, value: Any) -> TypeError:
        return TypeError(
            f"{self.name}(): argument {name!r} must be a Tensor, got "
            f"{type(value).__name__} (schema: {self.name}{self.schema})"
        )

    def _route(self, *args: Any, **kwargs: Any) -> Any:
        args = self.complete(args)
        kernel, _ = self.select(args, kwargs)
        return (kernel.fn if kernel else self.reference)(*args, **kwargs)


def _accepts(kernel: Kernel, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[bool, str]:
    if kernel.supports is None:
        return True, "no supports() predicate"
    try:
        ok = bool(kernel.supports(*args, **kwargs))
    except Exception as exc:
        return False, f"supports() raised {type(exc).__name__}: {exc}"
    return ok, "supports() accepted the arguments" if ok else "supports() returned False"


def _lib() -> torch.library.Library:
    global _library
    if _library is None:
        _library = torch.library.Library(NAMESPACE, "FRAGMENT")
    return _library


def _reference_backward(op: Op) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """An autograd formula that differentiates the reference (recomputed in backward); under
    ``create_graph=True`` (backward runs in grad mode) the gradients are themselves
    differentiable, so second-order gradients flow."""

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.tensor_at = [i for i, v in enumerate(inputs) if isinstance(v, torch.Tensor)]
        ctx.others = [None if isinstance(v, torch.Tensor) else v for v in inputs]
        ctx.save_for_backward(*[inputs[i] for i in ctx.tensor_at])

    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        create_graph = torch.is_grad_enabled()
        inputs = list(ctx.others)
        wrt = []
        for i, saved in zip(ctx.tensor_at, ctx.saved_tensors, strict=True):
            differentiable = saved.is_floating_point() or saved.is_complex()
            if create_graph and saved.requires_grad:  # keep it in the graph: second order
                inputs[i] = saved
            else:
                inputs[i] = saved.detach().requires_grad_(differentiable)
            if differentiable:
                wrt.append(i)
        with torch.enable_grad():
            out = op.reference(*inputs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        # integer outputs (indices) have no gradient: their zero grads are not followed
        pairs = [
            (o, g) for o, g in zip(outs, grads, strict=True) if g is not None and o.requires_grad
        ]
        result: list[Any] = [None] * len(inputs)
        if not pairs or not wrt:
            return tuple(result)
        found = torch.autograd.grad(
            [o for o, _ in pairs],
            [inputs[i] for i in wrt],
            [g for _, g in pairs],
            allow_unused=True,
            create_graph=create_graph,
        )
        for i, g in zip(wrt, found, strict=True):
            result[i] = g
        return tuple(result)

    return backward, setup_context


_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_PLAIN_CPU = {
    _CPU_KEYS.raw_repr(),
    _CPU_KEYS.add(torch._C.DispatchKey.ADInplaceOrView).raw_repr(),
}
"""Dispatch key sets below autograd that hold nothing but the CPU kernel (no fake tensors, no
dispatch modes, no functionalization): a call that needs no gradient goes straight to it."""


def _tensor_list(t: Any) -> bool:
    """Whether a schema type is a list of (optional) tensors."""
    return isinstance(t, torch._C.ListType) and "Tensor" in str(t.getElementType())


def _name_of(fn: Callable[..., Any] | None) -> str:
    """``fn``'s module and qualified name (the same for a function of a plugin loaded twice)."""
    if fn is None:
        return "None"
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


_AUTOCAST_KEYS = tuple(k for k in torch._C.DispatchKey.__members__ if k.startswith("Autocast"))


def _autocast_kernel(op: Op, cast: Callable[..., tuple[Any, ...]], key: str) -> Callable[..., Any]:
    """The op's kernel for dispatch key ``key`` (autocast on for a device type): the arguments
    cast by ``cast``, then the op with ``key`` off, as autocast runs torch's own ops; eager,
    traced and compiled calls then take the same dtypes."""
    off = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

    def kernel(*args: Any) -> Any:
        args = tuple(cast(*op.complete(args)))
        with torch._C._ExcludeDispatchKeyGuard(off):
            return op.packet.default(*args)

    return kernel


def _autograd_kernel(
    op: Op, backward: Callable[..., Any], setup_context: Callable[..., Any]
) -> Callable[..., Any]:
    """The op's kernel for the Autograd dispatch key: the reference under a ``torch.func``
    transform or forward-mode AD (``backward`` is a reverse-mode formula only); records
    ``backward`` when an input needs a gradient; otherwise calls the kernel below autograd,
    directly for plain CPU tensors (a redispatch through torch.library costs a Python round
    trip per call, and each one is slow right after a large matmul has evicted the interpreter
    from the caches)."""

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, keyset: Any, *args: Any) -> Any:
            with torch._C._AutoDispatchBelowAutograd():
                out = op.packet.default.redispatch(keyset & _AFTER_AUTOGRAD, *args)
            setup_context(ctx, op.complete(args), out)
            return out

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            flags = ctx.needs_input_grad
            ctx.needs_input_grad = flags[1:]  # the formula sees the op's inputs only
            try:
                result = backward(ctx, *grads)
            finally:
                ctx.needs_input_grad = flags
            return (None, *(result if isinstance(result, tuple) else (result,)))

    Function.__name__ = Function.__qualname__ = f"spore_{op.name}"
    # the graph's node (grad_fn) is named after the class as it was defined: name it too
    Function._backward_cls.__name__ = Function._backward_cls.__qualname__ = (
        f"Spore_{op.name}Backward"
    )

    def kernel(keyset: Any, *args: Any) -> Any:
        if torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0:
            return op.reference(*op.complete(args))  # its ops carry the transform/tangents
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return Function.apply(keyset, *args)
        below = keyset & _AFTER_AUTOGRAD
        if below.raw_repr() in _PLAIN_CPU:
            return op._route(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op.packet.default.redispatch(below, *args)

    return kernel


def define(
    name: str,
    schema: str,
    *,
    reference: Callable[..., Any],
    fake: Callable[..., Any] | None = None,
    backward: Callable[..., Any] | None = None,
    setup_context: Callable[..., Any] | None = None,
    autocast: Callable[..., tuple[Any, ...]] | None = None,
) -> Op:
    """Define ``torch.ops.spore.<name>`` once per process and return its :class:`Op`.

    ``schema`` is the argument part, e.g. ``"(Tensor x, Tensor w, float eps) -> Tensor"``.
    ``autocast(*args)``, where given, returns every argument (by position) as the kernels take
    them under ``torch.autocast`` (e.g. tensors cast to ``torch.get_autocast_dtype``): the op
    calls it first when autocast is on for the arguments' device, and :func:`explain` too.

    Defining the same name again with the same schema returns the existing op (so a plugin can
    be loaded twice); a different schema is an error.
    """
    if not name.isidentifier():
        raise ValueError(f"op name must be a Python identifier, got {name!r}")
    if not callable(reference):
        raise TypeError(
            f"op {name!r}: reference must be callable (the op in plain torch), got {reference!r}"
        )
    for what, fn in (
        ("fake", fake),
        ("backward", backward),
        ("setup_context", setup_context),
        ("autocast", autocast),
    ):
        if fn is not None and not callable(fn):
            raise TypeError(f"op {name!r}: {what} must be callable or None, got {fn!r}")
    if (backward is None) != (setup_context is None):
        raise ValueError(f"op {name!r}: give both backward and setup_context, or neither")
    with _lock:
        existing = _ops.get(name)
        if existing is not None:
            if existing.schema != schema:
                raise DuplicateRegistrationError(
                    f"op spore::{name} is already defined with schema {existing.schema!r}; "
                    f"cannot redefine it as {schema!r}"
                )
            if _name_of(existing._autocast) != _name_of(autocast):
                raise DuplicateRegistrationError(
                    f"op spore::{name} is already defined with autocast="
                    f"{_name_of(existing._autocast)}; cannot redefine it with autocast="
                    f"{_name_of(autocast)}"
                )
            return existing
        op = Op(name, schema, reference, _autocast=autocast)
        lib = _lib()
        parsed = torch._C.parse_schema(f"{NAMESPACE}::{name}{schema}")
        if any(a.kwarg_only for a in parsed.arguments):
            raise ValueError(
                f"op {name!r}: keyword-only arguments are not supported; make them positional"
            )
        if any(_tensor_list(a.type) for a in (*parsed.arguments, *parsed.returns)):
            raise ValueError(
                f"op {name!r}: tensor lists (Tensor[]) are not supported as arguments or "
                f"results; pass the tensors one by one"
            )
        if parsed.is_mutable:
            raise ValueError(
                f"op {name!r}: schema {schema!r} writes to an argument (Tensor(a!)); Spore ops "
                "are functional (their autograd would not see the write): return a new tensor"
            )
        op._defaults = tuple(a.default_value for a in parsed.arguments)
        op._signature = inspect.Signature(
            [
                inspect.Parameter(
                    a.name,
                    inspect.Parameter.POSITIONAL_OR_KEYWORD,
                    default=a.default_value if a.has_default_value() else inspect.Parameter.empty,
                )
                for a in parsed.arguments
            ]
        )
        op._tensors = tuple(
            (a.name, isinstance(a.type, torch._C.OptionalType))
            for a in parsed.arguments
            if "Tensor" in str(a.type) and not _tensor_list(a.type)
        )
        op._required = tuple(
            i for i, a in enumerate(parsed.arguments) if (a.name, False) in op._tensors
        )
        for i in op._required:
            if parsed.arguments[i].has_default_value():
                arg = parsed.arguments[i].name
                raise ValueError(
                    f"op {name!r}: Tensor {arg} has a default, but a Tensor argument cannot be "
                    f"None; declare it optional: Tensor? {arg}=None"
                )
        lib.define(f"{name}{schema}")
        lib.impl(name, op._route, "CompositeExplicitAutograd")
        shapes = fake or reference
        torch.library.register_fake(op.qualname, lambda *a: shapes(*op.complete(a)), lib=lib)
        if backward is None:
            backward, setup_context = _reference_backward(op)
        lib.impl(name, _autograd_kernel(op, backward, setup_context), "Autograd", with_keyset=True)
        # under vmap: the reference on the batched tensors, whose own ops have batching rules
        # (with none registered torch runs the kernel once a sample, warning each call)
        lib.impl(
            name,
            lambda _, *args: reference(*op.complete(args)),
            "FuncTorchBatched",
            with_keyset=True,
        )
        if any(isinstance(r.type, torch._C.OptionalType) for r in parsed.returns):
            # the older vmap (autograd.grad(is_grads_batched=True), gradcheck's batched check)
            # runs the kernel once a sample too, but not for an optional result: the reference
            lib.impl(name, lambda *args: reference(*op.complete(args)), "Batched")
        if autocast is not None:
            for key in _AUTOCAST_KEYS:
                lib.impl(name, _autocast_kernel(op, autocast, key), key)
        _ops[name] = op
        return op


def get(name: str) -> Op:
    """The op defined as ``name``; ``KeyError`` lists the defined ones."""
    try:
        return _ops[name.removeprefix(f"{NAMESPACE}::")]
    except KeyError:
        known = ", ".join(sorted(_ops)) or "none"
        raise KeyError(
            f"no spore op named {name!r} (defined: {known}); an op exists once the module "
            f"defining it is imported (spore.plugins.get_manager().load() loads every plugin)"
        ) from None


def defined() -> list[Op]:
    """Every op defined in this process, by name."""
    return [_ops[n] for n in sorted(_ops)]


def _as_op(op: Op | str | Any) -> Op:
    """The spore op ``op`` names: an :class:`Op`, its name, or ``torch.ops.spore.<name>`` (or
    one of its overloads); an op of another namespace (``torch.ops.aten.add``) is refused."""
    if isinstance(op, Op):
        return op
    if isinstance(op, str):
        return get(op)
    if isinstance(op, torch._ops.OpOverload):
        qualname = op._schema.name
    elif isinstance(op, torch._ops.OpOverloadPacket):
        qualname = op._qualified_op_name
    else:
        raise TypeError(
            f"expected a spore op (a spore.dispatch.Op, its name or torch.ops.spore.<name>), "
            f"got {type(op).__name__} {op!r}"
        )
    namespace, _, name = qualname.partition("::")
    if namespace != NAMESPACE:
        raise ValueError(
            f"{qualname} is not a spore op: kernels and explain() take ops defined through "
            f"spore.dispatch.define (torch.ops.spore.<name>)"
        )
    return get(name)


def _check_provider(provider: object, what: str) -> None:
    """Refuse anything but a non-empty str (a plugin or package name) for ``what``: kernels
    are ranked and withdrawn by it."""
    if not isinstance(provider, str):
        raise TypeError(
            f"{what} must be a str naming the plugin or package that registers it, got "
            f"{type(provider).__name__} {provider!r}"
        )
    if not provider:
        raise ValueError(f"{what} must name the plugin or package that registers it, got ''")


def register_kernel(
    op: Op | str,
    device: str,
    fn: Callable[..., Any],
    *,
    provider: str,
    priority: int = 0,
    supports: Callable[..., bool] | None = None,
    override: bool = False,
) -> Kernel:
    """Add ``provider``'s kernel for ``device`` (a device type: cpu, cuda, npu, ...).

    The same (op, device, provider) twice is an error naming the provider, unless ``override``
    or it is the very same function (a plugin loaded twice).
    """
    target = _as_op(op)
    check_device_type(device, "device")
    _check_provider(provider, "a kernel's provider")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"a kernel's priority must be an int, got {priority!r}")
    if not callable(fn):
        raise TypeError(f"a kernel must be callable, got {fn!r}")
    if supports is not None and not callable(supports):
        raise TypeError(f"supports must be callable or None, got {supports!r}")
    kernel = Kernel(target.name, device, provider, fn, priority, supports)
    with _lock:
        old = target.kernels.get((device, provider))
        if old is not None and old.fn is not fn and not override:
            raise DuplicateRegistrationError(
                f"{provider!r} already registered a {device} kernel for spore::{target.name}; "
                f"pass override=True to replace it"
            )
        target._set_kernels({**target.kernels, (device, provider): kernel})
    return kernel


class Registrar:
    """The ops registry's ``define``/``kernel`` calls, made straight onto this module under
    ``provider``: how a package registers its ops at import, without the plugin manager.

    When the plugin manager later hands the package's ``spore_register_ops`` hook the ops
    registry, the same calls define nothing new and record the ops and kernels as the plugin's.

    .. versionadded:: 0.1.0
    """

    def __init__(self, provider: str) -> None:
        _check_provider(provider, "Registrar's provider")
        self.provider = provider

    def define(self, name: str, schema: str, **kwargs: Any) -> Op:
        """:func:`define`."""
        return define(name, schema, **kwargs)

    def kernel(
        self,
        op: Op | str,
        device: str,
        fn: Callable[..., Any],
        *,
        priority: int = 0,
        supports: Callable[..., bool] | None = None,
        provider: str | None = None,
    ) -> Kernel:
        """:func:`register_kernel` as ``provider`` (given or not) or the given sub-provider
        ``"<provider>:<name>"``."""
        if provider is not None:
            check_sub_provider(provider, self.provider, f"registrar {self.provider!r}")
        return register_kernel(
            op, device, fn, provider=provider or self.provider, priority=priority, supports=supports
        )


def unregister_provider(provider: str) -> None:
    """Remove every kernel ``provider`` and its sub-providers (``"<provider>:<name>"``)
    registered (ops stay defined)."""
    prefix = f"{provider}:"
    with _lock:
        for op in _ops.values():
            kept = {
                k: v
                for k, v in op.kernels.items()
                if k[1] != provider and not k[1].startswith(prefix)
            }
            op._set_kernels(kept)


def explain(op: Op | str | Any, *args: Any, **kwargs: Any) -> Explanation:
    """Which kernel would run for these arguments, and why each other one would not; under
    ``torch.autocast`` an op defined with ``autocast`` is judged on the arguments it casts."""
    target = _as_op(op)
    args, kwargs = target.as_called(args, kwargs), {}
    device = _device_of(args, kwargs)
    cast = target._autocast
    on = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
    if cast is not None and on:
        args = tuple(cast(*args))
    chosen: Kernel | None = None
    candidates = []
    for kernel in target.candidates(device):
        if chosen is not None:
            rank = (
                "has a higher priority"
                if chosen.priority > kernel.priority
                else "sorts first at the same priority (provider names break ties)"
            )
            reason = f"{chosen.provider} {rank} and accepts the arguments"
            candidates.append(Candidate(kernel.provider, kernel.priority, False, reason))
            continue
        ok, reason = _accepts(kernel, args, kwargs)
        if ok:
            chosen = kernel
        candidates.append(Candidate(kernel.provider, kernel.priority, ok, reason))
    if not candidates:
        others = sorted({dev for dev, _ in target.kernels})
        note = f"no kernel for {device}" + (
            f" (kernels for: {', '.join(others)})" if others else ""
        )
        candidates.append(Candidate(REFERENCE, 0, True, note))
    elif chosen is None:
        candidates.append(Candidate(REFERENCE, 0, True, "no kernel accepted the arguments"))
    return Explanation(target.name, device, chosen.provider if chosen else REFERENCE, candidates)
