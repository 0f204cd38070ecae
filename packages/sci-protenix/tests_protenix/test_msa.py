"""sci-protenix's MSA modules equal Protenix 2.0.0's with the same weights (fp32, eval unless
stated). Tolerance rtol 1e-5, atol 1e-5: the same sums, in another order (chunks, einsum paths)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sci_protenix.chunking import apply_plan
from sci_protenix.memory_plan import MemoryPlan
from sci_protenix.msa import (
    MSABlock,
    MSAModule,
    MSAPairWeightedAveraging,
    MSAStack,
    OuterProductMean,
)

TOL = {"rtol": 1e-5, "atol": 1e-5}
Twin = Callable[..., tuple[nn.Module, nn.Module]]


@pytest.mark.parametrize("chunk_size", [None, 1, 4])
@pytest.mark.parametrize("with_mask", [False, True])
def test_outer_product_mean(
    px: SimpleNamespace, twin: Twin, chunk_size: int | None, with_mask: bool
) -> None:
    theirs, ours = twin(px.layers.OuterProductMean, OuterProductMean, 8, 6, 4)
    m = torch.randn(2, 5, 9, 8)
    mask = (torch.rand(2, 5, 9) > 0.25).float() if with_mask else None
    with torch.no_grad():
        expected = theirs(m, mask, chunk_size=chunk_size)
        got = ours(m, mask, chunk_size=chunk_size)
    assert expected.abs().max() > 1e-2
    torch.testing.assert_close(got, expected, **TOL)


def test_outer_product_mean_gradients(px: SimpleNamespace, twin: Twin) -> None:
    theirs, ours = twin(px.layers.OuterProductMean, OuterProductMean, 8, 6, 4)
    m0 = torch.randn(5, 9, 8)
    grads = []
    for module, chunk in ((theirs, None), (ours, 3)):
        m = m0.clone().requires_grad_()
        loss = module(m, chunk_size=chunk).square().sum()
        grads.append(torch.autograd.grad(loss, [m, *module.parameters()]))
    for got, expected in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("chunk_size", [None, 1, 3])
def test_pair_weighted_averaging(px: SimpleNamespace, twin: Twin, chunk_size: int | None) -> None:
    theirs, ours = twin(
        px.pairformer.MSAPairWeightedAveraging,
        MSAPairWeightedAveraging,
        c_m=8,
        c=4,
        c_z=6,
        n_heads=3,
    )
    m, z = torch.randn(7, 9, 8), torch.randn(9, 9, 6)
    with torch.no_grad():
        expected = theirs(m, z)
        got = ours(m, z, chunk_size=chunk_size)
    assert expected.abs().max() > 1e-2
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("msa_chunk_size", [None, 2, 5])
def test_msa_stack_inference(px: SimpleNamespace, twin: Twin, msa_chunk_size: int | None) -> None:
    kwargs = {"c_m": 8, "c_z": 6, "c": 4, "msa_chunk_size": 3, "msa_max_size": 16}
    theirs, ours = twin(px.pairformer.MSAStack, MSAStack, **kwargs)
    ours.msa_chunk_size = msa_chunk_size
    m, z = torch.randn(7, 9, 8), torch.randn(9, 9, 6)
    with torch.no_grad():
        expected = theirs(m.clone(), z)  # Protenix's inference path updates m in place
        got = ours(m, z)
        in_place = apply_plan(ours, MemoryPlan(msa=2, inplace=True))(m.clone(), z)
    torch.testing.assert_close(got, expected, **TOL)
    torch.testing.assert_close(in_place, expected, **TOL)


def test_msa_stack_training_without_dropout(px: SimpleNamespace, twin: Twin) -> None:
    """Protenix's training path (padding to msa_max_size, per-chunk checkpoints) against ours."""
    kwargs = {"c_m": 8, "c_z": 6, "c": 4, "dropout": 0.0, "msa_chunk_size": 3, "msa_max_size": 8}
    theirs, ours = twin(px.pairformer.MSAStack, MSAStack, **kwargs)
    theirs.train()
    ours.train()
    m0, z0 = torch.randn(7, 9, 8), torch.randn(9, 9, 6)
    results = []
    for module in (theirs, ours):
        m, z = m0.clone().requires_grad_(), z0.clone().requires_grad_()
        out = module(m, z)
        grads = torch.autograd.grad(out.square().sum(), [m, z, *module.parameters()])
        results.append((out, *grads))
    for got, expected in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, expected, **TOL)


MSA_CONFIGS = {"sample_cutoff": {"train": 5, "test": 6}, "min_size": {"train": 2, "test": 3}}


def msa_features(rows: int, n: int) -> dict[str, torch.Tensor]:
    return {
        "msa": torch.randint(0, 32, (rows, n)),
        "has_deletion": (torch.rand(rows, n) > 0.7).float(),
        "deletion_value": torch.rand(rows, n),
    }


@pytest.mark.parametrize("is_last_block", [False, True])
@pytest.mark.parametrize("chunk_size", [None, 2])
def test_msa_block(
    px: SimpleNamespace, twin: Twin, is_last_block: bool, chunk_size: int | None
) -> None:
    kwargs = {"c_m": 8, "c_z": 6, "c_hidden": 3, "is_last_block": is_last_block}
    theirs, ours = twin(px.pairformer.MSABlock, MSABlock, **kwargs, msa_chunk_size=3)
    m, z = torch.randn(5, 7, 8), torch.randn(7, 7, 6)
    mask = (torch.rand(7, 7) > 0.3).float()
    mask[:, 0] = mask[0, :] = 1.0  # no fully masked row (there Protenix's -1e9 bias differs)
    with torch.no_grad():
        expected = theirs(m.clone(), z.clone(), mask, chunk_size=chunk_size)
        got = ours(m, z, mask, chunk_size=chunk_size)
    assert (got[0] is None) == (expected[0] is None) == is_last_block
    torch.testing.assert_close(got[1], expected[1], **TOL)
    if not is_last_block:
        torch.testing.assert_close(got[0], expected[0], **TOL)


