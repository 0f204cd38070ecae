"""``spore bench mfusion``: the cases it registers, and one case run end to end at a small size."""

from __future__ import annotations

import math
from typing import Any

import pytest

from mfusion import benchmarks
from mfusion.benchmarks import BASELINES, BENCH_MODELS, DTYPES, PHASES, Size
from spore import bench

SMALL = Size(batch=2, seq=16, vocab=128, hidden=64, heads=4, ffn=128, layers=2, image=32, patch=8)


def test_every_model_phase_and_dtype_against_each_baseline(spore_manager: Any) -> None:
    registry = spore_manager({"SPORE_PLUGINS": "mfusion"}).registry("benchmarks")
    names = registry.names(owner="mfusion")
    assert len(names) == len(BENCH_MODELS) * len(PHASES) * len(DTYPES) * len(BASELINES)
    assert "llama-fwdbwd-bf16-vs-inductor" in names
    assert "bert-fwd-fp32-vs-eager" in names
    assert all(registry.get(n).self_timed for n in names)


def test_a_case_times_all_sides_and_reports_nodes_and_rewrites(
    spore_manager: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    spore_manager({"SPORE_PLUGINS": "mfusion"})  # no region compiler (dvm's) adds autofuse
    monkeypatch.setattr(benchmarks, "BENCH_SIZE", SMALL)
    monkeypatch.setattr(benchmarks, "SAMPLE_S", 0.01)
    benchmarks._state.cache_clear()
    cases = {c.name: c for c in benchmarks.benchmarks()}
    try:
        results = [
            bench.run(cases[f"llama-fwd-fp32-vs-{baseline}"], "mfusion", repeat=2)
            for baseline in ("eager", "inductor")
        ]
        assert benchmarks._state.cache_info().misses == 1, "both cases share one compile"
    finally:
        benchmarks._state.cache_clear()
    layers = SMALL.layers
    rewrites = {"add_rms_norm": 2 * layers, "rms_norm": 1, "rope": 2 * layers, "silu_mul": layers}
    for result in results:
        assert result.error is None
        assert (result.repeats, result.loops) == (2, (1, 1))
        figures = (result.baseline_s, result.candidate_s, result.ratio)
        assert all(math.isfinite(f) and f > 0 for f in figures), figures
        assert result.ratio_min <= result.ratio <= result.ratio_max
        base, fused = result.extras["baseline"], result.extras["candidate"]
        assert fused == {"nodes": fused["nodes"], **rewrites}  # README: Llama with MFUSION_CPU=all
        assert base == {"nodes": base["nodes"], **dict.fromkeys(rewrites, 0)}
        assert base["nodes"] > fused["nodes"] > 0
