"""``spore bench kernels``: each kernel against eager torch and torch.compile, side by side."""

from __future__ import annotations

from typing import Any

import torch

from spore.bench import Benchmark

ROWS, COLS, EPS = 8192, 4096, 1e-6


def _composite(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The RMSNorm a user writes (HF style, computed in float32)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def _inputs(dtype: torch.dtype) -> Any:
    def setup() -> dict[str, Any]:
        import spore_kernels

        spore_kernels.load()
        g = torch.Generator().manual_seed(0)
        x = torch.randn(ROWS, COLS, generator=g).to(dtype)
        w = torch.randn(COLS, generator=g).to(dtype)
        compiled = torch.compile(_composite, dynamic=False)
        compiled(x, w)  # compile outside the timed region
        return {"x": x, "w": w, "compiled": compiled}

    return setup


def _close(expected: torch.Tensor, actual: torch.Tensor) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2)


def _spore(s: dict[str, Any]) -> torch.Tensor:
    return torch.ops.spore.rms_norm(s["x"], s["w"], EPS)


def benchmarks() -> list[Benchmark]:
    cases = []
    for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        shape = f"{ROWS}x{COLS} {tag}"
        cases += [
            Benchmark(
                name=f"rms_norm-fwd-{tag}-vs-eager",
                baseline=lambda s: _composite(s["x"], s["w"]),
                candidate=_spore,
                baseline_label=f"eager composite, {shape}",
                setup=_inputs(dtype),
                check=_close,
            ),
            Benchmark(
                name=f"rms_norm-fwd-{tag}-vs-F.rms_norm",
                baseline=lambda s: torch.nn.functional.rms_norm(s["x"], (COLS,), s["w"], EPS),
                candidate=_spore,
                baseline_label=f"torch.nn.functional.rms_norm, {shape}",
                setup=_inputs(dtype),
                check=_close,
            ),
            Benchmark(
                name=f"rms_norm-fwd-{tag}-vs-compile",
                baseline=lambda s: s["compiled"](s["x"], s["w"]),
                candidate=_spore,
                baseline_label=f"torch.compile of the composite (Inductor), {shape}",
                setup=_inputs(dtype),
                check=_close,
            ),
        ]
    return cases
