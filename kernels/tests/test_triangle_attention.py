"""triangle_attention: the reference against a per-(batch, i, head) loop of plain softmax
attention in float64, its backward against autograd of that loop, the op through
``torch.ops.spore`` (eager, autograd, torch.compile) and the input errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spore_kernels.ops import triangle_attention as op

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def _inputs(batch, i, j, keys, h, d, dtype, seed, bias=True, mask=0.3):
    """q, k, v, bias (or None) and a bool mask dropping about ``mask`` of the keys (or None)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, i, j, h, d, generator=g)
    k = torch.randn(*batch, i, keys, h, d, generator=g) * 1.5
    v = torch.randn(*batch, i, keys, h, d, generator=g)
    b = torch.randn(*batch, h, j, keys, generator=g) * 2 if bias else None
    m = torch.rand(*batch, i, keys, generator=g) >= mask if mask is not None else None
    cast = (t if t is None else t.to(dtype) for t in (q, k, v, b))
    return (*cast, m)


def _loop(q, k, v, bias, mask, scale=None):
    """Plain softmax attention one (batch, i, head) at a time, in float64; no key: zeros."""
    *batch, i_n, j_n, h_n, d = q.shape
    scale = d**-0.5 if scale is None else scale
    flat = [t.reshape(-1, *t.shape[len(batch) :]) if t is not None else None for t in (q, k, v)]
    fb = bias.reshape(-1, *bias.shape[len(batch) :]) if bias is not None else None
    fm = mask.reshape(-1, *mask.shape[len(batch) :]) if mask is not None else None
    rows = []
    for b in range(flat[0].shape[0]):
        for i in range(i_n):
            for h in range(h_n):
                qq, kk, vv = (t[b, i, :, h].double() for t in flat)
                s = qq @ kk.T * scale
                if fb is not None:
                    s = s + fb[b, h].double()
                if fm is not None:
                    s = s.masked_fill(~fm[b, i], float("-inf"))
                if fm is not None and not bool(fm[b, i].any()):
                    rows.append(qq * 0.0)  # zeros, still in the graph
                else:
                    rows.append(torch.softmax(s, -1) @ vv)
    out = torch.stack(rows).reshape(-1, i_n, h_n, j_n, d).transpose(2, 3)
    return out.reshape(*batch, i_n, j_n, h_n, d)


def _grads(fn, args, grad):
    """Gradients of fn(*args) (float64 leaves) for the tensors among q, k, v, bias."""
    leaves = [a.detach().double().requires_grad_() if a is not None else None for a in args[:4]]
    out = fn(*leaves, *args[4:])
    wrt = [t for t in leaves if t is not None]
    return torch.autograd.grad(out, wrt, grad.double(), allow_unused=True, materialize_grads=True)


SHAPES = st.tuples(
    st.sampled_from([(), (1,), (2,), (1, 2)]),  # batch dims
    st.integers(1, 4),  # I
    st.integers(1, 9),  # J
    st.integers(1, 9),  # K
    st.integers(1, 3),  # H
    st.sampled_from([1, 3, 8, 16]),  # D
)


@settings(max_examples=25, deadline=None)
@given(
    shape=SHAPES,
    with_bias=st.booleans(),
    mask=st.sampled_from([None, 0.0, 0.4, 0.9]),
    seed=st.integers(0, 2**16),
)
def test_reference_and_its_backward_match_a_loop_of_plain_attention(
    shape, with_bias, mask, seed
) -> None:
    batch, i, j, keys, h, d = shape
    args = _inputs(batch, i, j, keys, h, d, torch.float64, seed, with_bias, mask)
    expected = _loop(*args)
    torch.testing.assert_close(op.reference(*args), expected)
    grad = torch.randn(expected.shape, dtype=torch.float64)
    want = _grads(_loop, args, grad)
    got = op.reference_backward(grad, *args, expected, None)
    got = [g for g, a in zip(got, args[:4], strict=True) if a is not None]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_op_gradcheck_and_compile() -> None:
    args = _inputs((2,), 3, 5, 4, 2, 8, torch.float64, 1, mask=0.4)
    mask = args[4].clone()
    mask[0, 1] = False  # a fully masked row: zeros, zero gradients
    leaves = [t.requires_grad_() for t in args[:4]]

    def run(q, k, v, b):
        return torch.ops.spore.triangle_attention(q, k, v, b, mask)

    assert torch.autograd.gradcheck(run, leaves)
    out = run(*leaves)
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))
    compiled = torch.compile(run, fullgraph=True)
    torch.testing.assert_close(compiled(*leaves), out)
    (dq,) = torch.autograd.grad(compiled(*leaves).sum(), leaves[0])
    assert torch.equal(dq[0, 1], torch.zeros_like(dq[0, 1]))


def _bad_cases():
    q, k, v, b, m = _inputs((2,), 3, 5, 4, 2, 8, torch.float32, 2)
    good = dict(q=q, k=k, v=v, bias=b, mask=m)
    return [
        (good | dict(q=q.long()), TypeError, "q must be a floating-point tensor"),
        (good | dict(k=k.double()), TypeError, "one dtype"),
        (good | dict(bias=b.bfloat16()), TypeError, "one dtype"),
        (good | dict(q=q[0, 0, 0]), ValueError, r"4-D or more"),
        (good | dict(v=v[:, :, :3]), ValueError, "k and v must have one shape"),
        (good | dict(k=k[:, :2], v=v[:, :2]), ValueError, "q's batch dims and I"),
        (good | dict(k=k[..., :1, :], v=v[..., :1, :]), ValueError, "head count H = 2"),
        (good | dict(k=k[..., :4], v=v[..., :4]), ValueError, "head dim D = 8"),
        (good | dict(bias=b[:, :, :, :3]), ValueError, r"bias must be \[\*, H, J, K\]"),
        (good | dict(bias=b[0]), ValueError, r"bias must be \[\*, H, J, K\]"),
        (good | dict(mask=m.float()), TypeError, "mask must be a bool tensor"),
        (good | dict(mask=m[:, :, :2]), ValueError, r"mask must be \[\*, I, K\]"),
    ]


@pytest.mark.parametrize(("kwargs", "error", "message"), _bad_cases())
def test_bad_input_is_a_clear_error(kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        torch.ops.spore.triangle_attention(**kwargs)
    with pytest.raises(error, match=message):
        op.reference(**kwargs)


def test_bad_scale_is_a_clear_error() -> None:
    q, k, v, b, m = _inputs((), 2, 3, 3, 1, 4, torch.float32, 3)
    with pytest.raises(ValueError, match="scale must be finite"):
        torch.ops.spore.triangle_attention(q, k, v, b, m, float("nan"))
