"""``spore bench lite-boost``: the registered cases, and a sparse case run once at a tiny size."""

from __future__ import annotations

from typing import Any

import pytest

from lite_boost import benchmarks
from spore import bench


def test_the_registered_cases(spore_manager: Any) -> None:
    registry = spore_manager({"SPORE_PLUGINS": "lite-boost,kernels"}).registry("benchmarks")
    names = set(registry.names(owner="lite-boost"))
    assert {f"sparse-{s}-{d}" for s in (0, 50, 75) for d in ("fp32", "bf16")} <= names
    assert {"rope-fp32", "rope-bf16", "wan-step-0", "wan-step-75"} <= names


@pytest.mark.parametrize("sparsity", [0.0, 0.75])
def test_a_sparse_case_reports_time_and_cosine(monkeypatch: pytest.MonkeyPatch, sparsity) -> None:
    monkeypatch.setattr(benchmarks, "SAMPLE_S", 0.001)
    monkeypatch.setattr(benchmarks, "LATENT", (2, 8, 8))
    monkeypatch.setattr(benchmarks, "BLOCK", 16)
    result = bench.run(benchmarks._sparse_case(sparsity, "fp32"), "lite-boost", repeat=1)
    assert result.error is None, result.error
    assert result.ratio > 0
    assert result.extras["baseline"]["cosine"] == pytest.approx(1.0)
    cosine = result.extras["candidate"]["cosine"]
    assert cosine == pytest.approx(1.0) if sparsity == 0 else 0.9 < cosine < 1.0


def test_the_rope_case_matches_the_complex_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(benchmarks, "SAMPLE_S", 0.001)
    monkeypatch.setattr(benchmarks, "ROPE_GRID", (2, 3, 4))
    result = bench.run(benchmarks._rope_case("fp32"), "lite-boost", repeat=1)
    assert result.error is None, result.error
    assert result.extras["candidate"]["cosine"] == pytest.approx(1.0, abs=1e-6)


def test_the_wan_step_case_runs_boosted_and_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(benchmarks, "SAMPLE_S", 0.001)
    monkeypatch.setattr(benchmarks, "WAN_LATENT", (2, 8, 8))
    monkeypatch.setattr(benchmarks, "BLOCK", 8)
    config = {**benchmarks.WAN_CONFIG, "num_layers": 1, "ffn_dim": 32, "attention_head_dim": 8}
    monkeypatch.setattr(benchmarks, "WAN_CONFIG", config)
    result = bench.run(benchmarks._wan_case(0.5), "lite-boost", repeat=1)
    assert result.error is None, result.error
    assert 0.9 < result.extras["candidate"]["cosine"] < 1.0
