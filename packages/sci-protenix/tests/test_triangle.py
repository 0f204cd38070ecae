"""Triangle multiplication and triangle attention: the direct AF3 formulas (einsum, explicit
softmax over [N, N, N] logits) are the oracle; chunked equals whole at chunk sizes 1, odd and
> N; masks; plans; in-place inference equals out-of-place; gradients through chunks equal
plain autograd; bad inputs. fp32 tolerances: chunked vs whole rtol 1e-5 / atol 1e-5 (chunking
splits no sum: only the matmul blocking may change), fused vs composite formula atol 2e-5."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sci_protenix import (
    TriangleAttention,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
)
from sci_protenix.chunking import apply_plan
from sci_protenix.memory_plan import MemoryPlan
from sci_protenix.triangle import TriangleAttentionEndingNode, TriangleAttentionStartingNode

CHUNK = {"rtol": 1e-5, "atol": 1e-5}
FORMULA = {"rtol": 1e-5, "atol": 2e-5}
N, CZ = 9, 8


def _pair(batch: tuple[int, ...] = (2,), n: int = N, c: int = CZ) -> torch.Tensor:
    return torch.randn(*batch, n, n, c)


def _mask(batch: tuple[int, ...] = (2,), n: int = N) -> torch.Tensor:
    """A 0/1 float mask with at least one kept key in every row and column."""
    mask = (torch.rand(*batch, n, n) > 0.3).float()
    mask[..., 0] = 1.0
    mask[..., 0, :] = 1.0
    return mask


def tri_mul_formula(m, z: torch.Tensor, mask: torch.Tensor | None, outgoing: bool):
    """AF3 algorithms 12/13 written out with the module's parameters."""
    zn = F.layer_norm(z, (m.c_z,), m.layer_norm_in.weight, m.layer_norm_in.bias, 1e-5)
    keep = torch.ones(z.shape[:-1]) if mask is None else mask
    a = torch.sigmoid(zn @ m.linear_a_g.weight.T) * (zn @ m.linear_a_p.weight.T) * keep[..., None]
    b = torch.sigmoid(zn @ m.linear_b_g.weight.T) * (zn @ m.linear_b_p.weight.T) * keep[..., None]
    equation = "...ikc,...jkc->...ijc" if outgoing else "...kic,...kjc->...ijc"
    x = torch.einsum(equation, a, b)
    x = F.layer_norm(x, (m.c_hidden,), m.layer_norm_out.weight, m.layer_norm_out.bias, 1e-5)
    return (x @ m.linear_z.weight.T) * torch.sigmoid(zn @ m.linear_g.weight.T)


def tri_att_formula(m, x: torch.Tensor, mask: torch.Tensor | None, starting: bool):
    """AF3 algorithms 14/15 written out: explicit [*, I, H, J, K] logits and softmax."""
    if not starting:
        x = x.transpose(-2, -3)
        mask = None if mask is None else mask.transpose(-1, -2)
    xn = F.layer_norm(x, (m.c_in,), m.layer_norm.weight, m.layer_norm.bias, 1e-5)
    h, d = m.no_heads, m.c_hidden
    q, k, v, g = (
        (xn @ lin.weight.T).unflatten(-1, (h, d))
        for lin in (m.mha.linear_q, m.mha.linear_k, m.mha.linear_v, m.mha.linear_g)
    )
    bias = (xn @ m.linear.weight.T).permute(*range(x.dim() - 3), -1, -3, -2)  # [*, H, J, K]
    logits = (
        torch.einsum("...ijhd,...ikhd->...ihjk", q, k) / math.sqrt(d) + bias[..., None, :, :, :]
    )
    if mask is not None:
        logits = logits.masked_fill(mask[..., :, None, None, :] == 0, float("-inf"))
    o = torch.einsum("...ihjk,...ikhd->...ijhd", logits.softmax(-1), v)
    out = ((o * torch.sigmoid(g)).flatten(-2)) @ m.mha.linear_o.weight.T
    return out if starting else out.transpose(-2, -3)


MULS = [(TriangleMultiplicationOutgoing, True), (TriangleMultiplicationIncoming, False)]


