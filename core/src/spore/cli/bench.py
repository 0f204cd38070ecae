"""``spore bench``: the plugins' benchmark cases, each against its baseline."""

from __future__ import annotations

import math
import os
import sys
from typing import TYPE_CHECKING, Any

import click

from spore import childproc
from spore.bench import MAX_MIN_TIME
from spore.cli.render import JSON_OPTION, Column, console, echo_json, print_table, styled
from spore.cli.run import plan, report_plan, runtime_options
from spore.plugins import get_manager

if TYPE_CHECKING:
    from rich.text import Text


def format_time(seconds: float | None) -> str:
    """``seconds`` with three significant digits in s, ms, us or ns; ``-`` for none."""
    if seconds is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def _finite(param: click.Parameter, value: float) -> float:
    """``value`` unless NaN (which passes ``FloatRange``'s bounds)."""
    if math.isnan(value):
        raise click.BadParameter(f"{value} is not a number of seconds", param=param)
    return value


@click.command("bench")
@click.argument("plugins", nargs=-1)
@JSON_OPTION
@click.option(
    "--repeat",
    default=5,
    show_default=True,
    type=click.IntRange(min=1),
    help="Timed samples of each side, interleaved; the figure is the median of their ratios.",
)
@click.option(
    "--min-time",
    default=0.05,
    show_default=True,
    type=click.FloatRange(min=0, max=MAX_MIN_TIME),
    callback=lambda ctx, param, value: _finite(param, value),
    help=(
        "Seconds each timed sample lasts at least (calls are looped to reach it). Self-timed "
        "cases (marked in --list) time themselves, one call a sample, and ignore it."
    ),
)
@click.option("-k", "--filter", "pattern", default="", help="Only cases whose name contains this.")
@click.option("--list", "list_only", is_flag=True, help="List the cases without running them.")
@runtime_options("Allocator settings both sides run under (bench re-starts itself with them).")
@click.pass_context
def bench_cmd(
    ctx: click.Context,
    plugins: tuple[str, ...],
    as_json: bool,
    repeat: int,
    min_time: float,
    pattern: str,
    list_only: bool,
    allocator: str,
    threads: int | None,
) -> None:
    """Run benchmark cases registered by PLUGINS (default: all), each against its baseline.

    Both sides are called from this process, interleaved (a case whose sides run in child
    processes, such as a process-group start, times them there); the figure is the
    median over --repeat of baseline time / candidate time (above 1: the candidate is faster).

    `spore bench PLUGIN --list` lists a plugin's cases and their baselines without running
    them (`core` names the core's own cases); -k TEXT runs the ones whose name contains TEXT.
    """
    from spore import bench

    if not list_only:
        _restart_tuned(ctx, allocator, threads)
    manager = get_manager()
    manager.request(plugins)
    registry = manager.registry("benchmarks")
    wanted = {p.lower().replace("_", "-") for p in plugins}
    cases = [
        e for e in registry.entries() if (not wanted or e.owner in wanted) and pattern in e.name
    ]
    cases.sort(key=lambda e: (e.owner, e.name))
    if list_only:
        rows = [
            {
                "name": e.name,
                "plugin": e.owner,
                "baseline": e.value.baseline_label,
                "self_timed": e.value.self_timed,
            }
            for e in cases
        ]
        if as_json:
            echo_json(rows)
        else:
            for row in rows:
                timed = "; self-timed" if row["self_timed"] else ""
                click.echo(f"{row['plugin']}:{row['name']} (vs {row['baseline']}{timed})")
        return
    if not cases:
        raise click.ClickException(
            "no benchmark cases match"
            + (f" plugins {', '.join(plugins)}" if plugins else "")
            + (f" and filter {pattern!r}" if pattern else "")
            + "; `spore bench --list` shows what is registered"
        )
    results = _run_cases(cases, repeat, min_time, progress=not as_json)
    settings = bench.settings()
    if as_json:
        echo_json({"settings": settings, "results": [r.to_dict() for r in results]})
    else:
        _print_results(results, settings)
    if any(r.error for r in results):
        sys.exit(1)


