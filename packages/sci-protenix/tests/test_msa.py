"""MSA modules: chunked equals whole and the direct formulas; gradients through chunks; plans;
in-place inference; bad inputs. fp32 tolerance: rtol 1e-5, atol 1e-6 (chunking splits no sum)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import sci_protenix
from sci_protenix.chunking import apply_plan
from sci_protenix.memory_plan import MemoryPlan
from sci_protenix.msa import (
    MSABlock,
    MSAModule,
    MSAPairWeightedAveraging,
    MSAStack,
    OuterProductMean,
)

TOL = {"rtol": 1e-5, "atol": 1e-6}


def randomized(module: nn.Module, seed: int = 0) -> nn.Module:
    """``module`` with seeded random parameters (its zero-initialised outputs made non-trivial)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.dim() >= 2:
                param.copy_(noise / param.shape[-1] ** 0.5)
            else:
                param.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * noise)
    return module


def assert_grads_close(got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    """Gradients equal to 1e-5 of each tensor's largest entry, or 1e-6 of the largest gradient
    of all (for gradients that are zero in exact arithmetic, e.g. a layer-norm offset feeding
    a softmax): chunks and recompute order backward's sums differently."""
    scale = max(e.abs().max().item() for e in expected)
    for g, e in zip(got, expected, strict=True):
        tol = max(1e-5 * e.abs().max().item(), 1e-6 * scale)
        worst = (g - e).abs().max().item()
        assert worst <= tol, f"gradient differs by {worst:.3g} (> {tol:.3g}) of max {scale:.3g}"


def opm_direct(opm: OuterProductMean, m: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Outer product mean by its definition, one (i, j) sum over sequences at a time."""
    if mask is None:
        mask = torch.ones(m.shape[:-1])
    normed = opm.layer_norm(m)
    a = opm.linear_1(normed) * mask[..., None]
    b = opm.linear_2(normed) * mask[..., None]
    n = m.shape[-2]
    out = torch.empty(*m.shape[:-3], n, n, opm.c_z)
    for i in range(n):
        for j in range(n):
            outer = (a[..., :, i, :, None] * b[..., :, j, None, :]).sum(-3)
            count = (mask[..., :, i] * mask[..., :, j]).sum(-1)[..., None]
            out[..., i, j, :] = opm.linear_out(outer.flatten(-2)) / (count + opm.eps)
    return out


def pwa_direct(pwa: MSAPairWeightedAveraging, m: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Pair-weighted averaging by its definition: explicit softmax and sums over tokens j."""
    normed = pwa.layernorm_m(m)
    v = pwa.linear_no_bias_mv(normed).unflatten(-1, (pwa.n_heads, pwa.c))
    g = torch.sigmoid(pwa.linear_no_bias_mg(normed)).unflatten(-1, (pwa.n_heads, pwa.c))
    logits = pwa.linear_no_bias_z(pwa.layernorm_z(z))  # [*, i, j, h]
    w = logits.exp() / logits.exp().sum(-2, keepdim=True)
    o = (w[..., None, :, :, :, None] * v[..., :, None, :, :, :]).sum(-3)  # [*, s, i, h, c]
    return pwa.linear_no_bias_out((g * o).flatten(-2))


class Calls:
    """Counts the calls of a submodule (one per chunk)."""

    def __init__(self, module: nn.Module) -> None:
        self.count = 0
        module.register_forward_hook(self._hook)

    def _hook(self, *_: object) -> None:
        self.count += 1


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 1, 3, 7, 50])
def test_outer_product_mean_matches_direct_formula(with_mask: bool, chunk_size: int | None) -> None:
    opm = randomized(OuterProductMean(c_m=6, c_z=5, c_hidden=3)).eval()
    m = torch.randn(2, 4, 7, 6)
    mask = (torch.rand(2, 4, 7) > 0.3).float() if with_mask else None
    with torch.no_grad():
        expected = opm_direct(opm, m, mask)
        got = opm(m, mask, chunk_size=chunk_size)
    assert expected.abs().max() > 1e-2  # the update is not trivially zero
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("chunk_size", [None, 1, 2, 5, 9])
def test_pair_weighted_averaging_matches_direct_formula(chunk_size: int | None) -> None:
    pwa = randomized(MSAPairWeightedAveraging(c_m=6, c=4, c_z=5, n_heads=3)).eval()
    m, z = torch.randn(2, 5, 6, 6), torch.randn(2, 6, 6, 5)
    with torch.no_grad():
        expected = pwa_direct(pwa, m, z)
        got = pwa(m, z, chunk_size=chunk_size)
    assert expected.abs().max() > 1e-2
    torch.testing.assert_close(got, expected, **TOL)


