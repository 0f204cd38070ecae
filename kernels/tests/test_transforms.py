"""The ops under torch.func and forward-mode AD, in float32 (the C++ kernels' dtype): the
derivatives and batched results equal torch's own functions' (the op runs its reference under
a transform)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import forward_ad

import spore_kernels  # noqa: F401  (defines torch.ops.spore)

spore = torch.ops.spore
G = torch.Generator().manual_seed(0)
W = torch.randn(64, generator=G)
B = torch.randn(64, generator=G)

CASES = {
    "rms_norm": (
        lambda x: spore.rms_norm(x, W, 1e-6),
        lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * W,
    ),
    "layer_norm": (
        lambda x: spore.layer_norm(x, W, B, 1e-5),
        lambda x: F.layer_norm(x, (64,), W, B, 1e-5),
    ),
    "gelu": (lambda x: spore.gelu(x, "tanh"), lambda x: F.gelu(x, approximate="tanh")),
    "silu_mul": (lambda x: spore.silu_mul(x, x.flip(-1)), lambda x: F.silu(x) * x.flip(-1)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_func_and_forward_ad_give_torchs_derivatives(name: str) -> None:
    op, torch_fn = CASES[name]
    x = torch.randn(8, 64, generator=G)
    t = torch.randn(8, 64, generator=G)
    close = {"rtol": 1e-4, "atol": 1e-5}

    def loss(fn):
        return lambda a: fn(a).sin().sum()

    torch.testing.assert_close(
        torch.func.grad(loss(op))(x), torch.func.grad(loss(torch_fn))(x), **close
    )
    got, want = torch.func.jvp(op, (x,), (t,)), torch.func.jvp(torch_fn, (x,), (t,))
    torch.testing.assert_close(got, want, **close)
    with forward_ad.dual_level():
        tangent = forward_ad.unpack_dual(op(forward_ad.make_dual(x, t))).tangent
    assert tangent is not None
    torch.testing.assert_close(tangent, want[1], **close)


@pytest.mark.parametrize("name", sorted(CASES))
def test_vmap_batches_the_op_as_torch_does(name: str) -> None:
    """vmap, alone and of grad, over a batch of 4, equals vmap of torch's function."""
    op, torch_fn = CASES[name]
    x = torch.randn(4, 8, 64, generator=G)
    close = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(torch.vmap(op)(x), torch.vmap(torch_fn)(x), **close)
    grad = torch.func.grad(lambda a: op(a).sin().sum())
    want = torch.func.grad(lambda a: torch_fn(a).sin().sum())
    torch.testing.assert_close(torch.vmap(grad)(x), torch.vmap(want)(x), **close)
