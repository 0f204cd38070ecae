"""Graphs with symbolic sizes (``torch.compile(..., dynamic=True)``, or dynamo's automatic
dynamic shapes once it has seen a second input shape): the VM takes concrete shapes only, so
:class:`Specializing` compiles such a graph again for each set of sizes it is called with — the
sizes substituted into a copy of the graph, then :func:`dvm.compile.compile_graph` — instead of
leaving every node to eager. The compiles of the sets used last are kept; a set whose compile
was dropped and comes back shows that more sets are in use than kept, so one more is kept from
then on. A graph compiles at most ``compiles`` different sets, each at most twice (a compile
takes milliseconds and leaves ~1.3 KB that torch never frees): past that, a new set runs
eagerly, through one :func:`dvm.compile.eager_graph` that counts those calls.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule, Node
from torch.utils._pytree import tree_map

from dvm.compile import CompiledGraph, eager_graph
from dvm.executor import Executor

LIMIT = 16
"""Number of sets of sizes a :class:`Specializing` keeps compiles for at first (the least
recently used dropped first); one more for each dropped set that comes back."""

COMPILES = 256
"""Default number of different sets of sizes a :class:`Specializing` compiles."""

_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)
Env = dict[sympy.Symbol, sympy.Integer]


def _is_symbolic(v: Any) -> bool:
    if isinstance(v, _SYM):
        return True
    if isinstance(v, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in (*v.shape, *v.stride()))
    return False


def symbolic_inputs(gm: GraphModule) -> list[int]:
    """Positions of ``gm``'s inputs whose fake value has a symbolic size: a SymInt, or a tensor
    with a symbolic size or stride."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [i for i, n in enumerate(placeholders) if _is_symbolic(n.meta.get("val"))]


def _bind(env: Env, sym: Any, value: Any) -> None:
    """Record ``sym = value`` where ``sym`` is a plain symbol (other expressions are checked
    once every symbol is bound)."""
    expr = sym.node.expr
    if isinstance(expr, sympy.Symbol) and expr not in env:
        env[expr] = sympy.Integer(value)


class Unbound(ValueError):
    """A size that depends on a symbol no input gives (one from data, as after ``nonzero``)."""


def _value(sym: Any, env: Env) -> Any:
    expr = sympy.sympify(sym.node.expr).xreplace(env)
    if expr.free_symbols:
        names = ", ".join(sorted(map(str, expr.free_symbols)))
        raise Unbound(f"size {sym} depends on {names}, which no input gives")
    if isinstance(sym, torch.SymBool):
        return bool(expr)
    return float(expr) if isinstance(sym, torch.SymFloat) else int(expr)


def bindings(placeholders: Sequence[Node], args: Sequence[Any], symbolic: Sequence[int]) -> Env:
    """Each size symbol's value, read off the inputs at ``symbolic`` positions; ``ValueError``
    when an input disagrees with them (a size the symbols give otherwise). Strides are not
    checked: an input may come with other strides than traced (a backward graph's tangent
    does), and the VM reads each input's real strides at every call."""
    env: Env = {}
    for i in symbolic:
        val, arg = placeholders[i].meta["val"], args[i]
        if isinstance(val, _SYM):
            _bind(env, val, arg)
            continue
        for s, a in zip((*val.shape, *val.stride()), (*arg.shape, *arg.stride()), strict=True):
            if isinstance(s, torch.SymInt):
                _bind(env, s, a)
    for i in symbolic:
        val, arg = placeholders[i].meta["val"], args[i]
        if isinstance(val, _SYM):
            got, want = _value(val, env), arg
        else:
            got = tuple(_value(s, env) if isinstance(s, torch.SymInt) else s for s in val.shape)
            want = tuple(arg.shape)
        if got != want:
            raise ValueError(f"input {i} is {want}; the graph's sizes make it {got}")
    return env


class _Concrete:
    """Fake values with the sizes ``env`` gives, made in a mode without symbolic sizes (each
    size expression worked out once); a value with a size no input gives stays as it is."""

    def __init__(self, env: Env, mode: FakeTensorMode) -> None:
        self.env, self.mode = env, mode
        self.made: dict[tuple[Any, ...], torch.Tensor] = {}
        self.values: dict[Any, Any] = {}

    def int(self, s: Any) -> Any:
        if not isinstance(s, _SYM):
            return s
        key = (type(s), s.node.expr)
        v = self.values.get(key)
        if v is None:
            v = self.values[key] = _value(s, self.env)
        return v

    def __call__(self, v: Any) -> Any:
        try:
            return self._concrete(v)
        except Unbound:
            return v

    def _concrete(self, v: Any) -> Any:
        if isinstance(v, _SYM):
            return self.int(v)
        if not (isinstance(v, torch.Tensor) and _is_symbolic(v)):
            return v
        shape = tuple(self.int(s) for s in v.shape)
        stride = tuple(self.int(s) for s in v.stride())
        key = (shape, stride, v.dtype, v.device)
        t = self.made.get(key)
        if t is None:
            with self.mode:
                t = torch.empty_strided(shape, stride, dtype=v.dtype, device=v.device)
            self.made[key] = t
        return t


def static_graph(gm: GraphModule, env: Env, mode: FakeTensorMode) -> GraphModule:
    """A copy of ``gm`` for the sizes ``env`` gives: every fake value concrete, and every size
    worked out from the symbols an ``int`` argument instead of the node computing it (which is
    not copied; a size input stays an input). Values whose sizes come from data keep their
    symbolic sizes (so their nodes stay eager) and the nodes computing such sizes stay."""
    concrete = _Concrete(env, mode)
    graph = Graph()
    copied: dict[Node, Any] = {}
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder":
            copied[n] = graph.node_copy(n)
        if isinstance(val, _SYM):
            size = concrete(val)
            if not isinstance(size, _SYM):
                copied[n] = size  # its readers get the int
    graph.output(graph.graph_copy(gm.graph, copied))
    for n in graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, (*_SYM, torch.Tensor)):
            n.meta["val"] = concrete(val)
        elif val is not None:
            n.meta["val"] = tree_map(concrete, val)
    return GraphModule(gm, graph)


