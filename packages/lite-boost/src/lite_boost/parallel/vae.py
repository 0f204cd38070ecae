"""VAE temporal-slice data parallel: each rank decodes a contiguous run of latent frames.

A causal video VAE decoder (diffusers' ``AutoencoderKLWan``) decodes latent frame ``i`` from
frames ``i - R .. i`` only: every causal temporal convolution reaches back ``kernel_t - 1``
frames at its own frame rate, and the per-frame attention and norms mix no frames. A chunk
that starts at frame ``s - overlap`` therefore decodes frames ``s ..`` exactly like the full
decode once ``overlap >= R`` (:func:`wan_decoder_overlap` computes ``R``; the outputs are then
bit-identical, since every frame runs the same computation on the same cached features). A
smaller overlap is an approximation whose error grows as it shrinks.

``R`` is large for Wan: 38 latent frames for the Wan 2.1 VAE (12 convolutions at the latent
rate reach 2 frames each, 7 at twice that rate, 13 at four times), more than the 21 latent
frames of an 81-frame video. An exact decode of such a video runs on one rank (the others
idle); a real split needs ``overlap < R`` and accepts the approximation.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn

from lite_boost.numeric_args import int_at_least
from lite_boost.parallel.manager import ParallelManager
from lite_boost.parallel.sequence import exchange_shapes, gather_sequence


def decode_temporal_parallel(
    decode: Callable[[torch.Tensor], torch.Tensor],
    latents: torch.Tensor,
    *,
    manager: ParallelManager,
    overlap: int,
    time_dim: int = 2,
    frames_per_latent: int | None = None,
) -> torch.Tensor:
    """``decode(latents)`` computed by the ranks of ``manager`` together; every rank gets it.

    ``latents`` (the same on every rank) is split along ``time_dim`` into contiguous chunks,
    balanced by frames decoded: every chunk but the first starts ``overlap`` frames early (the
    causal context), and the output frames of those leading frames are dropped before the
    chunks are gathered. With fewer chunks than ranks the extra ranks decode nothing but still
    join the collectives. Runs under ``torch.no_grad()``; the output keeps ``decode``'s dtype.
    Inference only: latents that require grad under grad mode are refused (no gradient would
    reach them).

    ``frames_per_latent``: output frames per latent frame past a chunk's first (Wan: 4). By
    default it is read off each chunk as ``(out_frames - 1) / (latent_frames - 1)``, the causal
    video VAE convention where a chunk's first latent frame decodes to one frame; that needs
    ``overlap >= 1`` when there is more than one chunk. Give it for a decoder without that
    rule (e.g. a per-frame one, which can use ``overlap=0``).
    """
    if torch.is_grad_enabled() and latents.requires_grad:  # the same latents on every rank
        raise RuntimeError(
            "decode_temporal_parallel is inference-only: the decoded frames carry no gradient "
            "back to latents that require grad; call it under torch.no_grad() (or pass "
            "latents.detach()), or decode on one rank to differentiate"
        )
    overlap = int_at_least(overlap, "overlap", 0, "latent frames")
    if frames_per_latent is not None:
        frames_per_latent = int_at_least(frames_per_latent, "frames_per_latent", 1, "output frames")
    time_dim = int_at_least(time_dim, "time_dim", -latents.dim(), "a dimension of latents")
    if not -latents.dim() <= time_dim < latents.dim():
        raise ValueError(f"time_dim {time_dim} is out of range for latents of {latents.dim()} dims")
    time_dim %= latents.dim()
    n = latents.shape[time_dim]
    if n == 0:
        raise ValueError("latents have no frames to decode")
    plan = plan_chunks(n, manager.world, overlap)
    if overlap == 0 and frames_per_latent is None and len(plan) > 1 and plan[1] is not None:
        raise ValueError(
            "overlap=0 splits a causal video VAE's frames without context: a chunk's first latent "
            "frame decodes to one frame, not frames_per_latent; use overlap >= 1 (exact: "
            "wan_decoder_overlap(vae)), or pass frames_per_latent for a decoder without that rule"
        )
    chunk = plan[manager.rank]
    mine, failure = None, None
    with torch.no_grad():
        try:
            if chunk is not None:
                mine = _decode_chunk(decode, latents, time_dim, chunk, frames_per_latent)
        except Exception as e:  # raised below, once the other ranks know not to wait
            failure = e
        shapes = exchange_shapes(mine, manager, device=latents.device, failed=failure is not None)
        if failure is not None:
            raise failure
        failed = [r for r, (_, shape) in enumerate(shapes) if shape is None]
        if failed:
            raise RuntimeError(f"decode_temporal_parallel: rank(s) {failed} failed to decode")
        if mine is None:
            dtype, shape = next(s for s in shapes if s[0] is not None)
            mine = torch.empty(
                *shape[:time_dim], 0, *shape[time_dim + 1 :], dtype=dtype, device=latents.device
            )
        return gather_sequence(mine, time_dim, manager)


def _decode_chunk(
    decode: Callable[[torch.Tensor], torch.Tensor],
    latents: torch.Tensor,
    time_dim: int,
    chunk: tuple[int, int, int],
    frames_per_latent: int | None,
) -> torch.Tensor:
    start, keep_from, stop = chunk
    out = decode(latents.narrow(time_dim, start, stop - start))
    if not isinstance(out, torch.Tensor) or out.dim() <= time_dim:
        raise TypeError(
            "decode must return a tensor with the frames along time_dim, got "
            f"{type(out).__name__} (for diffusers: decode=lambda z: vae.decode(z).sample)"
        )
    if start == 0:
        return out
    return _drop_leading(out, time_dim, stop - start, stop - keep_from, frames_per_latent)


def plan_chunks(n: int, world: int, overlap: int) -> list[tuple[int, int, int] | None]:
    """Per rank ``(start, keep_from, stop)``: decode latent frames ``[start, stop)`` and keep the
    output of ``[keep_from, stop)``; ``None`` for a rank with nothing to decode.

    Work (frames decoded, overlap included) is balanced: rank 0 keeps more frames because it
    decodes no overlap. Only ranks that can keep at least one frame get a chunk.
    """
    used = max(1, min(world, n - overlap))
    work = n + (used - 1) * overlap
    plan: list[tuple[int, int, int] | None] = []
    begin = 0
    for r in range(used):
        keep = work // used + (r < work % used) - (overlap if r else 0)
        plan.append((max(0, begin - overlap), begin, begin + keep))
        begin += keep
    return plan + [None] * (world - used)


def _drop_leading(
    out: torch.Tensor, time_dim: int, latent: int, kept: int, per: int | None
) -> torch.Tensor:
    """The output frames of the last ``kept`` of ``latent`` decoded latent frames."""
    frames = out.shape[time_dim]
    if per is None:
        per, rest = divmod(frames - 1, latent - 1)
        if rest or per < 1:
            raise ValueError(
                f"cannot tell output frames per latent frame: {latent} latent frames decoded to "
                f"{frames}; pass frames_per_latent"
            )
    if per * kept > frames:
        raise ValueError(
            f"{latent} latent frames decoded to {frames} frames, fewer than the "
            f"{per} x {kept} the kept frames need; check frames_per_latent"
        )
    return out.narrow(time_dim, frames - per * kept, per * kept)


def wan_decoder_overlap(vae: nn.Module) -> int:
    """The causal receptive field, in latent frames, of an ``AutoencoderKLWan``'s decoder: the
    smallest ``overlap`` for which :func:`decode_temporal_parallel` equals the full decode.

    Each causal temporal convolution reaches ``kernel_t - 1`` frames back at its own rate;
    the rate doubles after each temporal upsampler (whose own time convolution runs at its
    input rate). Convolutions at the latent rate count whole frames; the fractional reach of
    the faster ones is summed and rounded up.
    """
    decoder = getattr(vae, "decoder", vae)
    parts = ("conv_in", "mid_block", "up_blocks", "conv_out")
    if not all(hasattr(decoder, p) for p in parts):
        raise TypeError(
            f"{type(vae).__name__} is not a Wan VAE (or its decoder): it lacks one of {parts}"
        )
    latent, fast, rate = 0, 0.0, 1

    def add(module: nn.Module) -> None:
        nonlocal latent, fast
        for conv in module.modules():
            if isinstance(conv, nn.Conv3d):
                reach = (conv.kernel_size[0] - 1) * conv.dilation[0]
                if rate == 1:
                    latent += reach
                else:
                    fast += reach / rate

    add(decoder.conv_in)
    add(decoder.mid_block)
    for block in decoder.up_blocks:
        add(block.resnets)
        upsamplers = getattr(block, "upsamplers", None)
        up = getattr(block, "upsampler", None) or (upsamplers[0] if upsamplers else None)
        if up is not None and getattr(up, "mode", None) == "upsample3d":
            add(up.time_conv)
            rate *= 2
    add(decoder.conv_out)
    return latent + math.ceil(fast)
