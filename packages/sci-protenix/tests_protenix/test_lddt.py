"""smooth_lddt_loss against Protenix's SmoothLDDTLoss (dense and sparse forms) on the same atoms.

Protenix builds the inclusion mask with its ``compute_lddt_mask`` from the true distances, the
coordinate mask and the nucleotide flags, then scores a [N_sample, N, N] distance tensor; ours
takes the coordinates. Protenix's ``torch.cdist`` computes distances through a matmul for more
than 25 atoms, so values agree to ~1e-6 (tolerance 1e-5).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from sci_protenix.lddt import smooth_lddt_loss

loss_module = importlib.import_module("protenix.model.loss")


def _atoms(n: int, samples: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    steps = torch.randn(n, 3, generator=g)
    true = (steps / steps.norm(dim=-1, keepdim=True) * 3.8).cumsum(0)
    pred = true + torch.randn(samples, n, 3, generator=g) * 1.5
    nucleotide = torch.rand(n, generator=g) < 0.3
    mask = torch.rand(n, generator=g) > 0.1
    return pred, true, nucleotide, mask


def _protenix_mask(true, nucleotide, mask):
    distance_mask = (mask[:, None] & mask[None, :]).float()
    distance = torch.cdist(true, true) * distance_mask
    return loss_module.compute_lddt_mask(distance, distance_mask, nucleotide)


@pytest.mark.parametrize(("n", "samples", "chunk"), [(20, 1, None), (60, 3, 7), (90, 2, 32)])
def test_equals_protenix_dense_and_sparse(n, samples, chunk) -> None:
    pred, true, nucleotide, mask = _atoms(n, samples, seed=n)
    lddt_mask = _protenix_mask(true, nucleotide, mask)
    theirs = loss_module.SmoothLDDTLoss()
    dense = theirs.dense_forward(pred, true, lddt_mask)
    sparse = theirs.sparse_forward(pred, true, lddt_mask)
    ours = smooth_lddt_loss(pred, true, is_nucleotide=nucleotide, coord_mask=mask, chunk_size=chunk)
    torch.testing.assert_close(ours, dense, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours, sparse, rtol=1e-5, atol=1e-6)


def test_gradients_equal_protenix() -> None:
    pred, true, nucleotide, mask = _atoms(40, 2, seed=7)
    lddt_mask = _protenix_mask(true, nucleotide, mask)
    theirs_pred = pred.clone().requires_grad_()
    loss_module.SmoothLDDTLoss().dense_forward(theirs_pred, true, lddt_mask).backward()
    ours_pred = pred.clone().requires_grad_()
    smooth_lddt_loss(
        ours_pred, true, is_nucleotide=nucleotide, coord_mask=mask, chunk_size=9
    ).backward()
    torch.testing.assert_close(ours_pred.grad, theirs_pred.grad, rtol=1e-4, atol=1e-7)


def test_protenix_int64_coordinate_mask_is_taken_and_fractions_refused() -> None:
    """Protenix's featurizer gives ``coordinate_mask`` as int64 0/1, its loss multiplies the true
    distances by it: a fractional mask there shrinks distances (no weighting), so ours refuses
    one where Protenix would silently score other distances."""
    pred, true, nucleotide, mask = _atoms(30, 2, seed=3)
    flags = mask.long()
    distance_mask = flags[:, None] * flags[None, :]
    distance = torch.cdist(true, true) * distance_mask
    lddt_mask = loss_module.compute_lddt_mask(distance, distance_mask, nucleotide)
    theirs = loss_module.SmoothLDDTLoss().dense_forward(
        pred, true, lddt_mask, true_distance=distance
    )
    ours = smooth_lddt_loss(pred, true, is_nucleotide=nucleotide, coord_mask=flags)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    with pytest.raises(
        ValueError, match=r"coord_mask must be a bool tensor .*coord_mask\.bool\(\)"
    ):
        smooth_lddt_loss(pred, true, is_nucleotide=nucleotide, coord_mask=flags * 0.3)
