"""The ops dvm keeps whole (softmax, log-softmax, their backward, SiLU's and GELU's backward),
each alone at the tiny Llama step's shapes: PyTorch's kernel against the VM region of its
decomposition (what dvm ran before keeping it whole) and against dvm's compile now (the op
left to PyTorch, called through dvm's executor). Medians of interleaved rounds, in µs.

    python packages/dvm/tools/whole_ops.py --dtype fp32
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dvm import benchmarks
from dvm.compile import compile_graph
from dvm.lower import decomposition_table
from spore import runtime

aten = torch.ops.aten
DECOMPOSED = {  # the table before these ops were kept whole
    aten._softmax,
    aten._log_softmax,
    aten._softmax_backward_data,
    aten._log_softmax_backward_data,
    aten.silu_backward,
    aten.gelu_backward,
}


def _cases(dtype: torch.dtype) -> dict[str, tuple[Callable[..., Any], list[torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    logits, scores, mlp = (256, 1024), (2, 4, 128, 128), (2, 128, 688)
    return {
        f"log_softmax {logits}": (lambda x: torch.log_softmax(x, -1), [r(*logits)]),
        f"log_softmax backward {logits}": (
            lambda gr, y: aten._log_softmax_backward_data(gr, y, -1, dtype),
            [r(*logits), torch.log_softmax(r(*logits), -1)],
        ),
        f"softmax {scores}": (lambda x: torch.softmax(x, -1), [r(*scores)]),
        f"silu backward {mlp}": (lambda gr, x: aten.silu_backward(gr, x), [r(*mlp), r(*mlp)]),
        f"gelu backward {mlp}": (lambda gr, x: aten.gelu_backward(gr, x), [r(*mlp), r(*mlp)]),
    }


def _decomposed_table() -> dict[Any, Callable[..., Any]]:
    from torch._decomp import get_decompositions

    return {**decomposition_table(), **get_decompositions(list(DECOMPOSED))}


def _round_us(fn: Callable[..., Any], args: list[torch.Tensor], calls: int = 20) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return 1e6 * (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(benchmarks.DTYPES), default="fp32")
    parser.add_argument("--rounds", type=int, default=31)
    args = parser.parse_args()
    runtime.restart_tuned()  # as `spore bench`: its tuned runtime
    for name, (fn, inputs) in _cases(benchmarks.DTYPES[args.dtype]).items():
        sides = {
            "torch": fn,
            "vm region": compile_graph(make_fx(fn, _decomposed_table())(*inputs), inputs),
            "dvm now": compile_graph(make_fx(fn, decomposition_table())(*inputs), inputs),
        }
        if len(sides["vm region"].regions) != 1 or sides["dvm now"].regions:
            raise RuntimeError(f"{name}: expected one VM region decomposed and none whole")
        times: dict[str, list[float]] = {side: [] for side in sides}
        with torch.no_grad():
            for _ in range(args.rounds):
                for side, call in sides.items():
                    times[side].append(_round_us(call, inputs))
        base = statistics.median(times["torch"])
        cells = "  ".join(
            f"{side} {statistics.median(t):7.1f} ({base / statistics.median(t):.2f}x)"
            for side, t in times.items()
        )
        print(f"{name:36s} {cells}")


if __name__ == "__main__":
    main()
