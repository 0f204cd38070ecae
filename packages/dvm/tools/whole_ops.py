"""The ops dvm keeps whole (softmax, log-softmax, their backward, SiLU, the other activations
and the backward of each, addcmul, addcdiv, lerp, mse_loss and its backward), each alone:
PyTorch's kernel against the VM region of its decomposition (what dvm ran before keeping it
whole) and against dvm's compile now (the op left to PyTorch, called through dvm's executor).
The softmax family and the SiLU/GELU backward at the tiny Llama step's shapes, the others at
``--shape``. Medians of interleaved rounds, in µs.

    python packages/dvm/tools/whole_ops.py --dtype fp32 [--shape 1024x4096]
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
    aten.silu,
    aten.hardsigmoid,
    aten.hardswish,
    aten.leaky_relu,
    aten.elu,
    aten.addcmul,
    aten.addcdiv,
    aten.lerp,
    aten.mse_loss,
    aten.threshold_backward,
    aten.sigmoid_backward,
    aten.tanh_backward,
    aten.leaky_relu_backward,
    aten.hardtanh_backward,
    aten.elu_backward,
    aten.softplus_backward,
    aten.mse_loss_backward,
}


def _cases(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> dict[str, tuple[Callable[..., Any], list[torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)

    def r(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g).to(dtype)

    logits, scores, mlp = (256, 1024), (2, 4, 128, 128), (2, 128, 688)
    cases = {
        f"log_softmax {logits}": (lambda x: torch.log_softmax(x, -1), [r(*logits)]),
        f"log_softmax backward {logits}": (
            lambda gr, y: aten._log_softmax_backward_data(gr, y, -1, dtype),
            [r(*logits), torch.log_softmax(r(*logits), -1)],
        ),
        f"softmax {scores}": (lambda x: torch.softmax(x, -1), [r(*scores)]),
        f"silu backward {mlp}": (lambda gr, x: aten.silu_backward(gr, x), [r(*mlp), r(*mlp)]),
        f"gelu backward {mlp}": (lambda gr, x: aten.gelu_backward(gr, x), [r(*mlp), r(*mlp)]),
    }
    x, y, z, grad = r(*shape), r(*shape), r(*shape).abs() + 0.5, r(*shape)
    pointwise: dict[str, tuple[Callable[..., Any], list[torch.Tensor]]] = {
        "silu": (aten.silu, [x]),
        "hardsigmoid": (aten.hardsigmoid, [x]),
        "hardswish": (aten.hardswish, [x]),
        "leaky_relu": (lambda a: aten.leaky_relu(a, 0.01), [x]),
        "elu": (lambda a: aten.elu(a), [x]),
        "addcmul": (lambda a, b, c: aten.addcmul(a, b, c, value=0.5), [x, y, z]),
        "addcdiv": (lambda a, b, c: aten.addcdiv(a, b, c, value=0.5), [x, y, z]),
        "lerp": (lambda a, b: aten.lerp(a, b, 0.3), [x, y]),
        "mse_loss": (lambda a, b: aten.mse_loss(a, b), [x, y]),
        "threshold backward": (lambda gr, a: aten.threshold_backward(gr, a, 0.0), [grad, x]),
        "sigmoid backward": (aten.sigmoid_backward, [grad, torch.sigmoid(x)]),
        "tanh backward": (aten.tanh_backward, [grad, torch.tanh(x)]),
        "leaky_relu backward": (
            lambda gr, a: aten.leaky_relu_backward(gr, a, 0.01, False),
            [grad, x],
        ),
        "hardtanh backward": (lambda gr, a: aten.hardtanh_backward(gr, a, -1.0, 1.0), [grad, x]),
        "elu backward": (
            lambda gr, a: aten.elu_backward(gr, 1.0, 1.0, 1.0, False, a),
            [grad, x],
        ),
        "softplus backward": (
            lambda gr, a: aten.softplus_backward(gr, a, 1.0, 20.0),
            [grad, x],
        ),
        "mse_loss backward": (
            lambda gr, a, b: aten.mse_loss_backward(gr, a, b, 1),
            [grad.sum(), x, y],
        ),
    }
    cases.update({f"{name} {shape}": case for name, case in pointwise.items()})
    return cases


def _round_us(fn: Callable[..., Any], args: list[torch.Tensor], calls: int = 20) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return 1e6 * (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(benchmarks.DTYPES), default="fp32")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--shape", default="2x128x688", help="the pointwise ops' inputs")
    args = parser.parse_args()
    sizes = args.shape.lower().split("x")
    if not all(s.isdigit() and int(s) > 0 for s in sizes) or args.rounds < 1:
        parser.error(f"--shape {args.shape!r}: give positive sizes as AxBxC; --rounds >= 1")
    shape = tuple(int(s) for s in sizes)
    runtime.restart_tuned()  # as `spore bench`: its tuned runtime
    for name, (fn, inputs) in _cases(benchmarks.DTYPES[args.dtype], shape).items():
        sides = {
            "torch": fn,
            "vm region": compile_graph(
                make_fx(fn, decomposition_table(also=DECOMPOSED))(*inputs), inputs
            ),
            "dvm now": compile_graph(make_fx(fn, decomposition_table())(*inputs), inputs),
        }
        if not sides["vm region"].regions or sides["dvm now"].regions:
            raise RuntimeError(f"{name}: expected VM regions decomposed and none whole")
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
