from __future__ import annotations

import math
import time
from fractions import Fraction
from types import SimpleNamespace

import pytest

from spore import bench
from spore.bench import Benchmark


def _sleeper(seconds: float):
    return lambda _state: time.sleep(seconds)


def test_ratio_direction_and_fields() -> None:
    case = Benchmark("sleep", _sleeper(0.01), _sleeper(0.001), baseline_label="sleep 10 ms")
    result = bench.run(case, "tests", repeat=3, min_time=0.01)
    assert result.error is None
    assert result.ratio > 2
    assert result.ratio_min <= result.ratio <= result.ratio_max
    assert result.baseline_s > result.candidate_s > 0
    assert result.to_dict()["loops"]["candidate"] >= 1


def test_setup_state_is_shared_and_check_runs_first() -> None:
    seen = []

    def check(base, cand):
        seen.append((base, cand))

    case = Benchmark(
        "state",
        baseline=lambda s: s["x"] + 1,
        candidate=lambda s: s["x"] + 1,
        baseline_label="same",
        setup=lambda: {"x": 41},
        check=check,
    )
    result = bench.run(case, "tests", repeat=1, min_time=0)
    assert seen == [(42, 42)]
    assert result.error is None


def test_a_failing_check_is_reported_not_timed() -> None:
    def check(base, cand):
        raise AssertionError(f"outputs differ: {base} != {cand}")

    case = Benchmark("bad", lambda s: 1, lambda s: 2, baseline_label="one", check=check)
    result = bench.run(case, "tests", repeat=2, min_time=0)
    assert result.error == "AssertionError: outputs differ: 1 != 2"
    assert result.to_dict()["ratio"] is None


def test_invalid_cases_and_arguments() -> None:
    with pytest.raises(TypeError, match="candidate must be callable"):
        Benchmark("x", lambda s: None, "nope", baseline_label="b")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="baseline_label must name"):
        Benchmark("x", lambda s: None, lambda s: None, baseline_label=" ")
    case = Benchmark("x", lambda s: None, lambda s: None, baseline_label="b")
    with pytest.raises(ValueError, match="repeat must be >= 1"):
        bench.run(case, "tests", repeat=0)


@pytest.mark.parametrize("min_time", [math.nan, math.inf, -0.5, 3600.5, 10**400])
def test_run_refuses_a_min_time_that_is_no_number_of_seconds(min_time: float) -> None:
    """NaN passed ``min_time < 0`` and, like infinity, failed every case with a bare
    "cannot convert float NaN to integer" in ``Result.error``; ``spore bench`` refused them."""
    case = Benchmark("x", lambda s: None, lambda s: None, baseline_label="b")
    with pytest.raises(ValueError, match=r"min_time must be a number of seconds from 0 to 3600"):
        bench.run(case, "tests", min_time=min_time)
    with pytest.raises(TypeError, match="min_time must be a number of seconds, got str '1'"):
        bench.run(case, "tests", min_time="1")  # type: ignore[arg-type]
    assert bench.run(case, "tests", repeat=1, min_time=0).error is None
    assert bench.run(case, "tests", repeat=1, min_time=Fraction(1, 1000)).error is None  # any Real


def test_run_refuses_a_repeat_that_is_no_count() -> None:
    """``repeat=2.5`` failed the case inside ``range`` (in ``Result.error``) and ``True`` timed
    it once: the arguments are checked as ``min_time`` is."""
    case = Benchmark("x", lambda s: None, lambda s: None, baseline_label="b")
    for not_an_int in (2.5, True, "2", None):
        kind = type(not_an_int).__name__
        with pytest.raises(TypeError, match=f"repeat must be an int, got {kind}"):
            bench.run(case, "tests", repeat=not_an_int, min_time=0)  # type: ignore[arg-type]
    for too_few in (0, -3):
        with pytest.raises(ValueError, match=f"repeat must be >= 1, got {too_few}"):
            bench.run(case, "tests", repeat=too_few, min_time=0)
    assert bench.run(case, "tests", repeat=2, min_time=0).error is None


def test_self_timed_samples_with_changing_keys_are_that_case_s_error() -> None:
    """A self-timed side whose samples reported different extras raised KeyError out of
    run(), ending a whole `spore bench` run."""
    samples = iter([{"seconds": 1.0, "peak_mib": 3.0}, {"seconds": 1.0}])
    case = Benchmark(
        "drift",
        lambda s: next(samples),
        lambda s: {"seconds": 0.5},
        baseline_label="b",
        self_timed=True,
    )
    result = bench.run(case, "tests", repeat=2)
    assert result.error == (
        "ValueError: self-timed baseline returned the keys ['seconds'] after ['peak_mib', "
        "'seconds']: every sample must report the same ones"
    )


@pytest.mark.parametrize("seconds", [None, "0.1", True])
def test_a_self_timed_sample_without_a_number_of_seconds_is_that_case_s_error(seconds) -> None:
    case = Benchmark(
        "odd",
        lambda s: {"seconds": seconds},
        lambda s: {"seconds": 0.5},
        baseline_label="b",
        self_timed=True,
    )
    result = bench.run(case, "tests", repeat=1)
    assert result.error.startswith("TypeError: self-timed baseline must return a dict with a")


def test_the_benchmark_registry_takes_only_benchmarks() -> None:
    from spore.registry import BenchmarkRegistry

    registry = BenchmarkRegistry("benchmark")
    with pytest.raises(TypeError, match=r"register a spore.bench.Benchmark, got SimpleNamespace"):
        registry.add(SimpleNamespace(name="fake"))
    assert "fake" not in registry


def test_bench_help_describes_repeat_and_says_how_to_list_a_plugin_s_cases() -> None:
    """`--repeat` had no description, and `spore bench PLUGIN --help` (the generic help) no
    word of `--list`, which lists a plugin's cases."""
    from click.testing import CliRunner

    from spore.cli.bench import bench_cmd

    result = CliRunner(env={"COLUMNS": "200"}).invoke(bench_cmd, ["kernels", "--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "`spore bench PLUGIN --list` lists a plugin's cases and their baselines" in text
    assert "--repeat INTEGER RANGE Timed samples of each side, interleaved" in text
