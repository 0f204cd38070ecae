"""``spore bench kernels``: every op against what a user would run otherwise, side by side.

Each op family describes its workload once as an :class:`OpBench`; this module turns it into
cases for float32 and bfloat16, forward and forward+backward, against each baseline it names
(the eager composite, the torch built-in where there is one), ``torch.compile`` of the eager
composite (Inductor's own CPU code), and ``copy``: a pre-allocated ``out.copy_(src)`` moving
the same number of bytes, so that ratio is the fraction of copy bandwidth achieved.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from spore.bench import Benchmark

Inputs = tuple[Any, ...]
DTYPES = ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))


@dataclass(frozen=True)
class OpBench:
    """One op's benchmark workload.

    ``make(dtype, generator)`` returns the call's arguments; ``differentiable`` are the indices
    of the tensor arguments that get gradients in forward+backward; ``spore`` and each baseline
    take the arguments. ``baselines`` maps a short tag to (label, fn); the one tagged ``eager``
    is also compiled. ``inexact`` maps (baseline tag, case tag such as ``fwdbwd-bf16``) to the
    reason that baseline's output is known to be too inaccurate to compare with (that case then
    times without the agreement check; the tests compare the op with a float64 oracle).
    """

    op: str
    shape: str
    make: Callable[[torch.dtype, torch.Generator], Inputs]
    spore: Callable[..., Any]
    baselines: dict[str, tuple[str, Callable[..., Any]]]
    differentiable: Sequence[int] = (0,)
    inexact: dict[tuple[str, str], str] = field(default_factory=dict)
    tolerance: dict[torch.dtype, float] = field(
        default_factory=lambda: {torch.float32: 1e-3, torch.bfloat16: 5e-2}
    )


def _outputs(result: Any) -> list[torch.Tensor]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _forward_backward(fn: Callable[..., Any], wrt: Sequence[int]) -> Callable[..., Any]:
    """fn's forward, then gradients for ``wrt`` with ones as upstream gradient (no accumulation)."""

    def run(*args: Any) -> tuple[torch.Tensor, ...]:
        outs = _outputs(fn(*args))
        return torch.autograd.grad(outs, [args[i] for i in wrt], [torch.ones_like(o) for o in outs])

    return run


def _nbytes(values: Any) -> int:
    return sum(
        t.numel() * t.element_size() for t in _outputs(values) if isinstance(t, torch.Tensor)
    )


def _setup(spec: OpBench, dtype: torch.dtype, backward: bool, compile_eager: bool) -> Callable:
    def setup() -> dict[str, Any]:
        args = spec.make(dtype, torch.Generator().manual_seed(0))
        if backward:
            args = tuple(
                a.detach().requires_grad_() if i in spec.differentiable else a
                for i, a in enumerate(args)
            )
        wrap = (
            (lambda fn: _forward_backward(fn, spec.differentiable)) if backward else (lambda fn: fn)
        )
        state: dict[str, Any] = {
            "args": args,
            "spore": wrap(spec.spore),
            **{tag: wrap(fn) for tag, (_, fn) in spec.baselines.items()},
        }
        if compile_eager:
            state["compile"] = wrap(torch.compile(spec.baselines["eager"][1], dynamic=False))
            state["compile"](*args)  # compile outside the timed region
        with torch.no_grad():
            out = spec.spore(*args)
        moved = _nbytes(args) + _nbytes(out)
        if backward:
            moved += _nbytes(out) + sum(_nbytes(args[i]) for i in spec.differentiable)
        half = moved // 2
        state["copy_src"] = torch.ones(half, dtype=torch.uint8)
        state["copy_dst"] = torch.empty(half, dtype=torch.uint8)
        return state

    return setup


def _checker(tolerance: float) -> Callable[[Any, Any], None]:
    def check(expected: Any, actual: Any) -> None:
        if expected is None:  # the copy baseline computes nothing to compare
            return
        for e, a in zip(_outputs(expected), _outputs(actual), strict=True):
            torch.testing.assert_close(a.float(), e.float(), rtol=tolerance, atol=tolerance)

    return check


def _copy(state: dict[str, Any]) -> None:
    state["copy_dst"].copy_(state["copy_src"])


def cases(spec: OpBench) -> list[Benchmark]:
    """The benchmark cases for one op: dtypes x (forward, forward+backward) x baselines."""
    out: list[Benchmark] = []
    for dtype, tag in DTYPES:
        for backward in (False, True):
            phase = "fwdbwd" if backward else "fwd"
            sides: list[tuple[str, str, Callable[[dict[str, Any]], Any]]] = [
                (short, label, lambda s, short=short: s[short](*s["args"]))
                for short, (label, _) in spec.baselines.items()
            ]
            sides.append(
                (
                    "compile",
                    "torch.compile of the eager composite",
                    lambda s: s["compile"](*s["args"]),
                )
            )
            sides.append(("copy", "out.copy_(src) of the same bytes", _copy))
            for short, label, baseline in sides:
                out.append(
                    Benchmark(
                        name=f"{spec.op}-{phase}-{tag}-vs-{short}",
                        baseline=baseline,
                        candidate=lambda s: s["spore"](*s["args"]),
                        baseline_label=f"{label}, {spec.shape} {tag} {phase}",
                        setup=_setup(spec, dtype, backward, compile_eager=short == "compile"),
                        check=None
                        if short == "copy" or (short, f"{phase}-{tag}") in spec.inexact
                        else _checker(spec.tolerance[dtype]),
                        description=spec.inexact.get((short, f"{phase}-{tag}"), ""),
                    )
                )
    return out


def benchmarks() -> list[Benchmark]:
    from spore_kernels.ops import FAMILIES

    return [case for family in FAMILIES for spec in family.benchmarks() for case in cases(spec)]
