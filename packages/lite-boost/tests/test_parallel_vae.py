"""VAE temporal-slice data parallel on 2 real gloo ranks vs diffusers' full
``AutoencoderKLWan.decode`` (tiny config, random weights, CPU).

One 2-rank run (``parallel_worker.py vae``) computes every case. With the overlap that
``wan_decoder_overlap`` computes the result is bit-identical to the full decode; one frame
less is not, which shows the overlap is both sufficient and tight.
"""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def ranks(launch_ranks):
    return launch_ranks("vae")


def _same(case):
    return case["shape"] == case["want_shape"] and case["equal"]


def test_overlap_of_the_receptive_field_equals_the_full_decode(ranks):
    for rank in ranks:
        assert rank["reach"] == 28  # this tiny decoder: 10 convs x 2 + ceil(5 x 1 + 5 x 0.5)
        assert _same(rank["exact"]), rank["exact"]
        assert rank["exact"]["max_diff"] == 0.0


def test_one_frame_less_overlap_differs(ranks):
    for rank in ranks:
        short, small = rank["one_short"], rank["small_overlap"]
        assert short["shape"] == short["want_shape"]
        assert not short["equal"]
        assert short["max_diff"] > 0
        assert small["max_diff"] > short["max_diff"]


@pytest.mark.parametrize("case", ["fewer_chunks", "one_frame"])
def test_fewer_chunks_than_ranks_do_not_hang(ranks, case):
    for rank in ranks:
        assert _same(rank[case]), rank[case]


def test_no_overlap_is_refused_for_a_causal_vae_and_fine_per_frame(ranks):
    for rank in ranks:
        assert rank["no_overlap"].startswith("ValueError: overlap=0 splits a causal video VAE")
        assert rank["per_frame"] == [True, True]


def test_numpy_and_tensor_integers_are_taken_as_frame_counts_and_dims(ranks):
    """overlap, frames_per_latent and time_dim refused numpy and 0-d tensor integers, which
    every other lite-boost size takes (a ValueError "must be an int", got np.int64(1))."""
    for rank in ranks:
        assert rank["numpy_ints"] is True, rank["numpy_ints"]


def test_bf16_is_kept_and_exact(ranks):
    for rank in ranks:
        assert rank["bf16"]["dtype"] == "torch.bfloat16"
        assert _same(rank["bf16"]), rank["bf16"]


def test_bad_input_and_a_failing_rank_raise_on_every_rank(ranks):
    for rank in ranks:
        assert rank["bad_overlap"].startswith("ValueError: overlap must be an int >= 0")
        for error in rank["bad_frames_per_latent"]:  # 2.5 and True were taken
            assert error.startswith("ValueError: frames_per_latent must be an int >= 1"), error
        assert rank["bad_decode"].startswith("TypeError: decode must return a tensor")
        assert rank["bad_time_dim"].startswith("ValueError: time_dim must be an int")
        assert rank["needs_grad"].startswith(
            "RuntimeError: decode_temporal_parallel is inference-only"
        )
        assert rank["needs_grad_off"] is None
    assert (
        ranks[0]["one_rank_fails"]
        == "RuntimeError: decode_temporal_parallel: rank(s) [1] failed to decode"
    )
    assert ranks[1]["one_rank_fails"] == "ValueError: rank 1's decode failed"
