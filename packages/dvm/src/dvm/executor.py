"""``Executor``: runs a scheduled graph — eager aten nodes and region calls — as a flat list of
steps over numbered value slots, without generating Python code.

Building a ``GraphModule`` for the rewritten graph costs about a millisecond of code generation
per graph, several times dvm's own compile; the steps take microseconds to build. Each slot is
cleared after its last use, as generated code would ``del`` it. Called boxed
(:meth:`Executor.boxed`, AOT autograd's convention: the caller hands over its list of
arguments), the inputs are cleared after their last use too, so a backward graph frees its
saved activations as it goes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from torch.fx import GraphModule, Node


class _Slot(NamedTuple):
    """A reference to a value slot inside a step's arguments."""

    index: int


class RegionCall(NamedTuple):
    """A region call in the schedule: ``runner(*inputs)`` returns one value per output."""

    runner: Callable[..., Sequence[Any]]
    inputs: list[Node]
    outputs: list[Node]


class Step(NamedTuple):
    """``fn(*args, **kwargs)`` with slots read from the values; the result goes to slot
    ``out``, or for a region each of its results to ``outs``; then the ``free`` slots are
    cleared. ``flat``: slots only at the top level of ``args`` and none in ``kwargs``."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    flat: bool
    out: int
    outs: tuple[int, ...]
    free: tuple[int, ...]


def _map(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` with ``leaf`` applied inside tuples, lists and dicts."""
    if isinstance(value, (tuple, list)) and type(value) is not _Slot:
        return type(value)(_map(v, leaf) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, leaf) for k, v in value.items()}
    return leaf(value)


def _slots(value: Any) -> list[int]:
    found: list[int] = []
    _map(value, lambda v: found.append(v.index) if type(v) is _Slot else None)
    return found


def _resolve(value: Any, env: list[Any]) -> Any:
    return _map(value, lambda v: env[v.index] if type(v) is _Slot else v)


def _method(name: str) -> Callable[..., Any]:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, name)(*args, **kwargs)

    return call


class Executor:
    """The ``units`` of ``gm`` (its nodes, with :class:`RegionCall` calls in place of the nodes
    they cover) run in the given order; call it with the graph's placeholder values."""

    def __init__(self, gm: GraphModule, units: Sequence[Node | RegionCall]) -> None:
        slot: dict[Node, int] = {}
        for u in units:
            if type(u) is not RegionCall and u.op == "placeholder":
                slot[u] = len(slot)
        self.n_inputs = len(slot)
        self._constants: list[tuple[int, Any]] = []
        calls: list[tuple[Callable[..., Any], Any, Any, Sequence[Node], bool]] = []
        output: Any = None
        for u in units:
            if type(u) is RegionCall:
                calls.append((u.runner, tuple(u.inputs), {}, u.outputs, True))
                continue
            op = u.op
            if op == "call_function":
                calls.append((u.target, u.args, u.kwargs, (u,), False))
            elif op == "get_attr":
                slot[u] = len(slot)
                self._constants.append((slot[u], _attr(gm, u.target)))
            elif op == "output":
                output = u.args[0]
            elif op != "placeholder":
                fn = gm.get_submodule(u.target) if op == "call_module" else _method(u.target)
                calls.append((fn, u.args, u.kwargs, (u,), False))
        n_fixed = len(slot)  # the inputs, then the constants (set again at each call)
        for *_, outs, _ in calls:
            for o in outs:
                slot[o] = len(slot)
        self.n_slots = len(slot)

        def ref(v: Any) -> Any:
            return _map(v, lambda x: _Slot(slot[x]) if isinstance(x, Node) else x)

        self._output = ref(output)
        kept = set(_slots(self._output))
        last_use: dict[int, int] = {}
        steps = []
        for k, (fn, args, kwargs, outs, region) in enumerate(calls):
            flat = True
            refs = []
            for a in args:
                if isinstance(a, Node):
                    s = slot[a]
                    refs.append(_Slot(s))
                    last_use[s] = k
                elif isinstance(a, (tuple, list, dict)):
                    a = ref(a)
                    used = _slots(a)
                    for s in used:
                        last_use[s] = k
                    flat = flat and not used
                    refs.append(a)
                else:
                    refs.append(a)
            if kwargs:
                kwargs = ref(dict(kwargs))
                for s in _slots(kwargs):
                    last_use[s] = k
                    flat = False
            out_slots = tuple(slot[o] for o in outs)
            steps.append((fn, tuple(refs), kwargs, flat, -1 if region else out_slots[0], out_slots))
        frees: list[list[int]] = [[] for _ in steps]
        for s, k in last_use.items():
            if (s < self.n_inputs or s >= n_fixed) and s not in kept:
                frees[k].append(s)
        self.steps = [
            Step(fn, args, kwargs, flat, out, outs if out < 0 else (), tuple(free))
            for (fn, args, kwargs, flat, out, outs), free in zip(steps, frees, strict=True)
        ]

    @property
    def targets(self) -> list[Callable[..., Any]]:
        """Each step's callable, in run order."""
        return [s.fn for s in self.steps]

    def __call__(self, *args: Any) -> Any:
        return self.boxed(list(args))  # the caller keeps its own references

    def boxed(self, args: list[Any]) -> Any:
        """Run on ``args`` and clear that list first (AOT autograd's boxed calling convention):
        each input is then freed after its last use, unless the caller holds it elsewhere."""
        if len(args) != self.n_inputs:
            raise TypeError(f"the graph takes {self.n_inputs} inputs, got {len(args)}")
        env: list[Any] = [*args, *([None] * (self.n_slots - self.n_inputs))]
        args.clear()
        return self._run(env)

    def _run(self, env: list[Any]) -> Any:
        for k, v in self._constants:
            env[k] = v
        for fn, a, kw, flat, out, outs, free in self.steps:
            if flat:
                result = fn(*[env[x.index] if type(x) is _Slot else x for x in a], **kw)
            else:
                result = fn(*_resolve(a, env), **_resolve(kw, env))
            if out >= 0:
                env[out] = result
            else:
                for s, v in zip(outs, result, strict=True):
                    env[s] = v
            for s in free:
                env[s] = None
        return _resolve(self._output, env)


def _attr(gm: GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value