@pytest.mark.parametrize("plan", [None, MemoryPlan(outer_product=2, msa=2, tri_mul=3, tri_att=2)])
def test_msa_module(px: SimpleNamespace, twin: Twin, plan: MemoryPlan | None) -> None:
    kwargs = {"n_blocks": 2, "c_m": 8, "c_z": 6, "c_s_inputs": 5, "msa_chunk_size": 4}
    theirs, ours = twin(px.pairformer.MSAModule, MSAModule, **kwargs, msa_configs=MSA_CONFIGS)
    apply_plan(ours, plan)
    feats, z, s_inputs = msa_features(9, 7), torch.randn(7, 7, 6), torch.randn(7, 5)
    with torch.no_grad():
        torch.manual_seed(11)  # both draw the same MSA rows
        expected = theirs(feats, z, s_inputs, pair_mask=None)
        torch.manual_seed(11)
        got = ours(feats, z, s_inputs, pair_mask=None)
    assert not torch.allclose(expected, z, atol=1e-2)  # the module did update z
    torch.testing.assert_close(got, expected, **TOL)


def test_msa_module_with_a_size_one_batch_dim_on_s_inputs_only(
    px: SimpleNamespace, twin: Twin
) -> None:
    """Unbatched MSA features with ``s_inputs`` [1, N, c]: Protenix's out-of-place add takes it;
    ours failed in an in-place add with torch's broadcast message."""
    kwargs = {"n_blocks": 1, "c_m": 8, "c_z": 6, "c_s_inputs": 5, "msa_chunk_size": 4}
    theirs, ours = twin(px.pairformer.MSAModule, MSAModule, **kwargs, msa_configs=MSA_CONFIGS)
    feats, z, s_inputs = msa_features(9, 7), torch.randn(7, 7, 6), torch.randn(1, 7, 5)
    with torch.no_grad():
        torch.manual_seed(14)
        expected = theirs(feats, z, s_inputs, pair_mask=None)
        torch.manual_seed(14)
        got = ours(feats, z, s_inputs, pair_mask=None)
    assert got.shape == expected.shape == z.shape
    torch.testing.assert_close(got, expected, **TOL)


def test_msa_module_training(px: SimpleNamespace, twin: Twin) -> None:
    """Training mode without dropout (Protenix: padded MSA stack, per-block checkpoints)."""
    kwargs = {"n_blocks": 2, "c_m": 8, "c_z": 6, "c_s_inputs": 5, "msa_dropout": 0.0}
    theirs, ours = twin(
        px.pairformer.MSAModule,
        MSAModule,
        **kwargs,
        pair_dropout=0.0,
        msa_chunk_size=4,
        msa_configs=MSA_CONFIGS,
    )
    feats, z0, s_inputs = msa_features(9, 7), torch.randn(7, 7, 6), torch.randn(7, 5)
    results = []
    for module in (theirs.train(), ours.train()):
        z = z0.clone().requires_grad_()
        torch.manual_seed(12)
        out = module(feats, z, s_inputs, pair_mask=None)
        results.append((out, *torch.autograd.grad(out.square().sum(), [z, *module.parameters()])))
    scale = max(e.abs().max().item() for e in results[0])
    for got, expected in zip(results[1], results[0], strict=True):
        atol = max(1e-5 * expected.abs().max().item(), 1e-6 * scale)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("n_blocks", [1, 2])
def test_msa_module_with_an_msa_of_no_rows(
    px: SimpleNamespace, twin: Twin, n_blocks: int, training: bool
) -> None:
    """No MSA rows: the outer product mean is its bias over eps, the MSA stack has nothing to do."""
    kwargs = {"n_blocks": n_blocks, "c_m": 8, "c_z": 6, "c_s_inputs": 5, "msa_chunk_size": 4}
    theirs, ours = twin(px.pairformer.MSAModule, MSAModule, **kwargs, msa_configs=MSA_CONFIGS)
    feats, z, s_inputs = msa_features(0, 7), torch.randn(7, 7, 6), torch.randn(7, 5)
    results = []
    for module in (theirs.train(training), ours.train(training)):
        torch.manual_seed(13)
        results.append(module(feats, z.clone(), s_inputs, pair_mask=None))
    assert results[0].isfinite().all()
    assert not torch.allclose(results[0], z, atol=1e-2)
    torch.testing.assert_close(results[1], results[0], **TOL)


def test_msa_module_without_msa_returns_z(px: SimpleNamespace, twin: Twin) -> None:
    kwargs = {"n_blocks": 1, "c_m": 8, "c_z": 6, "c_s_inputs": 5, "msa_configs": MSA_CONFIGS}
    theirs, ours = twin(px.pairformer.MSAModule, MSAModule, **kwargs)
    z, s_inputs = torch.randn(7, 7, 6), torch.randn(7, 5)
    for feats in ({}, {"msa": torch.zeros(7, dtype=torch.long)}):
        assert theirs(feats, z, s_inputs, None) is z
        assert ours(feats, z, s_inputs, None) is z
