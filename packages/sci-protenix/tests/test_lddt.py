"""smooth_lddt_loss against a direct O(N^2) implementation of AF3 algorithm 27.

Chunking splits the rows of sums the direct form adds whole, so fp32 results agree to ~1e-6
relative (tolerance 1e-5); gradients too (tolerance 1e-5 relative, 1e-7 absolute).
"""

from __future__ import annotations

import pytest
import torch

from sci_protenix.lddt import smooth_lddt_loss
from spore import memory


def direct_loss(pred, true, is_nucleotide, coord_mask):
    """Algorithm 27 written out: every [N, N] matrix at once, per batch element."""
    d_pred = torch.linalg.vector_norm(pred[..., :, None, :] - pred[..., None, :, :], dim=-1)
    d_true = torch.linalg.vector_norm(true[..., :, None, :] - true[..., None, :, :], dim=-1)
    diff = (d_pred - d_true).abs()
    eps = 0.25 * (
        torch.sigmoid(0.5 - diff)
        + torch.sigmoid(1.0 - diff)
        + torch.sigmoid(2.0 - diff)
        + torch.sigmoid(4.0 - diff)
    )
    nuc = is_nucleotide.float()[..., :, None]
    c = (d_true < 30.0).float() * nuc + (d_true < 15.0).float() * (1 - nuc)
    n = pred.shape[-2]
    c = c * (1 - torch.eye(n))
    c = c * coord_mask.float()[..., :, None] * coord_mask.float()[..., None, :]
    lddt = (c * eps).sum((-1, -2)) / (c.sum((-1, -2)) + 1e-10)
    return 1 - lddt