@settings(max_examples=20, deadline=None)
@given(
    s=st.integers(1, 5),
    n=st.integers(1, 8),
    chunk=st.integers(1, 9),
    masked=st.booleans(),
)
def test_outer_product_mean_chunked_equals_whole(s: int, n: int, chunk: int, masked: bool) -> None:
    opm = randomized(OuterProductMean(c_m=4, c_z=3, c_hidden=2)).eval()
    m = torch.randn(s, n, 4)
    mask = (torch.rand(s, n) > 0.3).float() if masked else None
    with torch.no_grad():
        torch.testing.assert_close(opm(m, mask, chunk_size=chunk), opm(m, mask), **TOL)


def test_gradients_through_chunks_equal_plain_autograd() -> None:
    opm = randomized(OuterProductMean(c_m=6, c_z=5, c_hidden=3))
    pwa = randomized(MSAPairWeightedAveraging(c_m=6, c=4, c_z=5, n_heads=2), seed=1)
    m0, z0 = torch.randn(4, 7, 6), torch.randn(7, 7, 5)
    mask = (torch.rand(4, 7) > 0.2).float()
    grads = []
    for chunk in (None, 2, 3):
        m, z = m0.clone().requires_grad_(), z0.clone().requires_grad_()
        loss = (opm(m, mask, chunk_size=chunk) * z).sum() + pwa(
            m, z, chunk_size=chunk
        ).square().sum()
        params = [*opm.parameters(), *pwa.parameters()]
        grads.append(torch.autograd.grad(loss, [m, z, *params]))
    for chunked_grads in grads[1:]:
        for got, expected in zip(chunked_grads, grads[0], strict=True):
            torch.testing.assert_close(got, expected, **TOL)


def test_plan_chunk_sizes_override_the_argument() -> None:
    opm = randomized(OuterProductMean(c_m=4, c_z=3, c_hidden=2)).eval()
    pwa = randomized(MSAPairWeightedAveraging(c_m=4, c=2, c_z=3, n_heads=2)).eval()
    m, z = torch.randn(5, 7, 4), torch.randn(7, 7, 3)
    opm_calls, pwa_calls = Calls(opm.linear_out), Calls(pwa.linear_no_bias_out)
    with torch.no_grad():
        whole = opm(m), pwa(m, z)
        apply_plan(opm, MemoryPlan(outer_product=3))
        apply_plan(pwa, MemoryPlan(msa=2))
        planned = opm(m, chunk_size=100), pwa(m, z, chunk_size=100)
    assert (opm_calls.count, pwa_calls.count) == (1 + math.ceil(7 / 3), 1 + math.ceil(5 / 2))
    for got, expected in zip(planned, whole, strict=True):
        torch.testing.assert_close(got, expected, **TOL)


def test_a_plan_without_msa_fields_keeps_the_modules_own_chunks() -> None:
    """The planner leaves ``msa`` and ``outer_product`` None: MSAStack keeps its
    ``msa_chunk_size`` and OuterProductMean the call's ``chunk_size``."""
    stack = randomized(MSAStack(c_m=4, c_z=3, c=2, dropout=0.0, msa_chunk_size=2)).eval()
    opm = randomized(OuterProductMean(c_m=4, c_z=3, c_hidden=2)).eval()
    m, z = torch.randn(5, 7, 4), torch.randn(7, 7, 3)
    rows, opm_calls = (
        Calls(stack.msa_pair_weighted_averaging.linear_no_bias_out),
        Calls(opm.linear_out),
    )
    plan = sci_protenix.plan(tokens=7, budget="1GiB", c_z=3, c_s=0, n_heads=2, pair_heads=2)
    assert plan.msa is None
    assert plan.outer_product is None
    with torch.no_grad():
        whole = stack(m, z), opm(m, chunk_size=3)
        apply_plan(stack, plan)
        apply_plan(opm, plan)
        planned = stack(m, z), opm(m, chunk_size=3)
    assert rows.count == 2 * math.ceil(5 / 2)
    assert opm_calls.count == 2 * math.ceil(7 / 3)
    for got, expected in zip(planned, whole, strict=True):
        torch.testing.assert_close(got, expected, **TOL)


