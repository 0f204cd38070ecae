"""Graph passes and how they run inside Inductor: pass types, one multiplexer per slot.

This is the mechanism; :mod:`spore.passes` turns it on for users. Stages map to Inductor's
config slots: ``pre_grad`` → ``pre_grad_custom_pass``, ``joint`` → ``joint_custom_post_pass``,
``post_grad`` → ``post_grad_custom_post_pass``. A multiplexer is built for a pass registry (it
receives the registry and reads it at each compile) and runs whatever the slot held before (a
user's pass is chained, never overwritten), then the registry's passes for its stage in
priority order (highest first), skipping those whose ``device`` filter does not match the
graph. Its ``uuid()`` combines the stage, every pass's name, function or class, code (the
files defining it), version, own ``uuid()`` where it has one, priority, device, owner and owner
version, and the chained pass's uuid, so Inductor's FX graph cache is neither
bypassed nor stale; a chained pass without a uuid (a plain function) makes it ``None``, so
Inductor bypasses the cache as it would without Spore. Passes must be idempotent (joint
passes can run twice).

A multiplexer goes into Inductor's config in one of two ways: for one compile, as config
patches given to ``compile_fx`` (:func:`compile_fx`, behind ``backend="spore"``), or for every
later compile in the process (:func:`install`).
"""

from __future__ import annotations

import collections
import contextlib
import difflib
import functools
import hashlib
import inspect
import operator
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spore.registry import PassRegistry

STAGES = {
    "pre_grad": "pre_grad_custom_pass",
    "joint": "joint_custom_post_pass",
    "post_grad": "post_grad_custom_post_pass",
}

_lock = threading.Lock()
_stats: dict[str, int] = {}
_totals: collections.Counter[str] = collections.Counter()


def check_stage(stage: str) -> None:
    """Raise ``ValueError`` naming the stages when ``stage`` is not one of them."""
    if stage not in STAGES:
        raise ValueError(f"unknown pass stage {stage!r}; choose one of {', '.join(STAGES)}")


class GraphPass:
    """A whole-graph pass: ``__call__(gm) -> int`` (the number of rewrites it made)."""

    name: str = ""
    version: str = "1"

    def __call__(self, gm: Any) -> int:
        raise UndefinedPassMethodError(
            self, "__call__(gm)", "a GraphPass defines __call__(gm) -> int"
        )


