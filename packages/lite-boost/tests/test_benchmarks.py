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
