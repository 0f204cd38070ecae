"""sci-protenix's MSA modules equal Protenix 2.0.0's with the same weights (fp32, eval unless
stated). Tolerance rtol 1e-5, atol 1e-5: the same sums, in another order (chunks, einsum paths)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from sci_protenix.chunking import apply_plan
from sci_protenix.memory_plan import MemoryPlan
from sci_protenix.msa import MSAPairWeightedAveraging, MSAStack, OuterProductMean
from torch import nn

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
