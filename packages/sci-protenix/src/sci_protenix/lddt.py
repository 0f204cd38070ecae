"""The smooth LDDT loss of AlphaFold3 (supplement algorithm 27), chunked over atom rows.

For atoms l != m whose true distance is within the inclusion radius of l (15 Å, or 30 Å when l
belongs to a nucleotide) and that both have coordinates, the score of the pair is
``0.25 * sum_t sigmoid(t - |d_pred(l, m) - d_true(l, m)|)`` over t = 0.5, 1, 2, 4 Å; LDDT is
its mean over the included pairs and the loss ``1 - LDDT`` (1 where no pair is included, no
atoms included). With ``chunk_size`` the pair
distances are built ``chunk_size`` rows at a time; under autograd each chunk is recomputed in
backward (``torch.utils.checkpoint``), so neither pass holds more than one chunk's
``[chunk_size, N]`` pair tensors. 16-bit coordinates are scored in float32 (a running sum of
millions of pairs overflows fp16 and drops bf16 chunks), and the loss is rounded once to their
dtype.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint

from sci_protenix.chunking import check_chunk_size
from sci_protenix.primitives import broadcast

THRESHOLDS = (0.5, 1.0, 2.0, 4.0)
PROTEIN_RADIUS = 15.0
NUCLEOTIDE_RADIUS = 30.0


def smooth_lddt_loss(
    pred_coords: torch.Tensor,
    true_coords: torch.Tensor,
    *,
    is_nucleotide: torch.Tensor | None = None,
    coord_mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
    reduction: Literal["mean", "none"] = "mean",
    eps: float = 1e-10,
) -> torch.Tensor:
    """``1 - smooth LDDT`` of ``pred_coords`` against ``true_coords``.

    ``pred_coords``, ``true_coords``: ``[..., N, 3]`` (batch dims broadcast, e.g. a diffusion
    sample dim on the prediction only). ``is_nucleotide``: ``[..., N]`` (DNA/RNA atoms: 30 Å
    radius), default all protein. ``coord_mask``: ``[..., N]``, False where the true atom has
    no coordinates (those are not read: NaN there is fine). Both flags are bool, or 0/1 of any
    dtype (Protenix's int64 ``coordinate_mask``); other values are a ValueError.
    ``chunk_size``: atom rows per chunk (None: all at once).
    ``reduction``: ``"mean"`` over the batch (a scalar) or ``"none"`` (the batch shape).
    """
    batch, n, chunk_size = _check(
        pred_coords, true_coords, is_nucleotide, coord_mask, chunk_size, reduction
    )
    dev = pred_coords.device
    nucleotide = (
        torch.zeros(n, dtype=torch.bool, device=dev) if is_nucleotide is None else is_nucleotide
    )
    mask = torch.ones(n, dtype=torch.bool, device=dev) if coord_mask is None else coord_mask
    radius = torch.where(nucleotide.bool(), NUCLEOTIDE_RADIUS, PROTEIN_RADIUS)
    dtype = torch.promote_types(pred_coords.dtype, true_coords.dtype)
    compute = torch.promote_types(dtype, torch.float32)  # 16-bit sums lose chunks, overflow
    pred = pred_coords.to(compute).expand(*batch, n, 3)
    mask = mask.bool().expand(*batch, n)
    # an atom without coordinates may hold NaN or inf there: its pairs are excluded, but
    # NaN * 0 would still be NaN, in the loss and in every gradient
    true = torch.where(mask[..., None], true_coords.to(compute), 0.0).expand(*batch, n, 3)
    radius = radius.to(true.dtype).expand(*batch, n)
    size = max(1, n if chunk_size is None else min(chunk_size, n))  # n = 0: one empty chunk
    recompute = size < n and torch.is_grad_enabled() and (pred.requires_grad or true.requires_grad)
    score = pred.new_zeros(batch)
    count = true.new_zeros(batch)
    for start in range(0, max(n, 1), size):
        rows = slice(start, start + size)
        args = (
            pred[..., rows, :],
            pred,
            true[..., rows, :],
            true,
            radius[..., rows],
            mask[..., rows],
            mask,
            start,
        )
        if recompute:
            part, included = checkpoint(_rows, *args, use_reentrant=False)
        else:
            part, included = _rows(*args)
        score = score + part
        count = count + included
    lddt = score / (count + eps)
    loss = 1 - lddt
    return (loss.mean() if reduction == "mean" else loss).to(dtype)


def _rows(
    pred_rows: torch.Tensor,
    pred: torch.Tensor,
    true_rows: torch.Tensor,
    true: torch.Tensor,
    radius_rows: torch.Tensor,
    mask_rows: torch.Tensor,
    mask: torch.Tensor,
    start: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed pair scores and the included-pair count of atom rows ``start...``."""
    d_pred = torch.linalg.vector_norm(pred_rows[..., :, None, :] - pred[..., None, :, :], dim=-1)
    d_true = torch.linalg.vector_norm(true_rows[..., :, None, :] - true[..., None, :, :], dim=-1)
    rows = torch.arange(start, start + pred_rows.shape[-2], device=pred.device)
    columns = torch.arange(pred.shape[-2], device=pred.device)
    included = (
        (d_true < radius_rows[..., None])
        & mask_rows[..., None]
        & mask[..., None, :]
        & (rows[:, None] != columns[None, :])
    )
    error = (d_pred - d_true).abs()
    score = sum(torch.sigmoid(t - error) for t in THRESHOLDS) * 0.25
    included_f = included.to(score.dtype)
    return (score * included_f).sum((-1, -2)), included_f.detach().sum((-1, -2))


def _checkable(t: torch.Tensor) -> bool:
    """Whether ``t``'s values can be checked for free: a plain CPU tensor in eager mode (on an
    accelerator the check would wait for the device; compiled or under vmap it would break
    the graph or the transform)."""
    return (
        t.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and not torch._C._functorch.is_functorch_wrapped_tensor(t)
    )


def _check(
    pred: torch.Tensor,
    true: torch.Tensor,
    is_nucleotide: torch.Tensor | None,
    coord_mask: torch.Tensor | None,
    chunk_size: int | None,
    reduction: str,
) -> tuple[torch.Size, int, int | None]:
    """The inputs' batch shape, their number of atoms and the chunk size as an int
    (:func:`sci_protenix.chunking.check_chunk_size`); a ValueError or TypeError naming what is
    wrong."""
    for name, coords in (("pred_coords", pred), ("true_coords", true)):
        if not isinstance(coords, torch.Tensor) or coords.dim() < 2 or coords.shape[-1] != 3:
            shape = tuple(coords.shape) if isinstance(coords, torch.Tensor) else type(coords)
            raise ValueError(f"{name} must be a tensor of shape [..., N, 3], got {shape}")
        if not coords.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {coords.dtype}")
    n = pred.shape[-2]
    if true.shape[-2] != n:
        raise ValueError(
            f"pred_coords has {n} atoms but true_coords has {true.shape[-2]}; they must match"
        )
    batch = [pred.shape[:-2], true.shape[:-2]]
    for name, per_atom in (("is_nucleotide", is_nucleotide), ("coord_mask", coord_mask)):
        if per_atom is None:
            continue
        if not isinstance(per_atom, torch.Tensor) or per_atom.dim() < 1 or per_atom.shape[-1] != n:
            shape = tuple(per_atom.shape) if isinstance(per_atom, torch.Tensor) else type(per_atom)
            raise ValueError(f"{name} must have shape [..., N] with N = {n} atoms, got {shape}")
        if per_atom.dtype != torch.bool and _checkable(per_atom):  # Protenix's: int64 0/1
            other = per_atom[(per_atom != 0) & (per_atom != 1)]
            if other.numel():
                raise ValueError(
                    f"{name} must be a bool tensor (or hold only 0 and 1), got a "
                    f"{per_atom.dtype} holding {other[0].item()}; it flags atoms, it does not "
                    f"weight them: pass {name}.bool() if every non-zero value means True"
                )
        batch.append(per_atom.shape[:-1])
    shape = broadcast(*batch)
    if shape is None:
        raise ValueError(
            f"the batch dims of the inputs do not broadcast: {[tuple(b) for b in batch]}"
        )
    size = check_chunk_size(chunk_size)
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    return shape, n, size
