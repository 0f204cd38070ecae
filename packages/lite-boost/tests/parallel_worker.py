"""One gloo rank of a lite_boost.parallel test: ``python parallel_worker.py SCENARIO RANK WORLD
PORT TIMEOUT``. Every rank computes the single-process oracle itself and prints one JSON line
with what it measured; the tests assert on those figures.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lite_boost import backends
from lite_boost.parallel import (
    ParallelManager,
    decode_temporal_parallel,
    gather_sequence,
    shard_sequence,
    ulysses_attention,
    wan_decoder_overlap,
)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def _error(fn) -> str | None:
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _reference(q, k, v):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(q, k, v)


def _ulysses_case(m, cuts, heads=4, kv_heads=4, batch=2, dim=8, grad=False, dtype=torch.float32):
    """Shards of one random sequence cut at ``cuts`` (one length per rank) vs the full SDPA."""
    g = torch.Generator().manual_seed(sum(cuts) * 31 + heads * 7 + kv_heads)
    total = sum(cuts)
    q, k, v = (
        torch.randn(batch, h, total, dim, generator=g).to(dtype)
        for h in (heads, kv_heads, kv_heads)
    )
    lo = sum(cuts[: m.rank])
    local = [t[:, :, lo : lo + cuts[m.rank]].clone().requires_grad_(grad) for t in (q, k, v)]
    full = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    out = ulysses_attention(backends.attention, *local, manager=m)
    want = _reference(*full)
    result = {
        "dtype": str(out.dtype),
        "shape": list(out.shape),
        "want_shape": list(want[:, :, lo : lo + cuts[m.rank]].shape),
        "max_diff": _max_diff(out, want[:, :, lo : lo + cuts[m.rank]]),
    }
    if grad:
        weight = torch.randn(want.shape, generator=g)
        (out * weight[:, :, lo : lo + cuts[m.rank]]).sum().backward()
        (want * weight).sum().backward()
        mine = slice(lo, lo + cuts[m.rank])
        pairs = zip(local, full, strict=True)
        result["grad_diff"] = max(_max_diff(a.grad, b.grad[:, :, mine]) for a, b in pairs)
    return result


def ulysses(m: ParallelManager) -> dict:
    r = m.rank
    x = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    mismatch = torch.zeros(2, 3 + r)
    return {
        "even": _ulysses_case(m, [8, 8]),
        "uneven": _ulysses_case(m, [7, 4]),
        "empty_shard": _ulysses_case(m, [5, 0]),
        "gqa": _ulysses_case(m, [6, 9], heads=4, kv_heads=2),
        "bf16": _ulysses_case(m, [6, 5], dtype=torch.bfloat16),
        "grad": _ulysses_case(m, [5, 3], grad=True),
        "heads_error": _error(lambda: _ulysses_case(m, [4, 4], heads=3, kv_heads=3)),
        "kv_heads_error": _error(lambda: _ulysses_case(m, [4, 4], heads=4, kv_heads=1)),
        "no_manager": _error(
            lambda: ulysses_attention(
                backends.attention, x[None, None], x[None, None], x[None, None], manager=None
            )
        ),
        "shard": shard_sequence(x, 0, m).tolist(),
        "round_trip": gather_sequence(shard_sequence(x, -2, m), 0, m).equal(x),
        "gather_uneven": gather_sequence(x[: 3 if r == 0 else 0], 0, m).tolist(),
        "gather_mismatch": _error(lambda: gather_sequence(mismatch, 0, m)),
        "one_rank_refuses": _error(
            lambda: ulysses_attention(
                backends.attention, *[torch.randn(1, 2 + r, 4, 8)] * 3, manager=m
            )
        ),
        "ulysses_mismatch": {
            what: _error(lambda t=t: ulysses_attention(backends.attention, t, t, t, manager=m))
            for what, t in (
                ("head_dim", torch.randn(1, 2, 4, 8 + 8 * r)),
                ("q heads", torch.randn(1, 2 + 2 * r, 4, 8)),
                ("batch", torch.randn(1 + r, 2, 4, 8)),
                ("dtype", torch.randn(1, 2, 4, 8, dtype=(torch.float32, torch.float16)[r])),
            )
        },
    }


def _tiny_vae(dtype=torch.float32):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[True, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )
    return vae.eval().to(dtype)


def _vae_cases(m, vae, frames, overlaps, batch=1, dtype=torch.float32):
    """decode_temporal_parallel at each overlap vs one full decode of the same latents."""
    g = torch.Generator().manual_seed(frames * 13 + batch)
    latents = torch.randn(batch, 4, frames, 2, 2, generator=g).to(dtype)
    with torch.no_grad():
        want = vae.decode(latents).sample
    results = []
    for overlap in overlaps:
        got = decode_temporal_parallel(
            lambda z: vae.decode(z).sample, latents, manager=m, overlap=overlap
        )
        same_shape = got.shape == want.shape
        results.append(
            {
                "shape": list(got.shape),
                "want_shape": list(want.shape),
                "dtype": str(got.dtype),
                "equal": same_shape and bool(torch.equal(got, want)),
                "max_diff": _max_diff(got, want) if same_shape else None,
            }
        )
    return results


def _per_frame(m, overlap, frames_per_latent=2, time_dim=2):
    """A decoder without temporal context (each latent frame -> 2 frames) given
    frames_per_latent: equal to decoding everything at once."""
    latents = torch.randn(1, 3, 5, 2, generator=torch.Generator().manual_seed(3))
    decode = lambda z: z.repeat_interleave(2, dim=2) * 2  # noqa: E731
    got = decode_temporal_parallel(
        decode,
        latents,
        manager=m,
        overlap=overlap,
        frames_per_latent=frames_per_latent,
        time_dim=time_dim,
    )
    return bool(torch.equal(got, decode(latents)))


def _numpy_ints(m):
    """:func:`_per_frame` with numpy and 0-d tensor integers: its result, or the error."""
    try:
        return _per_frame(m, np.int64(1), torch.tensor(2), np.int64(2))
    except ValueError as e:
        return f"ValueError: {e}"


def _fail_on_rank_1(m, model, z):
    if m.rank == 1:
        raise ValueError("rank 1's decode failed")
    return model.decode(z).sample


def vae(m: ParallelManager) -> dict:
    model = _tiny_vae()
    reach = wan_decoder_overlap(model)
    frames = reach + 4  # rank 1 keeps 2 frames and decodes from frame 2: a real overlap
    exact, one_short, small = _vae_cases(m, model, frames, [reach, reach - 1, 2])
    (bf16,) = _vae_cases(m, _tiny_vae(torch.bfloat16), frames, [reach], dtype=torch.bfloat16)
    return {
        "reach": reach,
        "exact": exact,
        "one_short": one_short,
        "small_overlap": small,
        "fewer_chunks": _vae_cases(m, model, 3, [reach], batch=2)[0],
        "one_frame": _vae_cases(m, model, 1, [reach])[0],
        "no_overlap": _error(lambda: _vae_cases(m, model, 4, [0])),
        "per_frame": [_per_frame(m, overlap) for overlap in (0, 1)],
        "numpy_ints": _numpy_ints(m),
        "bad_time_dim": _error(
            lambda: decode_temporal_parallel(
                lambda z: z, torch.zeros(1, 3), manager=m, overlap=1, time_dim=1.0
            )
        ),
        "bf16": bf16,
        "bad_overlap": _error(
            lambda: decode_temporal_parallel(lambda z: z, torch.zeros(1, 3), manager=m, overlap=-1)
        ),
        "bad_frames_per_latent": [
            _error(
                lambda f=f: decode_temporal_parallel(
                    lambda z: z, torch.zeros(1, 3), manager=m, overlap=1, frames_per_latent=f
                )
            )
            for f in (2.5, True, 0)
        ],
        "one_rank_fails": _error(
            lambda: decode_temporal_parallel(
                lambda z: _fail_on_rank_1(m, model, z),
                torch.zeros(1, 4, 4, 2, 2),
                manager=m,
                overlap=1,
            )
        ),
        "bad_decode": _error(
            lambda: decode_temporal_parallel(
                lambda z: model.decode(z), torch.zeros(1, 4, 4, 2, 2), manager=m, overlap=1
            )
        ),
        "needs_grad": _error(
            lambda: decode_temporal_parallel(
                lambda z: model.decode(z).sample,
                torch.zeros(1, 4, 4, 2, 2, requires_grad=True),
                manager=m,
                overlap=1,
            )
        ),
        "needs_grad_off": _error(
            lambda: torch.no_grad()(decode_temporal_parallel)(
                lambda z: model.decode(z).sample,
                torch.zeros(1, 4, 4, 2, 2, requires_grad=True),
                manager=m,
                overlap=1,
            )
        ),
    }


def main() -> None:
    faulthandler.enable()  # an abort in gloo's C++ prints where Python was
    scenario, rank, world, port = sys.argv[1], *map(int, sys.argv[2:5])
    timeout = datetime.timedelta(seconds=float(sys.argv[5]))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timeout
    )
    torch.set_num_threads(1)
    try:
        result = {"ulysses": ulysses, "vae": vae}[scenario](ParallelManager())
    finally:
        dist.destroy_process_group()
    print(json.dumps(result), flush=True)
    # No interpreter teardown: about 1 run in 30 under load, a rank aborted with "terminate
    # called without an active exception" (a C++ thread still joinable when destroyed). Where it
    # aborted is not known; if it was the teardown this avoids it, else faulthandler shows where.
    os._exit(0)


if __name__ == "__main__":
    main()
