"""``spore bench sci-protenix``: the registered cases, each run once at a tiny size, its two
sides agreeing on the outputs and gradients (the case's own check, TOLERANCE relative)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sci_protenix import benchmarks
from spore import bench


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(benchmarks, "C_Z", 8)
    monkeypatch.setattr(benchmarks, "C_S", 24)
    monkeypatch.setattr(benchmarks, "TOKENS", (12,))
    monkeypatch.setattr(benchmarks, "CHUNK", 5)
    monkeypatch.setattr(benchmarks, "STEP", 8)


def test_the_registered_cases(spore_manager: Any) -> None:
    registry = spore_manager({"SPORE_PLUGINS": "sci-protenix,kernels"}).registry("benchmarks")
    names = set(registry.names(owner="sci-protenix"))
    expected = {f"train-{n}-{kind}" for n in (128, 256, 384) for kind in ("chunked", "recompute")}
    assert expected | {"max-tokens", "tri-att-128"} <= names


@pytest.mark.usefixtures("tiny")
def test_the_naive_block_is_the_block() -> None:
    block, s, z, mask = benchmarks.make_block(10)
    with torch.no_grad():
        naive = benchmarks.naive_block(block, s, z, mask)
        ours = block(s, z, mask)
    assert naive[1].sub(z).abs().max() > 0.1  # random weights: the updates are not zero
    for a, b in zip(naive, ours, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("tiny")
@pytest.mark.parametrize("recompute", [False, True])
def test_a_block_case_agrees_with_naive(recompute) -> None:
    result = bench.run(benchmarks._block_case(12, recompute), "sci-protenix", repeat=2)
    assert result.error is None, result.error
    base, cand = result.extras["baseline"], result.extras["candidate"]
    assert base["memory_ratio"] == 1.0
    assert 0 < cand["memory_ratio"] == pytest.approx(cand["peak_mib"] / base["peak_mib"])
    assert cand["max_rel_diff"] <= benchmarks.TOLERANCE


def test_the_check_rejects_different_outputs() -> None:
    with pytest.raises(AssertionError, match="differ from naive"):
        benchmarks._agree({}, {"max_rel_diff": 10 * benchmarks.TOLERANCE})


@pytest.mark.usefixtures("tiny")
def test_the_triangle_attention_case_agrees() -> None:
    result = bench.run(benchmarks._triangle_attention_case(12), "sci-protenix", repeat=1)
    assert result.error is None, result.error
    assert result.extras["candidate"]["max_rel_diff"] <= benchmarks.TOLERANCE


@pytest.mark.usefixtures("tiny")
def test_max_tokens_measures_both_within_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(benchmarks, "BUDGET", "3MiB")
    result = bench.run(benchmarks._max_tokens_case(), "sci-protenix", repeat=1)
    assert result.error is None, result.error
    naive, planned = result.extras["baseline"], result.extras["candidate"]
    assert naive["tokens"] >= 8
    assert planned["tokens"] >= naive["tokens"]
    for side in (naive, planned):
        assert side["peak_mib"] < 3
    # one STEP more does not fit naive (measured again here)
    limit = 3 * 2**20
    over = benchmarks._fits(
        int(naive["tokens"]) + 8, lambda b, i: benchmarks.naive_block(b, *i), limit
    )
    assert over["fits"] == 0.0