class Specializing:
    """``gm``, a graph with symbolic sizes, compiled by ``compile(static_gm, args)`` for each
    set of sizes it is called with (the compiles of the ``limit`` sets used last kept). A set
    it cannot specialise runs ``gm`` eagerly, with one warning and the reason in ``failures``.
    A set whose compile was dropped (``dropped``) that comes back is compiled again and
    ``limit`` grows by one, so a loop over N sets ends with all N kept. Once ``compiles``
    different sets have been compiled, a new set runs ``gm`` eagerly, with one warning whose
    text ``eager_reason`` keeps: through ``eager``, a :func:`dvm.compile.eager_graph` made on
    the first such call and handed to ``on_eager`` then, whose ``eager_calls`` (and this
    object's) count those calls. ``symbolic``: :func:`symbolic_inputs` of ``gm`` when the
    caller has it. ``specialize_us``: each specialisation's time (the copy and the compile),
    in µs."""

    def __init__(
        self,
        gm: GraphModule,
        compile: Callable[[GraphModule, Sequence[Any]], Callable[..., Any]],
        *,
        limit: int = LIMIT,
        compiles: int = COMPILES,
        symbolic: Sequence[int] | None = None,
        on_eager: Callable[[CompiledGraph], None] | None = None,
    ) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        if compiles < 1:
            raise ValueError(f"compiles must be at least 1, got {compiles}")
        self._gm, self._compile, self.limit, self.compiles = gm, compile, limit, compiles
        self._placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self._symbolic = symbolic_inputs(gm) if symbolic is None else list(symbolic)
        # without torch's fake-tensor dispatch cache, shared by every mode: it would keep an
        # entry (~2.5 KB) for each set of sizes ever specialised
        with torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
            self._mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.compiled: OrderedDict[tuple[Any, ...], Callable[..., Any]] = OrderedDict()
        # one specialisation at a time: the fake mode is not to be entered from two threads
        # (its kernel-invocation flag is the mode's), nor the LRU order changed by two
        self._lock = threading.Lock()
        self.failures: dict[tuple[Any, ...], str] = {}
        self.specialize_us: list[float] = []
        self.dropped: set[tuple[Any, ...]] = set()
        self.eager: CompiledGraph | None = None
        self.eager_reason = ""
        self._on_eager = on_eager

    @property
    def eager_calls(self) -> int:
        """Calls run eagerly past ``compiles``."""
        return 0 if self.eager is None else self.eager.eager_runs

    def key(self, args: Sequence[Any]) -> tuple[Any, ...]:
        """The sizes that pick a compile: each symbolic input's value, or shape and strides."""
        return tuple(
            (tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else a
            for a in (args[i] for i in self._symbolic)
        )

    def __call__(self, *args: Any) -> Any:
        return self._pick(args)(*args)

    def boxed(self, args: list[Any]) -> Any:
        """Run on ``args`` and clear that list (AOT autograd's boxed calling convention),
        through the compile's own ``boxed`` where it has one."""
        fn = self._pick(args)
        boxed = getattr(fn, "boxed", None)
        if boxed is None:
            return fn(*args)
        return boxed(args)

    def _pick(self, args: Sequence[Any]) -> Callable[..., Any]:
        key = self.key(args)
        with self._lock:
            fn = self.compiled.get(key)
            if fn is not None:
                self.compiled.move_to_end(key)
                return fn
            if key in self.dropped:  # more sets in use than kept: keep one more
                self.dropped.discard(key)
                self.limit += 1
                return self._specialize(key, args)
            if len(self.compiled) + len(self.dropped) < self.compiles:
                return self._specialize(key, args)
            if self.eager is None:
                self.eager_reason = (
                    f"dvm: a graph with symbolic sizes has compiled {self.compiles} sets of "
                    "sizes, the most it may (each compile takes milliseconds and leaves ~1.3 KB "
                    "that torch never frees): a new set now runs eagerly. To compile up to N "
                    'sets: torch.compile(..., backend="dvm", options={"size_limit": N})'
                )
                warnings.warn(self.eager_reason, RuntimeWarning, stacklevel=3)
                self.eager = eager_graph(self._gm, self.eager_reason)
                if self._on_eager is not None:
                    self._on_eager(self.eager)
            self.eager.eager_runs += 1
            return self.eager

    def _specialize(self, key: tuple[Any, ...], args: Sequence[Any]) -> Callable[..., Any]:
        t0 = time.perf_counter()
        try:
            env = bindings(self._placeholders, args, self._symbolic)
            fn = self._compile(static_graph(self._gm, env, self._mode), args)
        except Exception as e:  # a compiler bug must not break the user's program: run eagerly
            why = f"{type(e).__name__}: {e}"
            if not self.failures:
                warnings.warn(
                    f"dvm could not specialise a graph with symbolic sizes for {key} ({why}); "
                    "those sizes run eagerly",
                    RuntimeWarning,
                    stacklevel=3,
                )
            self.failures[key] = why
            fn = Executor(self._gm, list(self._gm.graph.nodes))  # boxed, it clears the list
        self.specialize_us.append((time.perf_counter() - t0) * 1e6)
        if len(self.compiled) >= self.limit:
            self.dropped.add(self.compiled.popitem(last=False)[0])
        self.compiled[key] = fn
        return fn
