"""lite_boost.parallel pieces that need no process group: the chunk plan of the VAE temporal
split, the Wan decoder's receptive field, sequence split sizes, ParallelManager's checks."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from lite_boost.parallel import ParallelManager, wan_decoder_overlap
from lite_boost.parallel.sequence import split_sizes
from lite_boost.parallel.vae import plan_chunks


@given(n=st.integers(1, 80), world=st.integers(1, 8), overlap=st.integers(0, 40))
def test_chunk_plan_covers_every_frame_once_with_balanced_work(n, world, overlap):
    plan = plan_chunks(n, world, overlap)
    assert len(plan) == world
    used = [c for c in plan if c is not None]
    assert plan[len(used) :] == [None] * (world - len(used))  # idle ranks are the last ones
    assert len(used) == max(1, min(world, n - overlap))
    begin = 0
    for start, keep_from, stop in used:
        assert keep_from == begin
        assert stop > keep_from  # every working rank keeps at least one frame
        assert start == max(0, keep_from - overlap)
        assert start == 0 or keep_from - start == overlap  # full context or the first chunk
        begin = stop
    assert begin == n
    work = [stop - start for start, _, stop in used]
    assert max(work) - min(work) <= 1


@given(n=st.integers(0, 50), world=st.integers(1, 8))
def test_split_sizes(n, world):
    sizes = split_sizes(n, world)
    assert sum(sizes) == n
    assert sizes == sorted(sizes, reverse=True)
    assert max(sizes) - min(sizes) <= 1


def test_wan_2_1_and_2_2_decoders_reach_38_latent_frames():
    diffusers = pytest.importorskip("diffusers")
    # 12 convs at the latent rate x 2 frames + ceil(7 x 2/2 + 13 x 2/4): conv_in, the mid
    # block's 4, 3 resnets x 2 and a time conv; then 3 x 2 + 1; then 6 + 6 + conv_out
    wan21 = diffusers.AutoencoderKLWan(base_dim=8, z_dim=4)
    wan22 = diffusers.AutoencoderKLWan(
        base_dim=8, z_dim=4, is_residual=True, patch_size=2, in_channels=12, out_channels=12
    )
    assert wan_decoder_overlap(wan21) == 38
    assert wan_decoder_overlap(wan22.decoder) == 38


def test_overlap_of_a_module_that_is_not_a_wan_vae_is_a_type_error():
    import torch.nn as nn

    with pytest.raises(TypeError, match="not a Wan VAE"):
        wan_decoder_overlap(nn.Linear(2, 2))


def test_manager_needs_an_initialised_process_group(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ParallelManager()
