"""rope: the C++ CPU kernels against the plain-torch reference and complex multiplication, over
the table layouts of the contract, and the op's contract."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spore import dispatch
from spore_kernels import _lib
from spore_kernels.ops import rope as op

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
MODES = list(op.MODES)
B, S, H = 2, 5, 3

# (x shape without D, table shape without D): Hugging Face and flash-attention style layouts.
LAYOUTS = [
    ((B, S, H), (S, 1)),  # x [B, S, H, D], one table row per position
    ((B, S, H), (1, S, 1)),
    ((B, S, H), (B, S, 1)),  # per-batch positions
    ((B, S, H), (S, H)),
    ((B, S, H), ()),  # one row for everything
    ((B, H, S), (B, 1, S)),  # x [B, H, S, D] (Hugging Face's q, k)
    ((B, H, S), (S,)),
    ((B, H, S), (1, 1, S)),
    ((S,), (S,)),
    ((), ()),
    ((1, S, 1), (S, 1)),
]


def _angles(shape: tuple[int, ...], pairs: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand((*shape, pairs), generator=g, dtype=torch.float64) * 20 - 10


def _inputs(x_lead, t_lead, dim, dtype, table_dtype, half_table, mode, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn((*x_lead, dim), generator=g) * 2).to(dtype)
    theta = _angles(t_lead, dim // 2, seed + 1)
    if not half_table:
        theta = op._full(theta, dim, mode)
    return x, theta.cos().to(table_dtype), theta.sin().to(table_dtype)


def _complex(x: torch.Tensor, theta: torch.Tensor, mode: str) -> torch.Tensor:
    """rope as multiplication by exp(i theta) of one complex number per pair (float64)."""
    xd = x.double()
    if mode == "half":
        z = torch.complex(*xd.chunk(2, dim=-1)) * torch.polar(torch.ones_like(theta), theta)
        return torch.cat([z.real, z.imag], dim=-1)
    pairs = xd.reshape(*xd.shape[:-1], -1, 2)
    z = torch.view_as_complex(pairs.contiguous()) * torch.polar(torch.ones_like(theta), theta)
    return torch.view_as_real(z).flatten(-2)


@settings(max_examples=120, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    dim=st.sampled_from([2, 6, 16, 34, 128]),
    dtype=st.sampled_from(list(TOL)),
    fp32_table=st.booleans(),
    half_table=st.booleans(),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_reference(layout, dim, dtype, fp32_table, half_table, mode, seed) -> None:
    table_dtype = torch.float32 if fp32_table else dtype
    x, cos, sin = _inputs(*layout, dim, dtype, table_dtype, half_table, mode, seed)
    assert op.supports(x, cos, sin, mode)
    out = torch.ops.spore.rope(x, cos, sin, mode)
    assert out.dtype == dtype
    assert out.shape == x.shape
    tol = TOL[dtype]
    torch.testing.assert_close(out, op.reference(x, cos, sin, mode), rtol=tol, atol=tol)
    grad = x.flip(0) if x.dim() else x
    dx = torch.ops.spore.rope_backward(grad.contiguous(), cos, sin, mode)
    expected = op.reference_backward(grad, cos, sin, mode)
    torch.testing.assert_close(dx, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("half_table", [False, True])
def test_rope_is_complex_multiplication(mode, half_table) -> None:
    """Kernel (float32) and reference (float64) against exp(i theta) times each pair."""
    theta = _angles((S, 1), 8, 1)
    x = torch.randn(B, S, H, 16, generator=torch.Generator().manual_seed(2))
    expected = _complex(x, theta, mode)
    table = theta if half_table else op._full(theta, 16, mode)
    out = torch.ops.spore.rope(x, table.cos().float(), table.sin().float(), mode)
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)
    exact = op.reference(x.double(), table.cos(), table.sin(), mode)
    torch.testing.assert_close(exact, expected)


def test_hugging_face_tables_and_composite() -> None:
    """HF's duplicated-halves tables give HF's x * cos + rotate_half(x) * sin."""
    x = torch.randn(B, H, S, 32)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))
    freqs = torch.arange(S).float()[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[None, None]  # [1, 1, S, D] as HF unsqueezes it
    cos, sin = emb.cos().expand(B, 1, S, 32).contiguous(), emb.sin().expand(B, 1, S, 32)
    sin = sin.contiguous()
    assert dispatch.explain("rope", x, cos, sin, "half").chosen == "kernels"
    out = torch.ops.spore.rope(x, cos, sin, "half")
    torch.testing.assert_close(out, op.composite(x, cos, sin))
    half = torch.ops.spore.rope(x, freqs.cos(), freqs.sin(), "half")
    torch.testing.assert_close(half, out)


@pytest.mark.parametrize("mode", MODES)
def test_backward_inverts_a_rotation(mode) -> None:
    """With genuine rotations the transpose is the inverse: rope_backward(rope(x)) == x."""
    x = torch.randn(B, S, H, 64)
    theta = _angles((S, 1), 32, 3)
    cos, sin = theta.cos().float(), theta.sin().float()
    back = torch.ops.spore.rope_backward(torch.ops.spore.rope(x, cos, sin, mode), cos, sin, mode)
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)


def test_layouts_the_kernel_cannot_index_use_the_reference() -> None:
    x = torch.randn(2, 3, 4, 5, 8)
    cos, sin = torch.randn(2, 1, 4, 1, 8), torch.randn(2, 1, 4, 1, 8)
    assert op.layout(x.shape, cos.shape) is None  # four groups
    assert dispatch.explain("rope", x, cos, sin, "half").chosen == "reference"
    expected = x * cos + op.rotate_half(x) * sin
    torch.testing.assert_close(torch.ops.spore.rope(x, cos, sin, "half"), expected)
    y = torch.randn(3, 4, 8)
    c = torch.randn(4, 8)
    gapped = torch.randn(3, 4, 16)[..., ::2]
    assert dispatch.explain("rope", gapped, c, c, "half").chosen == "reference"
    assert dispatch.explain("rope", y.transpose(1, 2), c, c, "half").chosen == "reference"
    seq_first = torch.randn(4, 3, 2, 8).transpose(0, 1)  # [B, S, H, D] stored [S, B, H, D]
    per_batch = torch.randn(3, 4, 1, 8)  # [B, S, 1, D]: its B, S order is not x's memory order
    assert dispatch.explain("rope", seq_first, per_batch, per_batch, "half").chosen == "reference"
    assert dispatch.explain("rope", y, c.t().contiguous().t(), c, "half").chosen == "reference"
    assert dispatch.explain("rope", y.double(), c, c, "half").chosen == "reference"
    assert dispatch.explain("rope", y, c.double(), c.double(), "half").chosen == "reference"
    assert dispatch.explain("rope", y.bfloat16(), c, c, "interleaved").chosen == "kernels"
    out = torch.ops.spore.rope(gapped, c, c, "interleaved")
    torch.testing.assert_close(out, op.reference(gapped.contiguous(), c, c, "interleaved"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize(
    ("memory", "perm", "table"),
    [
        ((B, S, H), (0, 2, 1), (1, 1, S)),  # HF: q = proj.view(B, S, H, D).transpose(1, 2)
        ((B, S, H), (0, 2, 1), (B, 1, S)),
        ((S, B, H), (1, 0, 2), (S, 1)),  # sequence-first memory seen as [B, S, H, D]
        ((H, S, B), (2, 1, 0), (S, 1)),
    ],
)
def test_permuted_x_runs_the_kernel_in_memory_order(memory, perm, table, mode, dtype) -> None:
    """x stored in another dimension order (last dimension innermost): the kernel runs, the
    result equals the reference on a contiguous copy, and keeps x's strides, as the reference
    (the op's fake) does."""
    stored, cos, sin = _inputs(memory, table, 16, dtype, torch.float32, False, mode, 8)
    x = stored.permute(*perm, 3)
    assert not x.is_contiguous()
    assert dispatch.explain("rope", x, cos, sin, mode).chosen == "kernels"
    out = torch.ops.spore.rope(x, cos, sin, mode)
    tol = TOL[dtype]
    expected = op.reference(x.contiguous(), cos, sin, mode)
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    assert out.stride() == x.stride() == op.reference(x, cos, sin, mode).stride()
    dx = torch.ops.spore.rope_backward(x, cos, sin, mode)
    torch.testing.assert_close(
        dx, op.reference_backward(x.contiguous(), cos, sin, mode), rtol=tol, atol=tol
    )
    assert dx.stride() == x.stride()


def test_permuted_x_under_compile_and_autograd() -> None:
    """Compiled graphs trust the fake's strides: a transposed query through torch.compile,
    forward and backward, equals the reference."""
    theta = _angles((S,), 8, 9)
    cos, sin = op._full(theta, 16, "half").cos().float(), op._full(theta, 16, "half").sin().float()
    proj = torch.randn(B, S, H * 16, requires_grad=True)

    def fn(p: torch.Tensor, rope) -> torch.Tensor:
        q = p.view(B, S, H, 16).transpose(1, 2)
        return (rope(q, cos, sin, "half") * 2).sum(1)

    out = torch.compile(fn, fullgraph=True)(proj, torch.ops.spore.rope)
    ref_proj = proj.detach().clone().requires_grad_()
    expected = fn(ref_proj, op.reference)
    torch.testing.assert_close(out, expected)
    g = torch.randn_like(out)
    out.backward(g)
    expected.backward(g)
    torch.testing.assert_close(proj.grad, ref_proj.grad)


def test_layout_groups() -> None:
    assert op.layout(torch.Size([2, 5, 3, 8]), torch.Size([5, 1, 8])) == (2, 5, 3, 0, 1, 0)
    assert op.layout(torch.Size([2, 3, 5, 8]), torch.Size([2, 1, 5, 4])) == (2, 3, 5, 5, 0, 1)
    assert op.layout(torch.Size([2, 5, 3, 8]), torch.Size([2, 5, 3, 8])) == (1, 1, 30, 0, 0, 1)
    assert op.layout(torch.Size([8]), torch.Size([8])) == (1, 1, 1, 0, 0, 0)


@pytest.mark.parametrize("mode", MODES)
def test_gradients_match_autograd_of_the_reference(mode) -> None:
    full = op._full(_angles((S, 1), 4, 4), 8, mode)
    cos, sin = full.cos(), full.sin()
    x = torch.randn(B, S, H, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: torch.ops.spore.rope(a, cos, sin, mode), (x,))
    x32 = x.detach().float().requires_grad_()
    g = torch.randn(B, S, H, 8)
    torch.ops.spore.rope(x32, cos.float(), sin.float(), mode).backward(g)
    xr = x.detach().requires_grad_()
    op.reference(xr, cos, sin, mode).backward(g.double())
    torch.testing.assert_close(x32.grad.double(), xr.grad, rtol=1e-5, atol=1e-5)


def test_tables_are_constants_for_autograd() -> None:
    x = torch.randn(B, S, H, 8, requires_grad=True)
    cos = torch.rand(S, 1, 8, requires_grad=True)
    sin = torch.rand(S, 1, 8, requires_grad=True)
    torch.ops.spore.rope(x, cos, sin, "half").sum().backward()
    assert x.grad is not None
    assert cos.grad is None
    assert sin.grad is None
    expected = op.reference_backward(torch.ones_like(x), cos.detach(), sin.detach(), "half")
    torch.testing.assert_close(x.grad, expected)


@pytest.mark.parametrize(
    ("x", "table", "mode", "error", "message"),
    [
        (torch.ones(2, 7), torch.ones(7), "half", ValueError, "must be even, got 7"),
        (torch.ones(()), torch.ones(()), "half", ValueError, "0-dim"),
        (torch.ones(2, 8), torch.ones(8), "neox", ValueError, "'half', 'interleaved'"),
        (torch.ones(2, 8), torch.ones(3), "half", ValueError, r"must be 8 .* or 4 "),
        (torch.ones(2, 8), torch.ones(3, 8), "half", ValueError, "do not broadcast"),
        (torch.ones(2, 8), torch.ones(1, 2, 8), "half", ValueError, r"\[S, 1, D\]"),
        (torch.ones(2, 8, dtype=torch.int32), torch.ones(8), "half", TypeError, "floating"),
    ],
)
def test_bad_input_is_a_clear_error(x, table, mode, error, message) -> None:
    with pytest.raises(error, match=message):
        torch.ops.spore.rope(x, table, table, mode)


def test_cos_and_sin_must_match() -> None:
    with pytest.raises(ValueError, match="one shape"):
        torch.ops.spore.rope(torch.ones(2, 8), torch.ones(8), torch.ones(4), "half")


def test_compiles_fullgraph() -> None:
    x = torch.randn(B, S, H, 16)
    theta = _angles((S, 1), 8, 5)
    cos, sin = theta.cos().float(), theta.sin().float()

    def fn(a: torch.Tensor) -> torch.Tensor:
        return torch.ops.spore.rope(a, cos, sin, "half") + torch.ops.spore.rope(
            a, cos, sin, "interleaved"
        )

    expected = op.reference(x, cos, sin, "half") + op.reference(x, cos, sin, "interleaved")
    torch.testing.assert_close(torch.compile(fn, fullgraph=True)(x), expected)


@pytest.mark.parametrize("isa", _lib.available())
def test_every_installed_build_computes_the_same(isa) -> None:
    fn = _lib.function("spore_rope", op._ARGS, _lib.load(isa))
    for dtype in TOL:
        for mode in MODES:
            x, cos, sin = _inputs((B, S, H), (S, 1), 34, dtype, dtype, False, mode, 6)
            y = torch.empty_like(x)
            lay = op.layout(x.shape, cos.shape)
            ptrs = (x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr())
            flags = (MODES.index(mode), 0, 0, _lib.dtype_code(x), _lib.dtype_code(cos), 2)
            assert fn(*ptrs, B * S * H, 34, *lay, *flags) == 0
            tol = TOL[dtype]
            torch.testing.assert_close(y, op.reference(x, cos, sin, mode), rtol=tol, atol=tol)


def test_threads_do_not_change_the_result() -> None:
    x, cos, sin = _inputs((4, 64, 8), (64, 1), 128, torch.float32, torch.float32, True, "half", 7)
    lay = op.layout(x.shape, cos.shape)
    outs = []
    for threads in (1, 2, 3):
        y = torch.empty_like(x)
        ptrs = (x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr())
        _lib.call("spore_rope", op._ARGS, *ptrs, 4 * 64 * 8, 128, *lay, 0, 1, 0, 0, 0, threads)
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], outs[2])


def test_the_library_refuses_bad_arguments() -> None:
    fn = _lib.function("spore_rope", op._ARGS)
    t = torch.ones(8)
    p = (t.data_ptr(),) * 4
    ok = (1, 8, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1)
    assert fn(*p, *ok) == 0
    assert fn(None, *p[1:], *ok) == 1
    assert fn(*p, 1, 7, *ok[2:]) == 1  # odd dimension
    assert fn(*p, 2, 8, *ok[2:]) == 1  # rows != outer * middle * inner
    assert fn(*p, *ok[:9], 2, *ok[10:]) == 1  # a flag that is not 0/1
    assert fn(*p, *ok[:-1], 0) == 1  # no threads
    assert fn(*p, *ok[:11], 9, *ok[12:]) == 2  # unknown dtype
    assert fn(*p, *ok[:11], 1, 2, 1) == 2  # a float16 table for bfloat16 x