def structure(batch, n, seed=0):
    """A chain-like true structure (spacing ~3.8 Å, so both radii matter) and a noisy guess."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.randn(*batch, n, 3, generator=g)
    true = (steps / steps.norm(dim=-1, keepdim=True) * 3.8).cumsum(-2)
    pred = true + torch.randn(*batch, n, 3, generator=g) * 1.5
    nucleotide = torch.rand(*batch, n, generator=g) < 0.3
    mask = torch.rand(*batch, n, generator=g) > 0.15
    return pred, true, nucleotide, mask


@pytest.mark.parametrize("chunk_size", [None, 1, 5, 16, 40])
@pytest.mark.parametrize("batch", [(), (3,), (2, 2)])
def test_equals_the_direct_form(chunk_size, batch) -> None:
    pred, true, nucleotide, mask = structure(batch, 23)
    expected = direct_loss(pred, true, nucleotide, mask)
    got = smooth_lddt_loss(
        pred,
        true,
        is_nucleotide=nucleotide,
        coord_mask=mask,
        chunk_size=chunk_size,
        reduction="none",
    )
    assert got.shape == batch
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    mean = smooth_lddt_loss(pred, true, is_nucleotide=nucleotide, coord_mask=mask)
    torch.testing.assert_close(mean, expected.mean(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_size", [None, 64])
def test_16_bit_coordinates_are_scored_in_float32(dtype, chunk_size) -> None:
    """Millions of included pairs: a 16-bit count overflows fp16 (NaN) and a 16-bit running
    sum loses bf16 chunks; the loss of the rounded coordinates is the float64 one, rounded once."""
    g = torch.Generator().manual_seed(4)
    true = (torch.rand(3000, 3, generator=g) * 40).to(dtype)
    pred = (true.float() + torch.randn(3000, 3, generator=g) * 1.5).to(dtype)
    no = torch.zeros(3000, dtype=torch.bool)
    expected = direct_loss(pred.double(), true.double(), no, ~no)
    got = smooth_lddt_loss(pred, true, chunk_size=chunk_size)
    assert got.dtype == dtype
    assert abs(got.double() - expected) <= torch.finfo(dtype).eps * expected


def test_defaults_are_all_protein_all_present() -> None:
    pred, true, _, _ = structure((2,), 19, seed=1)
    expected = direct_loss(pred, true, torch.zeros(19, dtype=torch.bool), torch.ones(19))
    torch.testing.assert_close(
        smooth_lddt_loss(pred, true, chunk_size=4, reduction="none"), expected, rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_no_atoms_scores_as_no_included_pair(chunk_size) -> None:
    """N = 0 gives what a structure with no included pair gives (LDDT 0, loss 1), with a
    gradient: it raised an unrelated error from range()."""
    pred, true, _, _ = structure((2,), 5, seed=4)
    unmasked = torch.zeros(5, dtype=torch.bool)
    expected = smooth_lddt_loss(pred, true, coord_mask=unmasked, reduction="none")
    empty = torch.zeros(2, 0, 3, requires_grad=True)
    got = smooth_lddt_loss(empty, torch.zeros(0, 3), chunk_size=chunk_size, reduction="none")
    torch.testing.assert_close(got, expected)
    got.sum().backward()
    assert empty.grad.shape == empty.shape


def test_the_nucleotide_radius_changes_the_result() -> None:
    pred, true, _, mask = structure((), 30, seed=2)
    protein = smooth_lddt_loss(pred, true, coord_mask=mask)
    rna = smooth_lddt_loss(
        pred, true, coord_mask=mask, is_nucleotide=torch.ones(30, dtype=torch.bool)
    )
    assert not torch.allclose(protein, rna)
    torch.testing.assert_close(rna, direct_loss(pred, true, torch.ones(30), mask))


def test_a_sample_dim_on_the_prediction_broadcasts() -> None:
    pred, true, nucleotide, mask = structure((), 17, seed=3)
    samples = pred + torch.randn(4, 17, 3, generator=torch.Generator().manual_seed(9))
    got = smooth_lddt_loss(
        samples, true, is_nucleotide=nucleotide, coord_mask=mask, chunk_size=6, reduction="none"
    )
    torch.testing.assert_close(
        got, direct_loss(samples, true, nucleotide, mask), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("chunk_size", [None, 3, 8])
def test_gradients_equal_plain_autograd(chunk_size) -> None:
    pred, true, nucleotide, mask = structure((2,), 21, seed=4)
    pred_a = pred.clone().requires_grad_()
    true_a = true.clone().requires_grad_()
    direct_loss(pred_a, true_a, nucleotide, mask).mean().backward()
    pred_b = pred.clone().requires_grad_()
    true_b = true.clone().requires_grad_()
    smooth_lddt_loss(
        pred_b, true_b, is_nucleotide=nucleotide, coord_mask=mask, chunk_size=chunk_size
    ).backward()
    torch.testing.assert_close(pred_b.grad, pred_a.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(true_b.grad, true_a.grad, rtol=1e-5, atol=1e-7)
    assert pred_b.grad.abs().sum() > 0


def _training_peak(n, chunk_size):
    pred, true, nucleotide, mask = structure((), n, seed=5)
    pred.requires_grad_()
    with memory.peak() as meter:
        smooth_lddt_loss(
            pred, true, is_nucleotide=nucleotide, coord_mask=mask, chunk_size=chunk_size
        ).backward()
    return meter.peak_bytes


def test_chunked_memory_is_bounded_by_the_chunk() -> None:
    n, chunk = 512, 16
    whole = _training_peak(n, None)
    chunked = _training_peak(n, chunk)
    pair = n * n * 4  # one fp32 [N, N] matrix
    assert whole > 8 * pair  # the direct form holds many [N, N] matrices (about 14 here)
    assert chunked < whole / 16  # chunked: only [chunk, N] ones (16 of 512 rows: 1/32 as many)
    assert _training_peak(2 * n, chunk) < 2.5 * chunked  # linear in N at a fixed chunk


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"pred_coords": torch.zeros(5, 2)}, ValueError, r"pred_coords must be .*\[\.\.\., N, 3\]"),
        (
            {"true_coords": torch.zeros(6, 3)},
            ValueError,
            "pred_coords has 5 atoms but true_coords has 6",
        ),
        ({"pred_coords": torch.zeros(5, 3, dtype=torch.long)}, TypeError, "floating point"),
        ({"is_nucleotide": torch.zeros(4)}, ValueError, "is_nucleotide must have shape"),
        (
            {"coord_mask": torch.ones(3, 5), "pred_coords": torch.zeros(2, 5, 3)},
            ValueError,
            "do not broadcast",
        ),
        (
            {"coord_mask": torch.full((5,), 0.3)},
            ValueError,
            r"coord_mask must be a bool tensor .* holding 0\.3.*pass coord_mask\.bool\(\)",
        ),
        ({"coord_mask": torch.tensor([1, 0, 2, 1, 1])}, ValueError, "holding 2"),
        ({"coord_mask": torch.tensor([1.0, float("nan"), 1, 1, 1])}, ValueError, "holding nan"),
        ({"is_nucleotide": torch.full((5,), -1)}, ValueError, "is_nucleotide must be a bool"),
        ({"chunk_size": 0}, ValueError, "chunk_size must be a positive int"),
        ({"reduction": "sum"}, ValueError, "reduction must be"),
    ],
)
def test_bad_inputs(kwargs, error, match) -> None:
    args = {"pred_coords": torch.zeros(5, 3), "true_coords": torch.zeros(5, 3), **kwargs}
    pred, true = args.pop("pred_coords"), args.pop("true_coords")
    with pytest.raises(error, match=match):
        smooth_lddt_loss(pred, true, **args)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.float16])
def test_zero_one_flags_of_any_dtype_equal_bool_flags(dtype) -> None:
    """Protenix's featurizer gives an int64 0/1 ``coordinate_mask``: taken as the bool mask."""
    pred, true, nucleotide, mask = structure((2,), 17)
    expected = smooth_lddt_loss(pred, true, is_nucleotide=nucleotide, coord_mask=mask)
    got = smooth_lddt_loss(
        pred, true, is_nucleotide=nucleotide.to(dtype), coord_mask=mask.to(dtype), chunk_size=4
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_an_int_mask_compiles_whole_and_vmaps() -> None:
    """The 0/1 check indexed by a data-dependent mask: ``fullgraph=True`` raised on a
    data-dependent guard and ``vmap`` refused the boolean indexing."""
    pred, true, nucleotide, mask = structure((2,), 9)
    expected = smooth_lddt_loss(pred, true, is_nucleotide=nucleotide, coord_mask=mask)
    compiled = torch.compile(smooth_lddt_loss, backend="aot_eager", fullgraph=True)
    got = compiled(pred, true, is_nucleotide=nucleotide.long(), coord_mask=mask.long())
    torch.testing.assert_close(got, expected)

    def one(p, t, m):
        return smooth_lddt_loss(p, t, is_nucleotide=nucleotide[0], coord_mask=m)

    batched = torch.vmap(one)(pred, true, mask.long())
    rows = [one(pred[i], true[i], mask[i]) for i in range(2)]
    torch.testing.assert_close(batched, torch.stack(rows))


@pytest.mark.parametrize("chunk_size", [None, 4])
@pytest.mark.parametrize("placeholder", [float("nan"), float("inf")])
def test_true_coordinates_of_masked_atoms_are_not_read(chunk_size, placeholder) -> None:
    """An atom without coordinates (coord_mask False) often holds NaN there: the loss and the
    gradients are those of any finite placeholder (NaN * 0 leaked into both)."""
    pred, true, nucleotide, mask = structure((2,), 17, seed=5)
    mask[:, 3] = False
    pred.requires_grad_()
    expected = smooth_lddt_loss(pred, true, is_nucleotide=nucleotide, coord_mask=mask)
    (expected_grad,) = torch.autograd.grad(expected, pred)
    missing = true.clone().requires_grad_()
    with torch.no_grad():
        missing[~mask] = placeholder
    got = smooth_lddt_loss(
        pred, missing, is_nucleotide=nucleotide, coord_mask=mask, chunk_size=chunk_size
    )
    grad, true_grad = torch.autograd.grad(got, (pred, missing))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)
    assert torch.isfinite(true_grad).all()
    assert (true_grad[~mask] == 0).all()
