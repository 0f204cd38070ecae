"""``dvm.explain(fn, *inputs, options=...)``: the regions dvm finds in ``fn``'s graphs, their
programs and why anything was left to eager."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from dvm.compile import CompiledGraph, RegionRunner
from dvm.lower import op_name


@dataclass
class RegionInfo:
    """One region: the graph it is in, its aten ops, domain, inputs and outputs (node names),
    program disassembly and compile time (µs); of ``explain``'s own run, the calls the VM ran
    and why the others ran the region's aten ops eagerly (reason -> calls: a guard refused
    the inputs, such as a lazily negated view, or the VM refused the call)."""

    graph: str
    ops: list[str]
    domain: tuple[int, ...]
    inputs: list[str]
    outputs: list[str]
    program: str
    compile_us: float
    vm_calls: int = 0
    eager_calls: dict[str, int] = field(default_factory=dict)


@dataclass
class Fallback:
    """A node left to eager aten: its graph, name, op and the reason."""

    graph: str
    node: str
    op: str
    reason: str


@dataclass
class Explanation:
    """What ``torch.compile(fn, backend="dvm")`` does with ``fn``: regions, fallbacks and
    compile times (µs) of each graph (forward, and backward when a result needs grad)."""

    regions: list[RegionInfo] = field(default_factory=list)
    fallbacks: list[Fallback] = field(default_factory=list)
    graphs: dict[str, float] = field(default_factory=dict)  # graph -> compile µs
    executor: str = ""

    @property
    def compile_us(self) -> float:
        return sum(self.graphs.values())

    def __str__(self) -> str:
        lines = [
            f"dvm: {len(self.regions)} region(s), {len(self.fallbacks)} node(s) left to eager, "
            f"{len(self.graphs)} graph(s) compiled in {self.compile_us:.0f} µs "
            f"(executor: {self.executor})"
        ]
        for k, r in enumerate(self.regions):
            lines.append(
                f"region {k} [{r.graph}] domain {r.domain}, {len(r.ops)} ops, "
                f"compiled in {r.compile_us:.0f} µs"
            )
            lines.append(f"  ops: {', '.join(r.ops)}")
            lines.append(f"  inputs: {', '.join(r.inputs)}")
            lines.append(f"  outputs: {', '.join(r.outputs)}")
            lines.extend(
                f"  ran eagerly in {n} of {r.vm_calls + sum(r.eager_calls.values())} call(s): {why}"
                for why, n in r.eager_calls.items()
            )
            lines.extend("    " + line for line in r.program.splitlines())
        if self.fallbacks:
            lines.append("left to eager:")
            lines.extend(f"  [{f.graph}] {f.node} ({f.op}): {f.reason}" for f in self.fallbacks)
        return "\n".join(lines)


def _record(
    explanation: Explanation, name: str, compiled: CompiledGraph, runners: list[RegionRunner]
) -> None:
    """Add ``compiled``'s regions and fallbacks; its runners go to ``runners``, in the order
    of ``explanation.regions``, for their calls to be read once ``explain`` has run."""
    explanation.graphs[name] = compiled.total_us
    explanation.executor = compiled.executor
    runners.extend(compiled.runners)
    for runner in compiled.runners:
        r = runner.region
        explanation.regions.append(
            RegionInfo(
                graph=name,
                ops=r.ops,
                domain=r.domain,
                inputs=[n.name for n in r.unique_inputs],
                outputs=[n.name for n in r.outputs],
                program=r.program.disassemble(),
                compile_us=runner.compile_us,
            )
        )
    for node, reason in compiled.fallbacks:
        explanation.fallbacks.append(Fallback(name, node.name, op_name(node.target), reason))


def explain(
    fn: Callable[..., Any],
    /,
    *inputs: Any,
    options: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Explanation:
    """Compile ``fn`` with the dvm backend, run it on ``inputs`` and ``kwargs`` (and its
    backward when a result needs grad, without touching any ``.grad``) and say what dvm did,
    a region that ran eagerly in that run included (with the reason).

    ``options`` is the dict ``torch.compile(fn, backend="dvm", options=...)`` takes
    (:class:`dvm.backend.DvmOptions`), checked first: a bad one is the backend's
    ``ValueError``. It is explain's own keyword, never passed to ``fn``: bind a keyword of
    ``fn`` named ``options`` with ``functools.partial``."""
    from dvm.backend import make_backend, parse_options

    settings = parse_options(options).model_dump()
    explanation = Explanation()
    counts: dict[str, int] = {}
    runners: list[RegionRunner] = []

    def on_compile(kind: str, compiled: CompiledGraph) -> None:
        counts[kind] = counts.get(kind, 0) + 1
        name = kind if counts[kind] == 1 else f"{kind} {counts[kind]}"
        _record(explanation, name, compiled, runners)

    def run(*args: Any, **kw: Any) -> Any:
        return fn(*args, **kw)

    # a code object of its own for each call: dynamo keeps its compiles per code object, so
    # compiling ``fn`` itself would count each explain as a recompile of ``fn`` (a new backend
    # each time) until its recompile limit left later explains, and the user's own compile of
    # ``fn``, running eagerly
    run.__code__ = run.__code__.replace()
    out = torch.compile(run, backend=make_backend(on_compile, **settings))(*inputs, **kwargs)
    results = [t for t in _tensors(out) if t.requires_grad]
    leaves = _leaves(results)
    if leaves:
        total = sum(t.float().sum() for t in results)
        torch.autograd.grad(total, leaves, allow_unused=True)
    for info, runner in zip(explanation.regions, runners, strict=True):
        info.vm_calls = runner.vm_calls
        info.eager_calls = dict(runner.fallback_reasons)
    return explanation


def _leaves(results: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors requiring grad that ``results`` were computed from (autograd's leaves:
    inputs, parameters, also those a closure reads)."""
    found = [t for t in results if t.grad_fn is None]
    stack = [t.grad_fn for t in results if t.grad_fn is not None]
    seen: set[Any] = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        if isinstance(variable, torch.Tensor):
            found.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list({id(t): t for t in found}.values())


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if hasattr(value, "to_tuple"):  # transformers' ModelOutput
        return _tensors(value.to_tuple())
    return []
