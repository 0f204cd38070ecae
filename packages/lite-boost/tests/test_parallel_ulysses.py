"""Ulysses attention and sequence shard/gather on 2 real gloo ranks vs single-process SDPA.

One 2-rank run (``parallel_worker.py ulysses``) computes every case; each rank compares its own
output slice with plain SDPA over the whole sequence. Tolerance: fp32 atol 1e-6, bf16 1e-2 (the same
per-head SDPA runs either way, so the difference is 0 in practice).
"""

from __future__ import annotations

import pytest

ATOL = 1e-6
BF16_ATOL = 1e-2  # bf16 inputs, both sides bf16 SDPA


@pytest.fixture(scope="module")
def ranks(launch_ranks):
    return launch_ranks("ulysses")


@pytest.mark.parametrize("case", ["even", "uneven", "empty_shard", "gqa"])
def test_equals_sdpa_over_the_whole_sequence(ranks, case):
    for rank in ranks:
        got = rank[case]
        assert got["shape"] == got["want_shape"]
        assert got["max_diff"] <= ATOL


def test_bf16_is_kept_and_equals_sdpa(ranks):
    for rank in ranks:
        assert rank["bf16"]["dtype"] == "torch.bfloat16"
        assert rank["bf16"]["max_diff"] <= BF16_ATOL


def test_uneven_shards_keep_their_own_lengths(ranks):
    assert [r["uneven"]["shape"][2] for r in ranks] == [7, 4]
    assert [r["empty_shard"]["shape"][2] for r in ranks] == [5, 0]


def test_gradients_equal_single_process(ranks):
    for rank in ranks:
        assert rank["grad"]["max_diff"] <= ATOL
        assert rank["grad"]["grad_diff"] <= ATOL


def test_heads_not_divisible_by_world_name_both_numbers(ranks):
    for rank in ranks:
        assert rank["heads_error"].startswith("ValueError")
        assert "3 heads" in rank["heads_error"]
        assert "world size 2" in rank["heads_error"]
        assert "k/v has 1 heads" in rank["kv_heads_error"]
        assert rank["no_manager"].startswith("TypeError: ulysses_attention needs manager=")


def test_shard_and_gather_sequence(ranks):
    rows = [[3.0 * i, 3.0 * i + 1, 3.0 * i + 2] for i in range(7)]
    assert [r["shard"] for r in ranks] == [rows[:4], rows[4:]]
    assert all(r["round_trip"] for r in ranks)
    assert all(r["gather_uneven"] == rows[:3] for r in ranks)


def test_gather_mismatched_shapes_raise_on_every_rank(ranks):
    for rank in ranks:
        assert rank["gather_mismatch"].startswith("ValueError")
        assert "(2, 3)" in rank["gather_mismatch"]
        assert "(2, 4)" in rank["gather_mismatch"]


def test_ranks_disagreeing_on_more_than_the_length_raise_on_every_rank(ranks):
    """Only the lengths were exchanged: gloo then aborted the process (SIGABRT)."""
    for me, rank in enumerate(ranks):
        other = 1 - me
        for what, error in rank["ulysses_mismatch"].items():
            assert error.startswith("ValueError: Ulysses attention needs every rank's"), error
            assert f"rank {other}'s {what} differs" in error


def test_a_rank_refusing_its_inputs_is_an_error_on_every_rank(ranks):
    """Rank 1's 3 heads do not split over 2 ranks: it raised at once, while rank 0 waited in
    the length exchange until the process group's timeout."""
    assert "q has 3 heads" in ranks[1]["one_rank_refuses"]
    assert ranks[0]["one_rank_refuses"].startswith(
        "ValueError: Ulysses attention: rank 1 refused its q, k, v"
    )