def _stack_reference(stack: MSAStack, m: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """MSAStack by its definition on whole tensors (eval: no dropout)."""
    m = m + pwa_direct(stack.msa_pair_weighted_averaging, m, z)
    return m + stack.transition_m(m)


@pytest.mark.parametrize("rows", [5, 0])
@pytest.mark.parametrize("msa_chunk_size", [None, 1, 2, 6])
def test_msa_stack_chunked_equals_reference(msa_chunk_size: int | None, rows: int) -> None:
    stack = randomized(MSAStack(c_m=6, c_z=5, c=3, msa_chunk_size=msa_chunk_size)).eval()
    m, z = torch.randn(rows, 6, 6), torch.randn(6, 6, 5)
    with torch.no_grad():
        expected = _stack_reference(stack, m, z)
        got = stack(m, z)
    torch.testing.assert_close(got, expected, **TOL)


def test_msa_stack_in_place_inference_writes_into_m() -> None:
    stack = randomized(MSAStack(c_m=6, c_z=5, c=3, msa_chunk_size=2)).eval()
    m, z = torch.randn(5, 6, 6), torch.randn(6, 6, 5)
    with torch.no_grad():
        expected = stack(m, z)
        target = m.clone()
        got = stack(target, z, inplace_safe=True)
        assert got.data_ptr() == target.data_ptr()
        planned = apply_plan(stack, MemoryPlan(msa=3, inplace=True))(m.clone(), z)
    torch.testing.assert_close(got, expected, **TOL)
    torch.testing.assert_close(planned, expected, **TOL)
    needs_grad = m.clone().requires_grad_()
    out = stack(needs_grad, z, inplace_safe=True)
    assert out.data_ptr() != needs_grad.data_ptr()  # never in place when a gradient is needed


def _fits(shape: tuple[int, ...], other: tuple[int, ...]) -> bool:
    """Whether broadcasting with batch dims ``other`` only adds leading size-1 dims to
    ``shape`` (or none)."""
    grown = tuple(torch.broadcast_shapes(shape, other))
    extra = len(grown) - len(shape)
    return grown[extra:] == shape and set(grown[:extra]) <= {1}


@pytest.mark.parametrize(
    ("m_batch", "z_batch"),
    [((2,), ()), ((), (2,)), ((), (1,)), ((1,), ()), ((1, 1), (2,)), ((1,), (1, 1))],
)
def test_in_place_with_batch_dims_that_broadcast_equals_out_of_place(
    m_batch: tuple[int, ...], z_batch: tuple[int, ...]
) -> None:
    """Batch dims ``check_msa_and_pair`` lets broadcast: in place, an input the other's batch
    broadcasts to a larger shape gets a new result; the other is still written into, and an
    input the other's batch only adds leading size-1 dims to is written into too (its result
    a view of it)."""
    block = randomized(MSABlock(c_m=6, c_z=5, c_hidden=2, msa_chunk_size=2)).eval()
    m, z = torch.randn(*m_batch, 3, 4, 6), torch.randn(*z_batch, 4, 4, 5)
    with torch.no_grad():
        expected = block.msa_stack(m, z), *block(m, z, None)
        target, block_m, block_z = m.clone(), m.clone(), z.clone()
        stack = block.msa_stack(target, z, inplace_safe=True)
        got = stack, *block(block_m, block_z, None, inplace_safe=True)
    m_kept, z_kept = _fits(m_batch, z_batch), _fits(z_batch, m_batch)
    assert (stack.data_ptr() == target.data_ptr()) == m_kept
    assert (got[1].data_ptr() == block_m.data_ptr()) == m_kept
    assert (got[2].data_ptr() == block_z.data_ptr()) == z_kept
    for out, want in zip(got, expected, strict=True):
        assert out.shape == want.shape
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_msa_stack_dropout_mask_is_shared_across_chunks() -> None:
    stack = randomized(MSAStack(c_m=6, c_z=5, c=3, dropout=0.5, msa_chunk_size=None)).train()
    m, z = torch.randn(5, 6, 6), torch.randn(6, 6, 5)
    torch.manual_seed(3)
    whole = stack(m, z)
    stack.msa_chunk_size = 2
    torch.manual_seed(3)
    chunked = stack(m, z)
    torch.testing.assert_close(chunked, whole, **TOL)
    stack.eval()
    assert not torch.allclose(whole, stack(m, z))  # dropout did act in training


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_bad_chunk_size_is_rejected(bad: object) -> None:
    opm = OuterProductMean(c_m=4, c_z=3, c_hidden=2)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        opm(torch.randn(2, 3, 4), chunk_size=bad)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_a_bad_msa_chunk_size_is_refused_when_built_and_named(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^msa_chunk_size must be a positive int"):
        MSAStack(c_m=4, c_z=3, c=2, msa_chunk_size=bad)
    for n_blocks in (0, 1, 2):  # with 0 or 1 block (no MSA stack) it was taken unchecked
        with pytest.raises(ValueError, match=r"^msa_chunk_size must be a positive int"):
            MSAModule(n_blocks=n_blocks, c_m=4, c_z=3, c_s_inputs=5, msa_chunk_size=bad)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "1"])
