"""Benchmark cases and the side-by-side runner behind ``spore bench``.

A case names its baseline (what a user would run otherwise). Both sides are called from this
process, interleaved (the order alternates each repeat), each sample long enough to time
reliably; a ``self_timed`` case's sides may run in child processes and time themselves
there (a process-group start). The figure is the median over repeats of ``baseline_time /
candidate_time`` (> 1 means faster).
"""

from __future__ import annotations

import math
import numbers
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spore.runtime import allocator_in_use, runtime_environment, usable_cores

MAX_LOOPS = 1_000_000
MAX_MIN_TIME = 3600.0
"""The longest ``min_time`` (seconds a timed sample lasts at least) :func:`run` takes."""


@dataclass(frozen=True)
class Benchmark:
    """One comparison: ``candidate(state)`` against ``baseline(state)``.

    ``setup()`` builds the shared inputs once (default ``None``); ``check(base_out,
    cand_out)`` raises if the two sides disagree and runs before any timing.

    ``self_timed=True`` is for sides that time themselves (e.g. in a child process): each call
    returns a dict with ``"seconds"`` per iteration plus any other numeric figures (reported as
    medians in ``Result.extras``); there is no warm-up call or loop calibration.
    """

    name: str
    baseline: Callable[[Any], Any]
    candidate: Callable[[Any], Any]
    baseline_label: str
    candidate_label: str = "spore"
    setup: Callable[[], Any] | None = None
    check: Callable[[Any, Any], None] | None = None
    description: str = ""
    self_timed: bool = False

    def __post_init__(self) -> None:
        for attr in ("baseline", "candidate"):
            if not callable(getattr(self, attr)):
                raise TypeError(f"Benchmark {self.name!r}: {attr} must be callable")
        if not self.baseline_label.strip():
            raise ValueError(
                f"Benchmark {self.name!r}: baseline_label must name what it is compared with "
                f"(e.g. 'torch eager')"
            )


@dataclass
class Result:
    """The measured figures of one case (times are per call, in seconds)."""

    name: str
    owner: str
    baseline_label: str
    candidate_label: str
    repeats: int
    baseline_s: float = math.nan
    candidate_s: float = math.nan
    ratio: float = math.nan
    ratio_min: float = math.nan
    ratio_max: float = math.nan
    loops: tuple[int, int] = (0, 0)
    extras: dict[str, dict[str, float]] = field(default_factory=dict)
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["loops"] = {"baseline": self.loops[0], "candidate": self.loops[1]}
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


def _sync() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed(fn: Callable[[Any], Any], state: Any, loops: int) -> float:
    _sync()
    start = time.perf_counter()
    for _ in range(loops):
        fn(state)
    _sync()
    return (time.perf_counter() - start) / loops


def _loops_for(fn: Callable[[Any], Any], state: Any, min_time: float) -> int:
    once = _timed(fn, state, 1)
    return max(1, min(MAX_LOOPS, math.ceil(min_time / max(once, 1e-9))))


def run(bench: Benchmark, owner: str, *, repeat: int = 5, min_time: float = 0.05) -> Result:
    """Measure one case; the case's errors are captured in ``Result.error`` rather than
    raised. ``repeat`` below 1, or a ``min_time`` that is not 0 to :data:`MAX_MIN_TIME`
    seconds, is a ``ValueError`` (a value of the wrong type: ``TypeError``)."""
    repeat = _checked_repeat(repeat)
    min_time = _checked_min_time(min_time)
    result = Result(bench.name, owner, bench.baseline_label, bench.candidate_label, repeat)
    if bench.self_timed:
        return _run_self_timed(bench, result)
    try:
        state = bench.setup() if bench.setup is not None else None
        base_out, cand_out = bench.baseline(state), bench.candidate(state)
        if bench.check is not None:
            bench.check(base_out, cand_out)
        del base_out, cand_out
        loops = (
            _loops_for(bench.baseline, state, min_time),
            _loops_for(bench.candidate, state, min_time),
        )
        base_t: list[float] = []
        cand_t: list[float] = []
        for r in range(repeat):
            if r % 2 == 0:
                base_t.append(_timed(bench.baseline, state, loops[0]))
                cand_t.append(_timed(bench.candidate, state, loops[1]))
            else:
                cand_t.append(_timed(bench.candidate, state, loops[1]))
                base_t.append(_timed(bench.baseline, state, loops[0]))
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.loops = loops
    return _summarise(result, base_t, cand_t)


