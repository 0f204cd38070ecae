"""``spore bench dvm``: the cases it registers, the shape option, and each kind of case run once
end to end at a tiny size."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dvm import benchmarks
from dvm.benchmarks import (
    CHAINS,
    DTYPES,
    LAYOUT_BASELINES,
    LAYOUTS,
    RUNTIME_BASELINES,
    TRAIN_BASELINES,
    LlamaSize,
)
from dvm.compile import compile_graph
from spore import bench

TINY_LLAMA = LlamaSize(batch=1, seq=8, vocab=64, hidden=32, heads=2, ffn=64, layers=1)


def test_the_registered_cases(spore_manager: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(benchmarks.SHAPE_ENV, raising=False)
    registry = spore_manager({"SPORE_PLUGINS": "dvm"}).registry("benchmarks")
    names = registry.names(owner="dvm")
    runtime = len(CHAINS) * len(DTYPES) * len(RUNTIME_BASELINES)
    runtime += len(LAYOUTS) * len(DTYPES) * len(LAYOUT_BASELINES)
    assert len(names) == len(CHAINS) + runtime + len(DTYPES) * len(TRAIN_BASELINES)
    rows, cols = benchmarks.DEFAULT_SHAPE
    assert f"softmax-bf16-{rows}x{cols}-vs-copy" in names
    assert f"silu_mul-mixed-bf16-{rows}x{cols}-vs-inductor" in names
    assert "compile-rms_norm" in names
    assert "llama-train-fp32-vs-inductor" in names
    assert registry.get("compile-silu").self_timed
    assert registry.get("llama-train-bf16-vs-eager").self_timed
    assert not registry.get(f"silu-fp32-{rows}x{cols}-vs-eager").self_timed


def test_the_shape_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(benchmarks.SHAPE_ENV, "8192x4096")
    assert benchmarks.bench_shape() == (8192, 4096)
    assert "gelu_tanh-fp32-8192x4096-vs-inductor" in {c.name for c in benchmarks.benchmarks()}
    for bad in ("8192", "0x4096", "8192x4096x2", "ax4"):
        monkeypatch.setenv(benchmarks.SHAPE_ENV, bad)
        with pytest.raises(ValueError, match=f"{benchmarks.SHAPE_ENV}=.*ROWSxCOLS"):
            benchmarks.bench_shape()


def test_crossover_of_cumulative_times() -> None:
    # compiles 10 s longer, steps 0.5 s shorter: even after 20 steps
    assert benchmarks.crossover((12.0, 1.0), (2.0, 1.5)) == pytest.approx(20.0)
    # compiles shorter and steps shorter, or longer and longer: the lines never meet
    assert benchmarks.crossover((1.0, 1.0), (2.0, 1.5)) == 0.0
    assert benchmarks.crossover((3.0, 2.0), (2.0, 1.5)) == 0.0
    # compiles 4 s shorter, steps 0.1 s longer: level after 40 steps
    assert benchmarks.crossover((1.0, 1.1), (5.0, 1.0)) == pytest.approx(40.0)


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(benchmarks, "SAMPLE_S", 0.001)
    monkeypatch.setattr(benchmarks, "FLOW_COMPILES", 2)
    monkeypatch.setattr(benchmarks, "LLAMA", TINY_LLAMA)


def test_a_compile_case_reports_regions_and_time_per_region(quick: None) -> None:
    (case,) = [c for c in benchmarks.compile_cases() if c.name == "compile-silu_mul"]
    result = bench.run(case, "dvm", repeat=1)
    assert result.error is None, result.error
    assert result.ratio > 0
    for side, seconds in (("baseline", result.baseline_s), ("candidate", result.candidate_s)):
        figures = result.extras[side]
        assert figures["regions"] == 1
        assert figures["us_per_region"] == pytest.approx(1e6 * seconds)
    # a region's own compile is part of the graph's
    own = result.extras["candidate"]["region_compile_us"]
    assert 0 < own < 1e6 * result.candidate_s
    assert "region_compile_us" not in result.extras["baseline"]


def test_runtime_cases_time_dvm_against_each_baseline(quick: None) -> None:
    benchmarks._runtime_state.cache_clear()
    cases = {c.name: c for c in benchmarks.runtime_cases((6, 40))}
    try:
        results = [
            bench.run(cases[f"rms_norm-bf16-6x40-vs-{b}"], "dvm", repeat=2, min_time=0.001)
            for b in RUNTIME_BASELINES
        ]
        assert benchmarks._runtime_state.cache_info().misses == 1, "the cases share one state"
    finally:
        benchmarks._runtime_state.cache_clear()
    for result in results:
        assert result.error is None, result.error
        assert result.ratio > 0
        assert result.candidate_s > 0
        assert result.baseline_s > 0


@pytest.mark.parametrize("chain", list(CHAINS))
def test_every_chain_runs_on_the_vm(chain: str) -> None:
    """The runtime state refuses a chain dvm would leave to eager (its figure would time aten);
    the softmax chain, one eager kernel that dvm's backend leaves whole, runs with min_ops=1;
    its compile case compiles the one region too."""
    benchmarks._runtime_state.cache_clear()
    try:
        state = benchmarks._runtime_state(chain, "fp32", (6, 40))
    finally:
        benchmarks._runtime_state.cache_clear()
    torch.testing.assert_close(state["dvm"](*state["args"]), CHAINS[chain].fn(*state["args"]))
    gm, inputs = benchmarks._aten_graph(chain)
    compiled = compile_graph(gm, inputs, min_ops=CHAINS[chain].min_ops)
    assert len(compiled.regions) == 1, compiled.fallbacks


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_cases_run_the_chain_on_strided_inputs(quick: None, layout: str) -> None:
    benchmarks._runtime_state.cache_clear()
    cases = {c.name: c for c in benchmarks.runtime_cases((6, 40))}
    try:
        result = bench.run(cases[f"silu_mul-{layout}-fp32-6x40-vs-eager"], "dvm", repeat=1)
        x = benchmarks._runtime_state("silu_mul", "fp32", (6, 40), layout)["args"][0]
    finally:
        benchmarks._runtime_state.cache_clear()
    assert result.error is None, result.error
    assert result.ratio > 0
    assert x.stride() == (1, 6)  # stored transposed, read through its strides


@pytest.mark.parametrize(
    "baseline",
    [
        pytest.param("eager"),
        pytest.param("inductor", marks=pytest.mark.slow),  # Inductor's Llama compile: minutes
    ],
)
def test_a_training_case_reports_compile_and_amortised_times(quick: None, baseline: str) -> None:
    benchmarks._trainer.cache_clear()
    (case,) = [c for c in benchmarks.train_cases() if c.name == f"llama-train-fp32-vs-{baseline}"]
    try:
        result = bench.run(case, "dvm", repeat=1)
    finally:
        benchmarks._trainer.cache_clear()
    assert result.error is None, result.error
    assert result.ratio > 0
    steps = benchmarks.AMORTISE_STEPS
    for side, seconds in (("baseline", result.baseline_s), ("candidate", result.candidate_s)):
        figures = result.extras[side]
        assert figures["compile_s"] >= 0
        total = figures[f"total_s_{steps}_steps"]
        assert total == pytest.approx(figures["compile_s"] + steps * seconds)
        assert figures["crossover_steps"] >= 0
    assert result.extras["candidate"]["compile_s"] > 0, "dvm compiles on its first step"