def test_a_bad_blocks_per_ckpt_is_refused_when_built_as_by_the_pairformer(bad: object) -> None:
    """0 or -1 built and then failed every forward, inference too, unnamed; 2.0 failed in
    training in ``range()``. The message is ``PairformerStack``'s."""
    message = r"^blocks_per_ckpt must be an int >= 1 \(blocks per recomputed segment\) or None"
    with pytest.raises(ValueError, match=message):
        MSAModule(n_blocks=2, c_m=4, c_z=3, c_s_inputs=5, blocks_per_ckpt=bad)
    with pytest.raises(ValueError, match=message):
        sci_protenix.PairformerStack(n_blocks=2, n_heads=2, c_z=4, c_s=4, blocks_per_ckpt=bad)


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), True, "0.1"])
def test_a_bad_dropout_is_refused_when_built_and_named(bad: object) -> None:
    """``MSAStack(dropout=1.5)`` failed only at the first training forward, in torch; an
    ``MSAModule``'s last block has no MSA stack, so there it was never checked."""
    with pytest.raises(ValueError, match=r"^dropout must be a float in \[0, 1\)"):
        MSAStack(c_m=4, c_z=3, c=2, dropout=bad)
    builds = (
        lambda **kw: MSABlock(c_m=4, c_z=3, is_last_block=True, **kw),
        lambda **kw: MSAModule(n_blocks=1, c_m=4, c_z=3, c_s_inputs=5, **kw),
    )
    for name in ("msa_dropout", "pair_dropout"):
        for build in builds:
            with pytest.raises(ValueError, match=rf"^{name} must be a float in \[0, 1\)"):
                build(**{name: bad})


def test_bad_shapes_are_rejected_with_the_fix() -> None:
    opm = OuterProductMean(c_m=4, c_z=3, c_hidden=2)
    pwa = MSAPairWeightedAveraging(c_m=4, c=2, c_z=3, n_heads=2)
    with pytest.raises(ValueError, match=r"m must be an MSA \[\*, S, N, c_m\] with 4 channels"):
        opm(torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match="mask must be an MSA mask"):
        opm(torch.randn(2, 3, 4), torch.ones(3, 2))
    with pytest.raises(ValueError, match="z must be square"):
        pwa(torch.randn(2, 3, 4), torch.randn(3, 4, 3))
    with pytest.raises(ValueError, match="m has 3 tokens"):
        pwa(torch.randn(2, 3, 4), torch.randn(5, 5, 3))
    m, z = torch.randn(2, 4, 3, 4), torch.randn(3, 3, 3, 3)  # batch dims 2 and 3: torch's errors
    block = MSABlock(c_m=4, c_z=3, c_hidden=2)
    for run in (pwa, MSAStack(c_m=4, c_z=3), lambda m, z: block(m, z, None)):
        with pytest.raises(ValueError, match=r"m's batch dims \(2,\) and z's \(3,\) do not"):
            run(m, z)
    with pytest.raises(TypeError, match=r"m must be a torch\.Tensor"):
        opm([[1.0]])


MSA_CONFIGS = {"sample_cutoff": {"train": 5, "test": 6}, "min_size": {"train": 2, "test": 3}}


