"""AttentionPairBias (AF3 algorithm 24) through the fused attention op: the explicit formula
(softmax over q.k / sqrt(d) + per-head pair bias) is the oracle; chunked over queries equals
whole (fp32, rtol 1e-5 / atol 1e-5); plan; gradients; bad inputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sci_protenix import AttentionPairBias
from sci_protenix.chunking import apply_plan
from sci_protenix.memory_plan import MemoryPlan

TOL = {"rtol": 1e-5, "atol": 1e-5}
N, CA, CS, CZ, H = 7, 8, 6, 5, 2


def formula(m: AttentionPairBias, a, s, z):
    if m.has_s:
        ln = m.layernorm_a
        sn = F.layer_norm(s, (CS,), ln.layernorm_s.weight, None, 1e-5)
        an = torch.sigmoid(sn @ ln.linear_s.weight.T + ln.linear_s.bias) * F.layer_norm(
            a, (CA,)
        ) + (sn @ ln.linear_nobias_s.weight.T)
    else:
        an = F.layer_norm(a, (CA,), m.layernorm_a.weight, m.layernorm_a.bias, 1e-5)
    att = m.attention
    q = (an @ att.linear_q.weight.T + att.linear_q.bias).unflatten(-1, (H, CA // H))
    k, v, g = (
        (an @ lin.weight.T).unflatten(-1, (H, CA // H))
        for lin in (att.linear_k, att.linear_v, att.linear_g)
    )
    zn = F.layer_norm(z, (CZ,), m.layernorm_z.weight, m.layernorm_z.bias, 1e-5)
    bias = (zn @ m.linear_nobias_z.weight.T).movedim(-1, -3)  # [*, H, N, N]
    logits = torch.einsum("...ihd,...jhd->...hij", q, k) / math.sqrt(CA // H) + bias
    o = torch.einsum("...hij,...jhd->...ihd", logits.softmax(-1), v)
    out = (o * torch.sigmoid(g)).flatten(-2) @ att.linear_o.weight.T
    if m.has_s:
        out = torch.sigmoid(s @ m.linear_a_last.weight.T + m.linear_a_last.bias) * out
    return out


def _inputs(batch=(2,)):
    return torch.randn(*batch, N, CA), torch.randn(*batch, N, CS), torch.randn(*batch, N, N, CZ)


@pytest.mark.parametrize("has_s", [False, True])
@pytest.mark.parametrize("batch", [(), (2,)])
def test_equals_formula_at_every_chunk_size(has_s, batch, randomize) -> None:
    m = randomize(
        AttentionPairBias(
            has_s=has_s, create_offset_ln_z=not has_s, n_heads=H, c_a=CA, c_s=CS, c_z=CZ
        )
    )
    a, s, z = _inputs(batch)
    with torch.no_grad():
        expected = formula(m, a, s, z)
        for size in (None, 1, 3, N + 4):
            torch.testing.assert_close(m(a, s, z, chunk_size=size), expected, **TOL)


def test_pair_bias_broadcasts_over_extra_batch_dims(randomize) -> None:
    m = randomize(AttentionPairBias(has_s=False, n_heads=H, c_a=CA, c_z=CZ))
    _a, _, z = _inputs((3,))
    a2 = torch.randn(4, 3, N, CA)  # e.g. samples over one pair tensor
    with torch.no_grad():
        got = m(a2, None, z, chunk_size=2)
        expected = torch.stack([m(a2[i], None, z) for i in range(4)])
    torch.testing.assert_close(got, expected, **TOL)


def test_plan_chunks_queries(randomize) -> None:
    m = apply_plan(
        randomize(AttentionPairBias(has_s=False, n_heads=H, c_a=CA, c_z=CZ)),
        MemoryPlan(pair_bias=2),
    )
    calls = []
    m.linear_nobias_z.register_forward_hook(lambda *args: calls.append(args[1][0].shape))
    a, _s, z = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(m(a, None, z), formula(m, a, None, z), **TOL)
    assert len(calls) == math.ceil(N / 2)
    assert calls[0][-3] == 2


@pytest.mark.parametrize("has_s", [False, True])
def test_gradients_through_chunks_equal_the_formula(has_s, randomize) -> None:
    m = randomize(AttentionPairBias(has_s=has_s, n_heads=H, c_a=CA, c_s=CS, c_z=CZ))
    inputs = _inputs()
    grads = []
    for size in ("formula", None, 1, 3):
        m.zero_grad()
        a, s, z = (t.clone().requires_grad_() for t in inputs)
        out = formula(m, a, s, z) if size == "formula" else m(a, s, z, chunk_size=size)
        (out**2).sum().backward()
        found = [a.grad, z.grad, *(p.grad.clone() for p in m.parameters())]
        grads.append(found + ([s.grad] if has_s else []))
    for other in grads[1:]:
        torch.testing.assert_close(other, grads[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [{"n_queries": 4}, {"n_keys": 8}, {"n_queries": 4, "n_keys": 0}])
def test_one_window_size_alone_runs_global_attention_as_protenix(window) -> None:
    """Protenix 2.0.0 runs local attention only when both ``n_queries`` and ``n_keys`` are given
    (``if n_queries and n_keys``), global attention otherwise; one alone was a ValueError here,
    so a boosted Protenix model failed where Protenix's module ran."""
    m = AttentionPairBias(has_s=False, n_heads=H, c_a=CA, c_z=CZ)
    a, _s, z = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(m(a, None, z, **window), m(a, None, z), rtol=0, atol=0)


def test_bad_inputs() -> None:
    m = AttentionPairBias(has_s=False, n_heads=H, c_a=CA, c_z=CZ)
    a, _s, z = _inputs()
    with pytest.raises(ValueError, match=r"local attention \(n_queries=4, n_keys=8\)"):
        m(a, None, z, n_queries=4, n_keys=8)
    with pytest.raises(ValueError, match="5 channels"):
        m(a, None, torch.randn(2, N, N, CZ + 1))
    with pytest.raises(ValueError, match="a's N"):
        m(a, None, torch.randn(2, N + 1, N + 1, CZ))
    with pytest.raises(ValueError, match="chunk_size"):
        m(a, None, z, chunk_size=0)
    with pytest.raises(ValueError, match="multiple of n_heads"):
        AttentionPairBias(n_heads=3, c_a=CA)
    with_s = AttentionPairBias(has_s=True, n_heads=H, c_a=CA, c_s=CS, c_z=CZ)
    with pytest.raises(ValueError, match="needs s"):
        with_s(a, None, z)
    for bad in (_s[:, 1:], torch.randn(3, N, CS)):  # torch's errors: N, batch (3,) against (2,)
        with pytest.raises(ValueError, match=r"s must be \[\.\.\., N, c_s\] with a's N"):
            with_s(a, bad, z)
    assert with_s(a, _s.expand(3, *_s.shape), z).shape == (3, 2, N, CA)  # broadcast, as Protenix
