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

from dvm import _executor


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
    """``value`` with ``leaf`` applied inside tuples, lists, dicts and slices."""
    if isinstance(value, (tuple, list)) and type(value) is not _Slot:
        return type(value)(_map(v, leaf) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, leaf) for k, v in value.items()}
    if type(value) is slice:  # torch.fx keeps nodes inside slices too: x[:, : x.size(1)]
        return slice(_map(value.start, leaf), _map(value.stop, leaf), _map(value.step, leaf))
    return leaf(value)


def _resolve(value: Any, env: list[Any]) -> Any:
    return _map(value, lambda v: env[v.index] if type(v) is _Slot else v)


def _method(name: str) -> Callable[..., Any]:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, name)(*args, **kwargs)

    return call


class Executor:
    """The ``units`` of ``gm`` (its nodes, with :class:`RegionCall` calls in place of the nodes
    they cover) run in the given order; call it with the graph's placeholder values."""

    __slots__ = ("_constants", "_output", "n_inputs", "n_slots", "steps")  # set in C too

    def __init__(self, gm: GraphModule, units: Sequence[Node | RegionCall]) -> None:
        # the slots: the inputs, the get_attr constants (set again at each call), then each
        # step's results; a slot is freed at its last reader unless a constant or the output.
        # dvm._executor.schedule makes an Executor without this, setting the same fields
        self.n_inputs, self.n_slots, self._constants, self.steps, self._output = _executor.build(
            gm, units
        )

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


_executor.setup(
    Node,
    _Slot,
    Step,
    RegionCall,
    Executor,
    _method,
    _attr,
    ("_args", "_kwargs") if hasattr(Node, "_args") else ("args", "kwargs"),
)