def msa_module(**kwargs: object) -> MSAModule:
    base = {"n_blocks": 2, "c_m": 6, "c_z": 5, "c_s_inputs": 4, "msa_configs": MSA_CONFIGS}
    return randomized(MSAModule(**(base | kwargs)))


def msa_features(rows: int = 8, n: int = 6) -> dict[str, torch.Tensor]:
    return {
        "msa": torch.randint(0, 32, (rows, n)),
        "has_deletion": (torch.rand(rows, n) > 0.7).float(),
        "deletion_value": torch.rand(rows, n),
    }


def test_msa_embedding_equals_the_one_hot_linear() -> None:
    module = msa_module()
    feats, s_inputs = msa_features(), torch.randn(6, 4)
    one_hot = torch.nn.functional.one_hot(feats["msa"], 32).float()
    features = torch.cat(
        [one_hot, feats["has_deletion"][..., None], feats["deletion_value"][..., None]], -1
    )
    expected = module.linear_no_bias_m(features) + module.linear_no_bias_s(s_inputs)
    torch.testing.assert_close(module.embed_msa(feats, s_inputs), expected, **TOL)


@pytest.mark.parametrize("rows", [2, 3])  # S = B once (a wrong broadcast fits), S != B once
def test_a_batched_msa_module_equals_each_example_alone(rows: int) -> None:
    configs = {"strategy": "topk", "sample_cutoff": {"test": rows}, "min_size": {"test": rows}}
    module = msa_module(msa_configs=configs).eval()
    batch = [msa_features(rows=rows) for _ in range(2)]
    feats = {k: torch.stack([f[k] for f in batch]) for k in batch[0]}
    z, s_inputs = torch.randn(2, 6, 6, 5), torch.randn(2, 6, 4)
    with torch.no_grad():
        batched = module(feats, z, s_inputs, None)
        alone = torch.stack([module(batch[b], z[b], s_inputs[b], None) for b in range(2)])
    torch.testing.assert_close(batched, alone, **TOL)


def test_msa_module_in_place_with_a_batched_msa_and_an_unbatched_z() -> None:
    configs = {"strategy": "topk", "sample_cutoff": {"test": 3}, "min_size": {"test": 3}}
    module = msa_module(msa_configs=configs).eval()
    batch = [msa_features(rows=3) for _ in range(2)]
    feats = {k: torch.stack([f[k] for f in batch]) for k in batch[0]}
    z, s_inputs = torch.randn(6, 6, 5), torch.randn(2, 6, 4)
    with torch.no_grad():
        expected = module(feats, z, s_inputs, None)
        got = module(feats, z.clone(), s_inputs, None, inplace_safe=True)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_msa_sampling_bounds() -> None:
    module = msa_module().eval()
    feats = msa_features(rows=10)
    feats["msa"] = torch.arange(10)[:, None].expand(10, 6)  # row r holds class r
    for _ in range(20):
        rows = module.sample_msa(feats)["msa"][:, 0]
        assert 3 <= len(rows) <= 6
        assert len(set(rows.tolist())) == len(rows)
    module.msa_configs.update(strategy="topk", test_lowerb=10)
    assert module.sample_msa(feats)["msa"][:, 0].tolist() == list(range(6))


