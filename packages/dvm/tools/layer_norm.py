"""LayerNorm under ``backend="dvm"``: kept whole (PyTorch's kernel, dvm's default) against its
decomposition fused on the VM (what dvm did before), each against eager, in one process:
LayerNorm alone, after a residual add, and a tiny Hugging Face GPT-2 (2 layers, 256 wide,
batch 8 x 128 tokens); inference (no grad) and a training step (forward, backward). Ratios of
eager time to each side's, medians of interleaved rounds; ``aot_eager`` (torch.compile
running the same graphs as eager aten) shows what torch.compile's call alone costs.

    python packages/dvm/tools/layer_norm.py --dtype fp32
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dvm import benchmarks
from dvm.backend import make_backend
from dvm.lower import decomposition_table
from spore import runtime

aten = torch.ops.aten


class _AddNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return self.norm(x + r)


class _Gpt2(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2Model

        config = GPT2Config(
            n_embd=d,
            n_layer=2,
            n_head=4,
            n_positions=128,
            vocab_size=64,
            bos_token_id=0,
            eos_token_id=0,
        )
        self.model = GPT2Model(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(inputs_embeds=x).last_hidden_state


CASES: dict[str, tuple[Callable[[int], nn.Module], tuple[int, ...], int]] = {
    "LayerNorm 8x128x768": (nn.LayerNorm, (8, 128, 768), 1),
    "LayerNorm 4096x768": (nn.LayerNorm, (4096, 768), 1),
    "add + LayerNorm 8x128x768": (_AddNorm, (8, 128, 768), 2),
    "add + LayerNorm 4096x768": (_AddNorm, (4096, 768), 2),
    "GPT-2 8x128x256": (_Gpt2, (8, 128, 256), 1),
}


def _step(module: nn.Module, args: list[torch.Tensor], train: bool) -> Callable[[], None]:
    def step() -> None:
        if train:
            module(*args).float().sum().backward()
        else:
            with torch.no_grad():
                module(*args)

    return step


def _median_s(step: Callable[[], None], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=list(benchmarks.DTYPES), default="fp32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10, help="timed calls a side per round")
    args = parser.parse_args()
    if args.rounds < 1 or args.calls < 1:
        parser.error("--rounds and --calls must be at least 1")
    runtime.restart_tuned()  # as `spore bench`: its tuned runtime
    warnings.filterwarnings("ignore")
    dtype = benchmarks.DTYPES[args.dtype]
    backends: dict[str, Any] = {
        "whole": make_backend(),
        "decomposed": make_backend(
            decompositions=decomposition_table(
                also=[aten.native_layer_norm, aten.native_layer_norm_backward]
            )
        ),
        "aot_eager": "aot_eager",  # torch.compile's own cost: the graphs run as eager aten
    }
    print(f"{args.dtype}: eager time / side's time (median of {args.rounds} rounds)")
    for train in (False, True):
        for name, (make, shape, n_args) in CASES.items():
            torch.manual_seed(0)
            module = make(shape[-1]).to(dtype)
            inputs = [torch.randn(shape, dtype=dtype, requires_grad=train) for _ in range(n_args)]
            steps = {"eager": _step(module, inputs, train)}
            torch._dynamo.reset()  # once a case: a reset between sides made each recompile
            for side, backend in backends.items():
                compiled = torch.compile(module, backend=backend, dynamic=False)
                steps[side] = _step(compiled, inputs, train)
                steps[side]()  # compiles
            ratios: dict[str, list[float]] = {side: [] for side in backends}
            for _ in range(args.rounds):
                times = {side: _median_s(step, args.calls) for side, step in steps.items()}
                for side in backends:
                    ratios[side].append(times["eager"] / times[side])
            figures = "  ".join(
                f"{side} {statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})"
                for side, r in ratios.items()
            )
            print(f"{'train' if train else 'infer'} {name:26s} {figures}", flush=True)


if __name__ == "__main__":
    main()