@pytest.mark.parametrize(("cls", "outgoing"), MULS)
@pytest.mark.parametrize("with_mask", [False, True])
def test_tri_mul_equals_formula_at_every_chunk_size(cls, outgoing, with_mask, randomize) -> None:
    module = randomize(cls(c_z=CZ, c_hidden=6))
    z = _pair()
    mask = _mask() if with_mask else None
    with torch.no_grad():
        expected = tri_mul_formula(module, z, mask, outgoing)
        whole = module(z, mask=mask)
        torch.testing.assert_close(whole, expected, **FORMULA)
        for size in (1, 4, N, N + 6):
            torch.testing.assert_close(module(z, mask=mask, chunk_size=size), whole, **CHUNK)


@pytest.mark.parametrize(("cls", "outgoing"), MULS)
def test_tri_mul_masked_positions_do_not_contribute(cls, outgoing, randomize) -> None:
    module = randomize(cls(c_z=CZ, c_hidden=6))
    z, mask = _pair(), _mask()
    noisy = z + 100.0 * torch.randn_like(z) * (mask == 0)[..., None]
    with torch.no_grad():
        clean_x = module(z, mask=mask, chunk_size=4)
        noisy_x = module(noisy, mask=mask, chunk_size=4)
    # masked pairs enter only through a and b, which the mask zeroes: kept updates are unchanged
    keep = mask.bool()
    torch.testing.assert_close(noisy_x[keep], clean_x[keep], **CHUNK)


@pytest.mark.parametrize(("cls", "outgoing"), MULS)
def test_tri_mul_inplace_equals_out_of_place(cls, outgoing, randomize) -> None:
    module = randomize(cls(c_z=CZ, c_hidden=6))
    z, mask = _pair(), _mask()
    with torch.no_grad():
        expected = z + module(z, mask=mask)
        for size in (1, 4, N + 1):
            target = z.clone()
            got = module(
                target, mask=mask, inplace_safe=True, _add_with_inplace=True, chunk_size=size
            )
            assert got.data_ptr() == target.data_ptr()
            torch.testing.assert_close(target, expected, **CHUNK)
        # Protenix's default in-place chunk (256 rows) when no chunk size is given
        target = z.clone()
        module(target, mask=mask, inplace_safe=True, _add_with_inplace=True)
        torch.testing.assert_close(target, expected, **CHUNK)


@pytest.mark.parametrize(("cls", "outgoing"), MULS)
def test_tri_mul_inplace_with_grad_adds_out_of_place(cls, outgoing, randomize) -> None:
    module = randomize(cls(c_z=CZ, c_hidden=6))
    z = _pair()
    before = z.clone()
    got = module(z, inplace_safe=True, _add_with_inplace=True, chunk_size=3)
    torch.testing.assert_close(z, before, rtol=0, atol=0)  # parameters need grads: z untouched
    torch.testing.assert_close(got, before + module(before), **CHUNK)