@pytest.mark.parametrize(
    ("chunk_size", "plan"),
    [(2, None), (None, MemoryPlan(outer_product=2, msa=3, tri_mul=2, tri_att=4, transition=3))],
)
def test_msa_module_chunked_equals_whole(chunk_size: int | None, plan: MemoryPlan | None) -> None:
    module = msa_module(msa_chunk_size=None).eval()
    feats, z, s_inputs = msa_features(), torch.randn(6, 6, 5), torch.randn(6, 4)
    with torch.no_grad():
        torch.manual_seed(1)
        whole = module(feats, z, s_inputs, None)
        apply_plan(module, plan)
        torch.manual_seed(1)
        chunked = module(feats, z, s_inputs, None, chunk_size=chunk_size)
        torch.manual_seed(1)
        in_place = module(
            feats, z.clone(), s_inputs, None, inplace_safe=True, chunk_size=chunk_size
        )
    assert not torch.allclose(whole, z, atol=1e-2)
    # four blocks deep: chunks change the matmul shapes, so rounding adds up to ~1e-6 absolute
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(in_place, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recompute", ["block", "selective"])
def test_msa_module_recompute_gradients_equal_plain_autograd(recompute: str) -> None:
    module = msa_module(msa_dropout=0.0, pair_dropout=0.0, blocks_per_ckpt=None).train()
    feats, z0, s_inputs = msa_features(), torch.randn(6, 6, 5), torch.randn(6, 4)
    grads = []
    for plan in (None, MemoryPlan(recompute=recompute, msa=3, outer_product=2)):
        apply_plan(module, plan)
        z = z0.clone().requires_grad_()
        torch.manual_seed(2)
        out = module(feats, z, s_inputs, None)
        grads.append(torch.autograd.grad(out.square().sum(), [z, *module.parameters()]))
    assert_grads_close(grads[1], grads[0])


def test_msa_module_bad_inputs() -> None:
    module = msa_module()
    z, s_inputs = torch.randn(6, 6, 5), torch.randn(6, 4)
    with pytest.raises(ValueError, match="lacks the MSA features \\['has_deletion'"):
        module({"msa": torch.zeros(3, 6, dtype=torch.long)}, z, s_inputs, None)
    feats = msa_features()
    with pytest.raises(ValueError, match="token counts differ"):
        module(feats, torch.randn(7, 7, 5), torch.randn(7, 4), None)
    for bad in (32, -1):  # a raw IndexError from the embedding
        feats["msa"][:, 0] = bad  # in every row: the module samples rows
        with pytest.raises(ValueError, match=r"class indices in \[0, 32\), got values from"):
            module(feats, z, s_inputs, None)
    feats["msa"] = feats["msa"].float()
    with pytest.raises(TypeError, match="must hold class indices"):
        module(feats, z, s_inputs, None)
    feats = msa_features()
    rows = feats["msa"].shape[0]
    for name, bad in (("has_deletion", (rows + 2, 6)), ("deletion_value", (rows, 5))):
        wrong = {**feats, name: torch.zeros(bad)}  # more rows were paired silently
        with pytest.raises(ValueError, match=f"{name}'\\] must have msa's shape"):
            module(wrong, z, s_inputs, None)
    with pytest.raises(ValueError, match=r"s_inputs \(2, 6, 4\) does not broadcast"):
        module(feats, z, torch.randn(2, 6, 4), None)
    batched = {k: v.expand(2, *v.shape) for k, v in feats.items()}  # torch's RuntimeError
    with pytest.raises(
        ValueError,
        match=r"s_inputs \(3, 6, 4\) does not broadcast onto the "
        r"MSA features \(2, 8, 6\)",
    ):
        module(batched, z, torch.randn(3, 6, 4), None)
    with pytest.raises(ValueError, match="n_blocks must be an int >= 0, got -1"):
        MSAModule(n_blocks=-1)
    with pytest.raises(ValueError, match="strategy'\\] must be 'random' or 'topk'"):
        MSAModule(msa_configs={"strategy": "best"})


class LargestTensor(TorchDispatchMode):
    """The largest tensor any op creates while active (inputs are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def largest_tensor(fn: Callable[[], torch.Tensor]) -> int:
    with torch.no_grad(), LargestTensor() as mode:
        fn()
    return mode.numel


def test_outer_product_is_never_whole_when_chunked() -> None:
    s, n, c_m, c, c_z = 3, 12, 4, 4, 2
    opm = randomized(OuterProductMean(c_m=c_m, c_z=c_z, c_hidden=c)).eval()
    m = torch.randn(s, n, c_m)
    assert largest_tensor(lambda: opm(m)) >= n * n * c * c  # whole: the [N, N, c, c] product
    assert largest_tensor(lambda: opm(m, chunk_size=3)) <= 3 * n * c * c  # 3 rows of it


def test_pair_weighted_averaging_rows_are_never_whole_when_chunked() -> None:
    s, n, c_m, c, heads, c_z = 16, 6, 4, 8, 4, 3
    pwa = randomized(MSAPairWeightedAveraging(c_m=c_m, c=c, c_z=c_z, n_heads=heads)).eval()
    m, z = torch.randn(s, n, c_m), torch.randn(n, n, c_z)
    assert largest_tensor(lambda: pwa(m, z)) >= s * n * heads * c  # values for every sequence
    chunked = largest_tensor(lambda: pwa(m, z, chunk_size=2))
    assert chunked <= max(2 * n * heads * c, s * n * c_m)  # 2 sequences' values, or the output