class UndefinedPassMethodError(NotImplementedError):
    """A pass class left out ``method``: names the pass (``name``, else the pass's ``name`` or
    its class's), the class and what it must define (``needs``).

    .. versionadded:: 0.1.0
    """

    def __init__(self, pass_: GraphPass, method: str, needs: str, name: str = "") -> None:
        self.pass_, self.method, self.needs = pass_, method, needs
        name = name or pass_.name or type(pass_).__name__
        super().__init__(
            f"pass {name!r} ({type(pass_).__qualname__}) does not define {method}; {needs}"
        )

    def named(self, name: str) -> UndefinedPassMethodError:
        """The same error naming the pass ``name`` (the name it is registered under)."""
        return UndefinedPassMethodError(self.pass_, self.method, self.needs, name)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (sent to another process) as its message, the pass left behind."""
        return (_undefined_from_message, (type(self), str(self), self.method, self.needs))


def _undefined_from_message(
    cls: type[UndefinedPassMethodError], message: str, method: str, needs: str
) -> UndefinedPassMethodError:
    """An unpickled :class:`UndefinedPassMethodError`: its message, without the pass."""
    error = cls.__new__(cls)
    NotImplementedError.__init__(error, message)
    error.pass_, error.method, error.needs = None, method, needs
    return error


_PATTERN_NEEDS = (
    "a PatternToPatternPass defines pattern(), replacement() and example_inputs() (or "
    "search_forms())"
)


@dataclass(frozen=True)
class SearchForm:
    """One form of what a :class:`PatternToPatternPass` rewrites.

    ``pattern`` is a plain torch function, traced on ``example_inputs()`` into the aten graph
    to search for; ``replacement`` and ``extra_check`` take the pass's own methods when
    ``None``. The example inputs' dtypes choose the trace: ``F.gelu`` on bfloat16 traces with
    the casts to float32 and back that a bfloat16 graph holds, so each dtype is a form.

    .. versionadded:: 0.1.0
    """

    pattern: Callable[..., Any]
    example_inputs: Callable[[], list[Any]]
    replacement: Callable[..., Any] | None = None
    extra_check: Callable[[Any], bool] | None = None


class PatternToPatternPass(GraphPass):
    """Rewrite every match of ``pattern`` into ``replacement`` (aten-level: post_grad, joint;
    registering one at pre_grad is a ``ValueError``).

    Subclasses define ``pattern(*args)``, ``replacement(*args)`` (plain torch functions with
    the same arguments), ``example_inputs()`` (tensors to trace both with) and optionally
    ``extra_check(match) -> bool`` (a dtype/shape/numerics guard; the match's node args hold
    fake tensors in ``.meta["val"]``). A pass that rewrites several forms of one computation
    (operand orders, dtypes, hand-written variants) overrides :meth:`search_forms` instead of
    ``pattern``; its forms share ``replacement`` and ``extra_check`` or bring their own.

    ``reshape_views = True`` traces every view in the forms (and replacements) as a reshape,
    which is how a post_grad graph holds them: Inductor turns each view into a reshape before
    its post-grad passes, so a post_grad pattern with a view matches only with it on. Leave it
    off for a joint pass (the joint graph keeps its views).

    .. versionadded:: 0.1.0
       :meth:`search_forms` (several forms in one pass) and ``reshape_views``.
    """

    reshape_views: bool = False

    def pattern(self, *args: Any) -> Any:
        raise UndefinedPassMethodError(self, "pattern()", _PATTERN_NEEDS)

    def replacement(self, *args: Any) -> Any:
        raise UndefinedPassMethodError(self, "replacement()", _PATTERN_NEEDS)

    def example_inputs(self) -> list[Any]:
        raise UndefinedPassMethodError(self, "example_inputs()", _PATTERN_NEEDS)

    def extra_check(self, match: Any) -> bool:
        return True

    def search_forms(self) -> Sequence[SearchForm]:
        """The forms to rewrite; at each node (last node first) they are tried in this order.

        The default is the one form ``pattern`` on ``example_inputs()``.

        .. versionadded:: 0.1.0
        """
        return (SearchForm(self.pattern, self.example_inputs),)

    def _matcher(self) -> Any:
        matcher = self.__dict__.get("_spore_matcher")
        if matcher is None:
            from torch._inductor.pattern_matcher import (
                PatternMatcherPass,
                fwd_only,
                register_replacement,
            )

            trace = _trace_with_reshapes if self.reshape_views else fwd_only
            matcher = PatternMatcherPass(pass_name=self.name or type(self).__name__)
            for form in self.search_forms():
                register_replacement(
                    form.pattern,
                    self.replacement if form.replacement is None else form.replacement,
                    form.example_inputs(),
                    trace,
                    matcher,
                    extra_check=self.extra_check if form.extra_check is None else form.extra_check,
                )
            self.__dict__["_spore_matcher"] = matcher
        return matcher

    def __call__(self, gm: Any) -> int:
        return int(self._matcher().apply(gm.graph) or 0)


def _trace_with_reshapes(fn: Callable[..., Any], args: Sequence[Any], **kwargs: Any) -> Any:
    """``fn`` as an aten graph (Inductor's ``fwd_only``) with its views written as reshapes."""
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch._inductor.pattern_matcher import fwd_only

    gm = fwd_only(fn, args, **kwargs)
    view_to_reshape(gm)
    return gm


@dataclass(frozen=True)
class PassEntry:
    """A registered pass and where it runs."""

    name: str
    pass_: GraphPass | Callable[[Any], int | None]
    stage: str
    priority: int = 0
    device: str | None = None
    held: tuple[Any, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:  # the pass's settings as registered (see cache_key)
        object.__setattr__(self, "held", tuple(_held(_unbound(self.pass_)[0])))

    @property
    def version(self) -> str:
        return str(getattr(_unbound(self.pass_)[0], "version", "1"))

    def cache_key(self) -> str | None:
        """This pass's part of the FX graph cache key: what it is (its function or class, the
        arguments a ``functools.partial`` binds, and the plain constants an instance's public
        attributes or a closure's cells held when it was registered), its version and, for a
        pass with a ``uuid()`` (Inductor's ``CustomGraphPass``), that, and its code (see
        :func:`_code_digest`); ``None`` (the cache is
        then bypassed) when that ``uuid()`` is ``None`` or a bound argument is not a plain
        constant whose repr stands for its value (a tensor's repr is shortened). Other state,
        and what changes after registration (a run counter), is not seen: a pass whose
        behaviour depends on it changes its version or its ``uuid()``."""
        fn, bound = _unbound(self.pass_)
        if not all(_constant(value) for value in bound):
            return None
        kind = fn if hasattr(fn, "__qualname__") else type(fn)
        key = f"{getattr(kind, '__module__', '')}.{kind.__qualname__}"
        key += "".join(f"({b!r})" for b in bound) + "".join(f"[{v!r}]" for v in self.held)
        key += f":{self.version}@{_code_digest(kind)}"
        own = getattr(fn, "uuid", None)
        if callable(own):
            uuid = own()
            if uuid is None:
                return None
            key += f":{uuid!r}"
        return key


def _code_digest(kind: Any) -> str:
    """A digest of ``kind``'s code (a pass's function or class): the contents of the files
    that define it and, for a class, its bases; where one has no file (a notebook cell,
    ``exec``), its code objects. An edited pass is a new key."""
    owners = [kind] if not isinstance(kind, type) else [c for c in kind.__mro__ if c is not object]
    digest = hashlib.sha256()
    for owner in owners:
        path = getattr(sys.modules.get(getattr(owner, "__module__", "") or ""), "__file__", None)
        source = _file_digest(path) if isinstance(path, str) else None
        digest.update(source.encode() if source is not None else _code_bytes(owner))
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=256)
def _digest_at(path: str, mtime_ns: int, size: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _file_digest(path: str) -> str | None:
    """The digest of the file at ``path``, read again only when its mtime or size changes;
    ``None`` when it cannot be read."""
    try:
        stat = os.stat(path)
        return _digest_at(path, stat.st_mtime_ns, stat.st_size)
    except OSError:
        return None


def _code_bytes(owner: Any) -> bytes:
    """The code of a function, or of the functions a class defines, as bytes."""
    if not isinstance(owner, type):
        code = getattr(inspect.unwrap(getattr(owner, "__func__", owner)), "__code__", None)
        return _code_text(code) if code is not None else repr(owner).encode()
    parts = []
    for name, value in sorted(vars(owner).items()):
        value = getattr(value, "__func__", getattr(value, "fget", value))  # static/class/property
        code = getattr(value, "__code__", None)
        if code is not None:
            parts.append(name.encode() + _code_text(code))
    return b"\0".join(parts)


def _code_text(code: Any) -> bytes:
    """A code object's bytecode, names and constants (nested code objects alike), as bytes:
    the same in every call (marshal's output follows reference counts)."""
    consts = (_const_text(c) for c in code.co_consts)
    names = repr((code.co_names, code.co_varnames, code.co_freevars)).encode()
    return b"\1".join([code.co_code, names, *consts])


def _const_text(value: Any) -> bytes:
    """A code object's constant as bytes: a nested code object's :func:`_code_text`, a
    frozenset's sorted members (its repr's order follows the hash seed), else its repr."""
    if inspect.iscode(value):
        return _code_text(value)
    if isinstance(value, frozenset):
        return b"{" + b",".join(sorted(_const_text(v) for v in value)) + b"}"
    return repr(value).encode()


def _unbound(fn: Any) -> tuple[Any, list[Any]]:
    """The callable under any ``functools.partial`` layers, and what those bind (outermost
    first: each layer's positional arguments, then its keywords as pairs)."""
    bound: list[Any] = []
    while isinstance(fn, functools.partial):
        bound += [*fn.args, *sorted(fn.keywords.items())]
        fn = fn.func
    return fn, bound


def _held(fn: Any) -> list[Any]:
    """The plain constants a pass object holds beyond its qualname: a function's closure cells
    and defaults, an instance's (or a bound method's instance's) public attributes as (name,
    value) pairs (``ScaleMul(3.0)`` and ``ScaleMul(5.0)`` are two passes)."""
    if inspect.ismethod(fn):
        return [*_held(fn.__func__), *_held(fn.__self__)]
    if inspect.isfunction(fn):
        held = [*(fn.__defaults__ or ()), *sorted((fn.__kwdefaults__ or {}).items())]
        for cell in fn.__closure__ or ():
            with contextlib.suppress(ValueError):  # a cell not yet filled
                held.append(cell.cell_contents)
        return [v for v in held if _constant(v)]
    attrs = getattr(fn, "__dict__", {})
    return [(k, v) for k, v in sorted(attrs.items()) if not k.startswith("_") and _constant(v)]


_CONSTANTS = (bool, int, float, complex, str, bytes, type(None))


def _constant(value: Any) -> bool:
    """A value whose repr stands for it: a plain constant, or a tuple, list or dict of them
    (a keyword is a (name, value) pair)."""
    if isinstance(value, (tuple, list)):  # not sets: their repr's order is the hash seed's
        return all(_constant(v) for v in value)
    if isinstance(value, dict):
        return all(_constant(k) and _constant(v) for k, v in value.items())
    return type(value) in _CONSTANTS


def _graph_device(gm: Any) -> str | None:
    """The device of the graph's first tensor input (dynamo's pre-grad graphs keep it as
    ``example_value``, later stages as ``val``); ``None`` when it has none."""
    for node in gm.graph.nodes:
        value = node.meta.get("val", node.meta.get("example_value"))
        device = getattr(value, "device", None)
        if node.op == "placeholder" and device is not None:
            return device.type
    return None


def run_passes(gm: Any, entries: list[PassEntry]) -> dict[str, int]:
    """Run ``entries`` on ``gm`` in priority order; rewrites per pass name. ``gm`` is
    recompiled after each pass that counted a rewrite or returned ``None`` (not counted)."""
    device = _graph_device(gm)
    counts: dict[str, int] = {}
    for entry in sorted(entries, key=lambda e: (-e.priority, e.name)):
        if entry.device is not None and device is not None and entry.device != device:
            continue
        result = _run(entry, gm)
        counts[entry.name] = _count(entry.name, result)
        if result is None or counts[entry.name]:
            gm.graph.lint()
            gm.recompile()
    with _lock:
        _stats.update(counts)
        _totals.update(counts)
    return counts


def _run(entry: PassEntry, gm: Any) -> Any:
    """``entry``'s pass on ``gm``; a method its class left out is named with the pass's
    registered name (its ``name`` attribute or class name may differ)."""
    try:
        return entry.pass_(gm)
    except UndefinedPassMethodError as exc:
        if exc.pass_ is not _unbound(entry.pass_)[0]:  # another pass that it ran
            raise
        raise exc.named(entry.name).with_traceback(exc.__traceback__) from None


def _count(name: str, result: Any) -> int:
    """A pass's result as its number of rewrites (``None``: 0); a clear error for any other
    (a pass returning the graph, as FX passes often do)."""
    if result is None:
        return 0
    try:
        return operator.index(result)  # an int, a bool, a numpy integer
    except TypeError:
        from torch.fx import GraphModule  # FX names its class after what it traced

        kind = "the GraphModule" if isinstance(result, GraphModule) else type(result).__name__
        raise TypeError(
            f"pass {name!r} returned {kind}; a spore pass rewrites the graph in place and "
            f"returns how many rewrites it made (an int, or None)"
        ) from None


def apply(gm: Any, registry: PassRegistry, stage: str = "post_grad") -> dict[str, int]:
    """Run ``registry``'s passes for ``stage`` on any FX GraphModule (no compile)."""
    check_stage(stage)
    return run_passes(gm, registry.for_stage(stage))


def stats() -> dict[str, int]:
    """Rewrites per pass in its most recent run (a compile or :func:`apply`)."""
    with _lock:
        return dict(_stats)


def totals() -> dict[str, int]:
    """Rewrites per pass summed over every run in this process."""
    with _lock:
        return dict(_totals)


@functools.cache
def _multiplexer_class() -> type:
    from torch._inductor.custom_graph_pass import (
        CustomGraphPass,
        CustomInferenceAwareGraphPass,
        get_custom_graph_passes,
    )

    class SporePassMultiplexer(CustomInferenceAwareGraphPass):
        """Spore's pass for one Inductor slot: the slot's previous pass, then a registry's.
        Inference-aware, so Inductor hands it ``is_inference`` where it has it (post-grad) and
        it hands that on to a chained inference-aware pass as Inductor would."""

        def __init__(self, stage: str, registry: PassRegistry, previous: Any) -> None:
            self.stage = stage
            self.registry = registry
            self.previous = previous

        def __call__(self, graph: Any, is_inference: bool | None = None) -> None:
            for earlier in get_custom_graph_passes(self.previous):
                if is_inference is not None and isinstance(earlier, CustomInferenceAwareGraphPass):
                    earlier(graph, is_inference=is_inference)
                else:
                    earlier(graph)
            run_passes(graph.owning_module, self.registry.for_stage(self.stage))

        def uuid(self) -> Any:
            """The cache key; ``None`` (Inductor bypasses its FX graph cache) when a chained pass
            has no uuid, since a cache hit would silently skip that pass."""
            chained = [
                earlier.uuid() if isinstance(earlier, CustomGraphPass) else None
                for earlier in get_custom_graph_passes(self.previous)
            ]
            if None in chained:
                return None
            parts = [f"stage={self.stage}"]
            for e in self.registry.entries():
                p = e.value
                if p.stage == self.stage:
                    key = p.cache_key()
                    if key is None:
                        return None
                    parts.append(
                        f"{p.name}:{key}:{p.priority}:{p.device}:{e.owner}:{e.owner_version}"
                    )
            parts += [f"chained={c!r}" for c in chained]
            return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    return SporePassMultiplexer


def slot_values(registry: PassRegistry, current: Mapping[str, Any]) -> dict[str, Any]:
    """Inductor slot → the multiplexer for ``registry`` that chains what ``current`` holds.

    A slot that already holds this registry's multiplexer keeps it; one that holds a
    multiplexer (of any registry, alone or in a list of passes) gets a new one chaining what
    that one chained and the rest of the list, so no Spore pass runs twice.
    """
    cls = _multiplexer_class()
    values: dict[str, Any] = {}
    for stage, slot in STAGES.items():
        held = current.get(slot)
        if isinstance(held, cls) and held.registry is registry:
            values[slot] = held
            continue
        values[slot] = cls(stage, registry, _chained(held, cls))
    return values


def _chained(held: Any, cls: type) -> Any:
    """What a slot holding ``held`` chains once Spore's multiplexers in it are unwrapped."""
    if isinstance(held, cls):
        return _chained(held.previous, cls)
    if isinstance(held, (list, tuple)):
        passes: list[Any] = []
        for item in held:
            inner = _chained(item, cls)
            if isinstance(inner, list):
                passes += inner
            elif inner is not None:
                passes.append(inner)
        return passes or None
    return held


def _config_now() -> dict[str, Any]:
    from torch._inductor import config

    return {slot: getattr(config, slot) for slot in STAGES.values()}


def install(registry: PassRegistry) -> None:
    """Put ``registry``'s multiplexers in Inductor's slots for every later compile (idempotent)."""
    from torch._inductor import config

    for slot, value in slot_values(registry, _config_now()).items():
        setattr(config, slot, value)


def inductor_options(mode: str | None, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Inductor config patches for ``torch.compile``'s ``mode=`` or ``options=``.

    Raises ``ValueError`` for an unknown option and ``RuntimeError`` (Inductor's) for an
    unknown mode.
    """
    from torch._inductor import config, list_mode_options

    patches = dict(list_mode_options(mode)) if mode and mode != "default" else {}
    known = config.get_config_copy()
    for key, value in (options or {}).items():
        name = key.replace("-", "_")
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"backend='spore' got the unknown Inductor option {key!r}{hint}; "
                f"torch._inductor.list_options() lists the valid ones"
            )
        patches[name] = value
    return patches


def compile_fx(
    gm: Any,
    example_inputs: Any,
    registry: PassRegistry,
    *,
    mode: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> Any:
    """Inductor's ``compile_fx`` with ``registry``'s passes in its slots for this compile only.

    ``mode``/``options`` are ``torch.compile``'s, applied as Inductor config patches; a pass
    given in ``options`` for a slot is chained like one set in Inductor's config.
    """
    from torch._inductor.compile_fx import compile_fx as inductor_compile_fx

    patches = inductor_options(mode, options)
    held = {**_config_now(), **{s: patches[s] for s in STAGES.values() if s in patches}}
    patches.update(slot_values(registry, held))
    return inductor_compile_fx(gm, example_inputs, config_patches=patches)


__all__ = [
    "STAGES",
    "GraphPass",
    "PassEntry",
    "PatternToPatternPass",
    "SearchForm",
    "UndefinedPassMethodError",
    "apply",
    "check_stage",
    "compile_fx",
    "inductor_options",
    "install",
    "run_passes",
    "slot_values",
    "stats",
    "totals",
]