def _restart_tuned(ctx: click.Context, allocator: str, threads: int | None) -> None:
    """Re-start this command under the runtime plan unless a plan is already applied (then
    ``--allocator`` / ``--threads`` given otherwise than it are a usage error).

    Only possible when started through :func:`spore.cli.main`, which records the arguments.
    """
    from spore.runtime import APPLIED_MARKER

    applied = os.environ.get(APPLIED_MARKER)
    if applied is not None:
        _check_applied(ctx, applied, allocator, threads)
        return
    argv = (ctx.find_root().obj or {}).get("argv")
    if argv is None:
        return
    runtime_plan = plan(allocator, threads)
    report_plan(runtime_plan, "spore bench")
    ctx.close()  # undo --json's redirection of stdout: the new process inherits fd 1
    os.execve(sys.executable, childproc.python("-m", "spore", *argv), runtime_plan.env)


def _check_applied(ctx: click.Context, applied: str, allocator: str, threads: int | None) -> None:
    """A usage error when the options given ask for other settings than the applied plan's."""
    source = click.core.ParameterSource.DEFAULT
    asked = []
    if ctx.get_parameter_source("allocator") != source and allocator not in ("auto", applied):
        asked.append(f"--allocator {allocator}")
    if threads is not None and str(threads) != os.environ.get("OMP_NUM_THREADS"):
        asked.append(f"--threads {threads}")
    if asked:
        raise click.UsageError(
            f"{' '.join(asked)} would not apply: this process already runs under allocator "
            f"{applied} with OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} "
            f"(SPORE_RUNTIME is set, e.g. inside `spore run`); run spore bench outside it"
        )


def _run_cases(cases: list[Any], repeat: int, min_time: float, progress: bool) -> list[Any]:
    from rich.progress import Progress

    from spore import bench

    results = []
    with Progress(console=console(stderr=True), disable=not progress, transient=True) as bar:
        task = bar.add_task("benchmarks", total=len(cases))
        for entry in cases:
            bar.update(task, description=f"{entry.owner}:{entry.name}")
            results.append(bench.run(entry.value, entry.owner, repeat=repeat, min_time=min_time))
            bar.advance(task)
    return results


def _extras(extras: dict[str, dict[str, float]]) -> str:
    """Each figure as ``baseline -> candidate``; one only a side reports, with that side's name."""
    base, cand = extras.get("baseline", {}), extras.get("candidate", {})
    both = [f"{k} {base[k]:.4g} -> {cand[k]:.4g}" for k in base if k in cand]
    alone = [f"{k} {v:.4g} (baseline)" for k, v in base.items() if k not in cand]
    alone += [f"{k} {v:.4g} (candidate)" for k, v in cand.items() if k not in base]
    return ", ".join(both + alone)


def _speedup(r: Any) -> str | Text:
    if r.error:
        return styled("error", f" {r.error}")
    return f"{r.ratio:.2f}x ({r.ratio_min:.2f}-{r.ratio_max:.2f})"


COLUMNS = [
    Column("plugin", lambda r: r.owner, "name"),
    Column("case", lambda r: r.name, "name"),
    Column("baseline time", lambda r: format_time(None if r.error else r.baseline_s), "name"),
    Column("candidate time", lambda r: format_time(None if r.error else r.candidate_s), "name"),
    Column("speed-up", _speedup),
    Column("baseline", lambda r: r.baseline_label, "note"),
    Column("notes", lambda r: _extras(r.extras), "note"),
]


def _print_results(results: list[Any], settings: dict[str, Any]) -> None:
    out = console()
    title = "spore bench (speed-up = baseline time / candidate time, median)"
    print_table(title, COLUMNS, results, label="case")
    env = ", ".join(f"{k}={v}" for k, v in settings["environment"].items()) or "none"
    out.print(
        f"settings (both sides): allocator {settings['allocator']}, torch threads "
        f"{settings['torch_threads']}, {settings['usable_cores']} usable cores, "
        f"runtime environment: {env}"
    )
