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


BASELINES: list[tuple[str, str, Any]] = [
    ("eager", "eager composite", lambda s: _composite(s["x"], s["w"])),
    (
        "F.rms_norm",
        "torch.nn.functional.rms_norm",
        lambda s: torch.nn.functional.rms_norm(s["x"], (COLS,), s["w"], EPS),
    ),
    (
        "compile",
        "torch.compile of the composite (Inductor)",
        lambda s: s["compiled"](s["x"], s["w"]),
    ),
]


def benchmarks() -> list[Benchmark]:
    return [
        Benchmark(
            name=f"rms_norm-fwd-{tag}-vs-{short}",
            baseline=baseline,
            candidate=_spore,
            baseline_label=f"{label}, {ROWS}x{COLS} {tag}",
            setup=_inputs(dtype),
            check=_close,
        )
        for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))
        for short, label, baseline in BASELINES
    ]