@pytest.mark.parametrize(("cls", "outgoing"), MULS)
def test_tri_mul_gradients_through_chunks(cls, outgoing, randomize) -> None:
    module = randomize(cls(c_z=CZ, c_hidden=6))
    z0, mask = _pair((1,)), _mask((1,))
    grads = []
    for size in (None, 2, 5):
        module.zero_grad()
        z = z0.clone().requires_grad_()
        (module(z, mask=mask, chunk_size=size) ** 2).sum().backward()
        grads.append([z.grad, *(p.grad.clone() for p in module.parameters())])
    for other in grads[1:]:
        torch.testing.assert_close(other, grads[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("cls", "outgoing"), MULS)
def test_tri_mul_plan_sets_the_chunk_size(cls, outgoing, randomize) -> None:
    module = randomize(cls(c_z=CZ, c_hidden=6))
    calls = []
    module.linear_z.register_forward_hook(lambda *args: calls.append(1))
    z = _pair()
    with torch.no_grad():
        whole = module(z)
        apply_plan(module, MemoryPlan(tri_mul=2))
        calls.clear()
        torch.testing.assert_close(module(z, chunk_size=None), whole, **CHUNK)
    assert len(calls) == math.ceil(N / 2)  # one output projection per chunk of rows


STARTING = [True, False]


@pytest.mark.parametrize("starting", STARTING)
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("batch", [(), (2,)])
def test_tri_att_equals_formula_at_every_chunk_size(starting, with_mask, batch, randomize) -> None:
    module = randomize(TriangleAttention(c_in=CZ, c_hidden=4, no_heads=3, starting=starting))
    x = _pair(batch)
    mask = _mask(batch) if with_mask else None
    with torch.no_grad():
        expected = tri_att_formula(module, x, mask, starting)
        whole = module(x, mask=mask)
        torch.testing.assert_close(whole, expected, **FORMULA)
        for size in (1, 4, N + 6):
            torch.testing.assert_close(module(x, mask=mask, chunk_size=size), whole, **CHUNK)


def test_tri_att_node_classes(randomize) -> None:
    start = randomize(TriangleAttentionStartingNode(c_in=CZ, c_hidden=4, no_heads=2))
    end = TriangleAttentionEndingNode(c_in=CZ, c_hidden=4, no_heads=2)
    end.load_state_dict(start.state_dict(), strict=True)
    x = _pair()
    assert start.starting
    assert not end.starting
    with torch.no_grad():
        torch.testing.assert_close(end(x), start(x.transpose(-2, -3)).transpose(-2, -3), **CHUNK)


def _np_bool(value: bool) -> object:
    """A numpy bool (numpy is a test dependency; the package does not need it)."""
    return np.bool_(value)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: TriangleAttentionEndingNode(CZ, 4, 2, starting=True), "starting=False only"),
        (lambda: TriangleAttentionStartingNode(CZ, 4, 2, 0), "starting=True only"),
        (lambda: TriangleAttentionEndingNode(CZ, 4, 2, _np_bool(True)), "starting=False only"),
        (lambda: TriangleMultiplicationOutgoing(CZ, 4, _outgoing=False), "_outgoing=True only"),
        (lambda: TriangleMultiplicationIncoming(CZ, 4, _outgoing=True), "_outgoing=False only"),
    ],
)
def test_a_protenix_keyword_against_the_class_is_refused(make, message) -> None:
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    "make",
    [
        lambda: TriangleAttentionStartingNode(CZ, 4, 2, 1),
        lambda: TriangleAttentionStartingNode(CZ, 4, 2, _np_bool(True)),
        lambda: TriangleAttentionStartingNode(CZ, 4, 2, starting=True),
        lambda: TriangleAttentionEndingNode(CZ, 4, 2, 0),
        lambda: TriangleAttentionEndingNode(CZ, 4, 2, _np_bool(False)),
        lambda: TriangleMultiplicationOutgoing(CZ, 4, 1),
        lambda: TriangleMultiplicationOutgoing(CZ, 4, _np_bool(True)),
        lambda: TriangleMultiplicationIncoming(CZ, 4, 0),
        lambda: TriangleMultiplicationIncoming(CZ, 4, _np_bool(False)),
    ],
)
def test_a_protenix_keyword_is_taken_by_truth_value(make) -> None:
    """Protenix takes the flag by truth value: a numpy bool or an integer 0/1 that agrees with
    the class builds it."""
    make()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: TriangleAttentionStartingNode(CZ, 4, 2, 1e9),
            "4th positional argument is starting",
        ),
        (lambda: TriangleAttentionEndingNode(CZ, 4, 2, 1e4), "4th positional argument is starting"),
        (
            lambda: TriangleMultiplicationOutgoing(CZ, 4, 2.0),
            "3rd positional argument is _outgoing",
        ),
    ],
)
def test_a_positional_inf_is_refused_with_protenix_order(make, message) -> None:
    """The 4th positional argument is ``starting`` (Protenix's order), no longer ``inf``: an
    old-style positional ``inf`` is told to pass ``inf=`` by keyword."""
    with pytest.raises(ValueError, match=message) as raised:
        make()
    if "starting" in message:
        assert "pass inf= by keyword" in str(raised.value)


@pytest.mark.parametrize("starting", STARTING)
def test_tri_att_fully_masked_row_gives_zero_update(starting, randomize) -> None:
    module = randomize(TriangleAttention(c_in=CZ, c_hidden=4, no_heads=2, starting=starting))
    x, mask = _pair(), _mask()
    # row 3 of batch 0 keeps no key (the ending node attends along columns: column 3)
    if starting:
        mask[0, 3] = 0.0
    else:
        mask[0, :, 3] = 0.0
    with torch.no_grad():
        out = module(x, mask=mask, chunk_size=2)
    dead = out[0, 3] if starting else out[0, :, 3]
    torch.testing.assert_close(dead, torch.zeros_like(dead), rtol=0, atol=0)


