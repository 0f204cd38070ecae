"""A compiled region's call through ``dvm._launcher`` (C) against the Python call path it
replaced (guards in Python, then ``Launch.call_unchecked`` and one ctypes call), both in this
process: the former ``vm.py`` is read from git (commit 04c0ca4) and loaded beside the current
one, and a region compiled with each is called in turns.

``--calls``: per-call time of one region (RMSNorm on [16, 256], SiLU(x) * y on [4, 64],
fp32), medians of 15 rounds of 2000 calls, in µs. ``--llama``: the tiny Llama training step
(``spore bench dvm -k llama-train``'s model) under eager and under ``backend="dvm"`` with each
path, medians of ``--rounds`` rounds of 10 steps, in ms. Run from the repository (it calls
git).

    python packages/dvm/tools/launcher_ab.py --calls
    python packages/dvm/tools/launcher_ab.py --llama --rounds 11 [--dtype bf16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import earlier
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import dvm.compile as dc
from dvm import benchmarks
from dvm.backend import make_backend
from dvm.lower import decomposition_table
from spore import runtime

FORMER = "04c0ca4"


def _former_kernel(former: Any) -> type:
    """The former ``Kernel``, bound to a launch with today's ``guarded`` done as the former
    ``RegionRunner.__call__`` did it: the Python guard, ``call_unchecked``, the views."""

    class FormerLaunch:
        def __init__(self, launch: Any, guards: list[tuple[torch.Size, torch.dtype]]) -> None:
            self.launch, self.guards = launch, guards

        def guarded(self, args: Sequence[Any], results: tuple) -> tuple | None:
            if dc._guard_failure(args, self.guards) is not None:
                return None
            outs = self.launch.call_unchecked(args)
            return tuple(outs[k] if v is None else outs[k].view(v) for k, v in results)

    class FormerKernel(former.Kernel):
        def bind(self, domain: Any, args: Sequence[Any], *rest: Any, **kw: Any) -> FormerLaunch:
            guards = [(a.shape, a.dtype) for a in args]
            return FormerLaunch(super().bind(domain, args, *rest, **kw), guards)

    return FormerKernel


def _with_prepare(prepare: Any, make: Callable[..., Any], *args: Any) -> Any:
    current = dc.PREPARE
    dc.PREPARE = prepare
    try:
        return make(*args)
    finally:
        dc.PREPARE = current


def _rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _silu_mul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x) * y


def _calls(sides: dict[str, Any]) -> None:
    cases = {
        "RMSNorm [16, 256]": (_rms_norm, (torch.randn(16, 256), torch.randn(256))),
        "SiLU * y [4, 64]": (_silu_mul, (torch.randn(4, 64), torch.randn(4, 64))),
    }
    for name, (fn, args) in cases.items():
        gm = make_fx(fn, decomposition_table=decomposition_table())(*args)
        runners = {}
        for side, prepare in sides.items():
            compiled = _with_prepare(prepare, dc.compile_graph, gm, list(args))
            (runners[side],) = compiled.runners
        times: dict[str, list[float]] = {side: [] for side in runners}
        for _ in range(15):
            for side, runner in runners.items():
                start = time.perf_counter()
                for _ in range(2000):
                    runner(*args)
                times[side].append((time.perf_counter() - start) / 2000 * 1e6)
        for side, runner in runners.items():
            if runner.eager_calls or not runner.vm_calls:
                raise RuntimeError(f"{name}: the {side} region did not run on the VM")
        print(
            f"{name:18s}",
            "  ".join(
                f"{side} {statistics.median(t):5.2f} µs ({min(t):.2f}-{max(t):.2f})"
                for side, t in times.items()
            ),
        )


def _llama(sides: dict[str, Any], dtype: torch.dtype, rounds: int) -> None:
    seq = benchmarks.LLAMA.seq

    def stepper(backend: Any) -> Callable[[], None]:
        step = benchmarks.llama_step(dtype, None if backend is None else {"backend": backend})
        step(seq)
        step(seq)
        return lambda: step(seq)

    steps = {"eager": stepper(None)}
    for side, prepare in sides.items():
        steps[f"dvm, {side}"] = _with_prepare(prepare, stepper, make_backend())
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(10):
                step()
            times[name].append(1e3 * (time.perf_counter() - start) / 10)
    for name, ms in times.items():
        print(f"{name:14s} {statistics.median(ms):6.2f} ms  ({min(ms):.2f}-{max(ms):.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", action="store_true", help="one region's call")
    parser.add_argument("--llama", action="store_true", help="the tiny Llama training step")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--dtype", choices=sorted(benchmarks.DTYPES), default="fp32")
    args = parser.parse_args()
    if not (args.calls or args.llama) or args.rounds < 1:
        parser.error("give --calls and/or --llama, and --rounds of at least 1")
    if dc.EXECUTOR != "vm":
        parser.error("dvm's VM is not built here")
    runtime.restart_tuned()  # as `spore bench`: its tuned runtime
    torch.set_num_threads(2)
    sides = {"C": dc.PREPARE, "Python": _former_kernel(earlier.module(FORMER, "vm"))}
    if args.calls:
        _calls(sides)
    if args.llama:
        _llama(sides, benchmarks.DTYPES[args.dtype], args.rounds)


if __name__ == "__main__":
    main()
