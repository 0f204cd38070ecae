"""Long sums in the norm kernels: a row's sums of squares past one large value, and a weight's
gradient summed over a million rows, against float64 (before the fp32-to-fp64 spills of
common.h, 30 ulp at 65,536 columns and 4e-3 relative over the rows; now about 1 ulp and 5e-8)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spore_kernels import _lib
from spore_kernels.ops import layer_norm, rms_norm

ULP = 2.0**-23
COLS = 65536
ROWS = 2**20


def _ulps(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got.double() - exact).abs() / (exact.abs().clamp(min=1) * ULP)).max().item()


def _outlier_rows() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, COLS, generator=g)
    x[:, 0] += 1e4  # its square holds a lane at 1e8: terms under 4 were dropped after it
    return x, torch.randn(COLS, generator=g)


@pytest.mark.parametrize("isa", _lib.available())
def test_a_long_row_with_one_large_value_keeps_its_small_squares(isa) -> None:
    x, w = _outlier_rows()
    code, ptrs = _lib.dtype_code(x), (x.data_ptr(), w.data_ptr())
    rms = _lib.function("spore_rms_norm", rms_norm._FWD, _lib.load(isa))
    y = torch.empty_like(x)
    assert rms(*ptrs, y.data_ptr(), 2, COLS, 1e-6, code, 2) == 0
    assert _ulps(y, rms_norm.reference(x.double(), w.double(), 1e-6)) <= 4
    ln = _lib.function("spore_layer_norm", layer_norm._FWD, _lib.load(isa))
    assert ln(*ptrs, None, y.data_ptr(), 2, COLS, 1e-5, code, 2) == 0
    assert _ulps(y, F.layer_norm(x.double(), (COLS,), w.double(), None, 1e-5)) <= 4


def test_the_ops_with_one_large_value_in_a_long_row() -> None:
    x, w = _outlier_rows()
    exact = rms_norm.reference(x.double(), w.double(), 1e-6)
    assert _ulps(torch.ops.spore.rms_norm(x, w, 1e-6), exact) <= 4
    y, _ = torch.ops.spore.add_rms_norm(x, torch.zeros_like(x), w, 1e-6)
    assert _ulps(y, exact) <= 4


def test_weight_gradients_summed_over_a_million_rows() -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.rand(1, 4, generator=g).add(0.5).expand(ROWS, 4).contiguous()
    w, b = torch.rand(4, generator=g), torch.rand(4, generator=g)
    grad = torch.rand(ROWS, 4, generator=g) + 0.5  # positive: the column sums only grow
    leaves = [t.double().requires_grad_() for t in (x, w, b)]
    rms_norm.reference(*leaves[:2], 1e-6).mul(grad.double()).sum().backward()
    _, dw = torch.ops.spore.rms_norm_backward(grad, x, w, 1e-6)
    assert ((dw.double() - leaves[1].grad).abs() / leaves[1].grad.abs()).max() < 1e-6
    for t in leaves:
        t.grad = None
    F.layer_norm(leaves[0], (4,), *leaves[1:], 1e-5).mul(grad.double()).sum().backward()
    _, dw, db = torch.ops.spore.layer_norm_backward(grad, x, w, b, 1e-5)
    assert ((dw.double() - leaves[1].grad).abs() / leaves[1].grad.abs()).max() < 1e-6
    assert ((db.double() - leaves[2].grad).abs() / leaves[2].grad.abs()).max() < 1e-6