@pytest.mark.parametrize("starting", STARTING)
def test_tri_att_mask_values_below_one_mask_their_key(starting, randomize) -> None:
    """As Protenix's ``inf * (mask - 1)`` bias: a mask value in (0, 1) masks as 0 (or False)."""
    module = randomize(TriangleAttention(c_in=CZ, c_hidden=4, no_heads=2, starting=starting))
    x, mask = _pair(), _mask()
    soft = torch.where(mask == 1, mask, 0.999 * torch.rand(mask.shape))
    with torch.no_grad():
        expected = tri_att_formula(module, x, mask, starting)
        for size in (None, 4):
            for given in (soft, mask.bool()):
                torch.testing.assert_close(module(x, given, size), expected, **FORMULA)


@pytest.mark.parametrize("starting", STARTING)
def test_tri_att_inplace_equals_out_of_place(starting, randomize) -> None:
    module = randomize(TriangleAttention(c_in=CZ, c_hidden=4, no_heads=2, starting=starting))
    x, mask = _pair(), _mask()
    with torch.no_grad():
        expected = x + module(x, mask=mask)
        for size in (None, 1, 4):
            target = x.clone()
            got = module(
                target, mask=mask, chunk_size=size, inplace_safe=True, _add_with_inplace=True
            )
            assert got.data_ptr() == target.data_ptr()
            torch.testing.assert_close(target, expected, **CHUNK)
        # plan.inplace asks for it too
        apply_plan(module, MemoryPlan(tri_att=3, inplace=True))
        target = x.clone()
        module(target, mask=mask, _add_with_inplace=True)
        torch.testing.assert_close(target, expected, **CHUNK)


@pytest.mark.parametrize("starting", STARTING)
def test_tri_att_gradients_through_chunks(starting, randomize) -> None:
    module = randomize(TriangleAttention(c_in=CZ, c_hidden=4, no_heads=2, starting=starting))
    x0, mask = _pair((1,)), _mask((1,))
    grads = []
    for size in (None, 1, 4):
        module.zero_grad()
        x = x0.clone().requires_grad_()
        (module(x, mask=mask, chunk_size=size) ** 2).sum().backward()
        grads.append([x.grad, *(p.grad.clone() for p in module.parameters())])
    for other in grads[1:]:
        torch.testing.assert_close(other, grads[0], rtol=1e-4, atol=1e-5)
    # and the same as autograd through the explicit formula
    module.zero_grad()
    x = x0.clone().requires_grad_()
    (tri_att_formula(module, x, mask, starting) ** 2).sum().backward()
    formula = [x.grad, *(p.grad for p in module.parameters())]
    torch.testing.assert_close(grads[0], formula, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "make", [lambda: TriangleMultiplicationOutgoing(CZ, 4), lambda: TriangleAttention(CZ, 4, 2)]
)
def test_bad_inputs_are_refused(make) -> None:
    module = make()
    with pytest.raises(ValueError, match="8 channels"):
        module(torch.randn(N, N, CZ + 1))
    with pytest.raises(ValueError, match="square"):
        module(torch.randn(N, N + 1, CZ))
    with pytest.raises(ValueError, match="mask must be"):
        module(torch.randn(N, N, CZ), torch.ones(N, N + 2))
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        module(torch.randn(N, N, CZ), chunk_size=0)
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        module([[0.0]])


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    n=st.integers(1, 11),
    size=st.integers(1, 13),
    batch=st.sampled_from([(), (1,), (2,)]),
    with_mask=st.booleans(),
    which=st.sampled_from(["out", "in", "start", "end"]),
)
def test_any_shape_chunked_equals_formula(n, size, batch, with_mask, which, randomize) -> None:
    """Hypothesis over sizes (N = 1 included), chunk sizes, batch dims and masks."""
    torch.manual_seed(n * 31 + size)
    if which in ("out", "in"):
        cls = TriangleMultiplicationOutgoing if which == "out" else TriangleMultiplicationIncoming
        module, formula, flag = randomize(cls(4, 3)), tri_mul_formula, which == "out"
    else:
        module = randomize(TriangleAttention(4, 2, 2, starting=which == "start"))
        formula, flag = tri_att_formula, which == "start"
    x = torch.randn(*batch, n, n, 4)
    mask = None
    if with_mask:
        mask = (torch.rand(*batch, n, n) > 0.3).float()
        mask[..., 0] = 1.0
        mask[..., 0, :] = 1.0
    with torch.no_grad():
        expected = formula(module, x, mask, flag)
        torch.testing.assert_close(module(x, mask, chunk_size=size), expected, **FORMULA)