def _checked_repeat(repeat: int) -> int:
    """``repeat`` as an int, refused unless it is an integer (numpy's included, not a bool) of
    at least 1 (a float failed the case inside ``range``, and ``True`` timed it once)."""
    if isinstance(repeat, bool) or not isinstance(repeat, numbers.Integral):
        raise TypeError(f"repeat must be an int, got {type(repeat).__name__} {repeat!r}")
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    return int(repeat)


def _checked_min_time(min_time: float) -> float:
    """``min_time`` as a float, refused unless it is a real number of seconds (numpy's
    included, not a bool) from 0 to :data:`MAX_MIN_TIME` (NaN and infinity failed every case)."""
    if isinstance(min_time, bool) or not isinstance(min_time, numbers.Real):
        raise TypeError(
            f"min_time must be a number of seconds, got {type(min_time).__name__} {min_time!r}"
        )
    if not 0 <= min_time <= MAX_MIN_TIME:  # compared as is: float() overflows on a huge int
        raise ValueError(
            f"min_time must be a number of seconds from 0 to {MAX_MIN_TIME:g}, got {min_time}"
        )
    return float(min_time)


def _summarise(result: Result, base_t: list[float], cand_t: list[float]) -> Result:
    ratios = [b / max(c, 1e-12) for b, c in zip(base_t, cand_t, strict=True)]
    result.baseline_s = statistics.median(base_t)
    result.candidate_s = statistics.median(cand_t)
    result.ratio = statistics.median(ratios)
    result.ratio_min, result.ratio_max = min(ratios), max(ratios)
    return result


def _run_self_timed(bench: Benchmark, result: Result) -> Result:
    samples: dict[str, list[dict[str, float]]] = {"baseline": [], "candidate": []}
    try:
        state = bench.setup() if bench.setup is not None else None
        for r in range(result.repeats):
            order = ("baseline", "candidate") if r % 2 == 0 else ("candidate", "baseline")
            for side in order:
                sample = getattr(bench, side)(state)
                seconds = sample.get("seconds") if isinstance(sample, dict) else None
                if isinstance(seconds, bool) or not isinstance(seconds, int | float):
                    raise TypeError(
                        f"self-timed {side} must return a dict with a number 'seconds', got "
                        f"{sample!r}"
                    )
                samples[side].append(sample)
        if bench.check is not None:
            bench.check(samples["baseline"][0], samples["candidate"][0])
        for side, runs in samples.items():
            for sample in runs[1:]:
                if sample.keys() != runs[0].keys():
                    raise ValueError(
                        f"self-timed {side} returned the keys {sorted(sample)} after "
                        f"{sorted(runs[0])}: every sample must report the same ones"
                    )
        extras = {
            side: {k: statistics.median(s[k] for s in runs) for k in runs[0] if k != "seconds"}
            for side, runs in samples.items()
        }
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.loops = (1, 1)
    result.extras = extras
    return _summarise(
        result,
        [s["seconds"] for s in samples["baseline"]],
        [s["seconds"] for s in samples["candidate"]],
    )


def settings() -> dict[str, Any]:
    """The thread and allocator settings both sides ran under (printed with results)."""
    torch = sys.modules.get("torch")
    return {
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "usable_cores": len(usable_cores()),
        "allocator": allocator_in_use(),
        "environment": runtime_environment(),
    }
