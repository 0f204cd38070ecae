"""The ``spore`` command line. Plugins add subcommands through ``spore_add_commands``."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import click

from spore._version import __version__
from spore.plugins import PluginError, get_manager

STATUS_STYLE = {
    "active": "green",
    "ok": "green",
    "info": "cyan",
    "disabled": "dim",
    "warn": "yellow",
    "incompatible": "yellow",
    "failed": "red",
    "error": "red",
}
PROBE_TIMEOUT_S = 300


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


def _styled(status: str) -> str:
    style = STATUS_STYLE.get(status, "")
    return f"[{style}]{status}[/{style}]" if style else status


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False))


def _emit_rows(
    rows: list[dict[str, Any]],
    *,
    as_json: bool,
    empty: str,
    title: str,
    columns: list[tuple[str, Callable[[dict[str, Any]], str]]],
) -> None:
    """Print a listing: JSON for machines, else a rich table (or ``empty`` when no rows)."""
    if as_json:
        _echo_json(rows)
        return
    if not rows:
        click.echo(empty)
        return
    from rich.table import Table

    table = Table(title=title)
    for header, _ in columns:
        table.add_column(header, overflow="fold")
    for row in rows:
        table.add_row(*(cell(row) for _, cell in columns))
    _console().print(table)


class SporeGroup(click.Group):
    """Loads plugin subcommands only when a command is not a built-in one (or for --help)."""

    def _with_plugins(self) -> None:
        get_manager().add_commands(self)

    def list_commands(self, ctx: click.Context) -> list[str]:
        self._with_plugins()
        return super().list_commands(ctx)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands:
            self._with_plugins()
        return super().get_command(ctx, cmd_name)


def _dist_version(name: str) -> str:
    import importlib.metadata as metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _print_version(verbose: bool) -> None:
    click.echo(f"spore-core {__version__}")
    if not verbose:
        return
    click.echo(f"python {platform.python_version()} ({sys.executable})")
    click.echo(f"platform {platform.platform()}")
    for dist in ("torch", "pluggy", "mindspore"):
        click.echo(f"{dist} {_dist_version(dist)}")
    infos = get_manager().discover()
    click.echo(f"plugins ({len(infos)} found, not imported):")
    for info in infos:
        state = info.status.value if info.status else "selected"
        click.echo(f"  {info.name} {info.distribution} {info.version} [{state}]")


@click.group(cls=SporeGroup, invoke_without_command=True)
@click.option("--version", "show_version", is_flag=True, help="Print the version and exit.")
@click.option("--verbose", is_flag=True, help="With --version: python, torch and plugin versions.")
@click.pass_context
def cli(ctx: click.Context, show_version: bool, verbose: bool) -> None:
    """Spore: PyTorch accelerations as plugins.

    Plugin selection: SPORE_NO_PLUGINS=1 > SPORE_PLUGINS=a,b (allow-list) >
    SPORE_DISABLE_PLUGINS=a,b (deny-list); SPORE_STRICT_PLUGINS=1 makes plugin failures fatal.
    """
    if show_version:
        _print_version(verbose)
        ctx.exit(0)
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())


# plugins -------------------------------------------------------------------------------------
def _probe_plugins() -> list[dict[str, Any]]:
    """Load the plugins in a child process and return their status (see spore._probe)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "spore._probe"],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise click.ClickException(
            f"loading the plugins took more than {PROBE_TIMEOUT_S}s; run `spore plugins check` "
            f"to see which one hangs"
        ) from exc
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise click.ClickException(
            f"the plugin probe exited with code {proc.returncode} and printed no status "
            f"(a plugin may crash the interpreter on import):\n{proc.stderr.strip()[-2000:]}"
        )
    data = json.loads(lines[-1])
    if "error" in data:
        raise click.ClickException(f"{data['error']} (cause: {data['cause']})")
    return data["plugins"]


def _registered_summary(registered: dict[str, list[str]]) -> str:
    return ", ".join(f"{k}: {len(v)}" for k, v in registered.items() if v) or "-"


def _plugin_table(rows: list[dict[str, Any]], title: str) -> Any:
    from rich.table import Table

    table = Table(title=title)
    for column in ("name", "distribution", "version", "status", "registered", "reason"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(
            row["name"],
            row["distribution"],
            row["version"],
            _styled(row["status"] or "-"),
            _registered_summary(row.get("registered", {})),
            row.get("reason") or "",
        )
    return table


@cli.group("plugins", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--all", "show_all", is_flag=True, help="Include spore-core's built-in plugin.")
@click.pass_context
def plugins_cmd(ctx: click.Context, as_json: bool, show_all: bool) -> None:
    """List installed plugins: status, reason and what each registered.

    The plugins are loaded in a child process; this process imports none of them.
    """
    if ctx.invoked_subcommand is not None:
        return
    rows = [r for r in _probe_plugins() if show_all or not r["builtin"]]
    if as_json:
        _echo_json(rows)
        return
    if not rows:
        click.echo("No spore plugins installed (see docs/writing-a-plugin.md).")
        return
    _console().print(_plugin_table(rows, "spore plugins"))


@plugins_cmd.command("check")
@click.argument("names", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plugins_check(names: tuple[str, ...], as_json: bool) -> None:
    """Load plugins here and exit non-zero unless each is active.

    With NAMES: those plugins must be installed and active. Without: every installed plugin
    that is not disabled must be active.
    """
    from spore.plugins import normalize

    manager = get_manager()
    try:
        manager.add_commands(cli)
        rows = [i.to_dict() for i in manager.plugins()]
    except PluginError as exc:
        cause = f" (cause: {exc.__cause__!r})" if exc.__cause__ else ""
        raise click.ClickException(f"{exc}{cause}") from exc
    wanted = [normalize(n) for n in names]
    known = {r["name"] for r in rows}
    problems = [f"{n}: not installed" for n in wanted if n not in known]
    for row in rows:
        required = row["name"] in wanted if wanted else row["status"] != "disabled"
        if required and row["status"] != "active":
            problems.append(f"{row['name']}: {row['status']} ({row['reason']})")
    if as_json:
        _echo_json({"ok": not problems, "problems": problems, "plugins": rows})
    else:
        if rows:
            _console().print(_plugin_table(rows, "spore plugins check"))
        for line in problems:
            _console(stderr=True).print(f"[red]not active[/red] {line}")
        if not problems:
            click.echo("All required plugins are active.")
    if problems:
        sys.exit(1)


# ops -----------------------------------------------------------------------------------------
@cli.command("ops")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def ops_cmd(as_json: bool) -> None:
    """List the ops plugins defined and the kernels per device, in the order they are tried.

    Which kernel runs is decided per call by each kernel's supports() predicate; in Python,
    spore.dispatch.explain(op, *args) says which would run for given arguments and why.
    """
    registry = get_manager().registry("ops")
    rows = []
    for entry in registry.entries():
        if not hasattr(entry.value, "candidates"):
            continue
        op = entry.value
        devices = sorted({device for device, _ in op.kernels})
        rows.append(
            {
                "op": f"spore::{op.name}",
                "schema": op.schema,
                "defined_by": entry.owner,
                "kernels": {
                    device: [
                        {"provider": k.provider, "priority": k.priority}
                        for k in op.candidates(device)
                    ]
                    for device in devices
                },
            }
        )
    _emit_rows(
        rows,
        as_json=as_json,
        empty="No spore ops defined (plugins define them through spore_register_ops).",
        title="spore ops (kernels in the order tried; else the reference)",
        columns=[
            ("op", lambda r: r["op"]),
            ("schema", lambda r: r["schema"]),
            ("defined by", lambda r: r["defined_by"]),
            ("kernels", _kernels_cell),
        ],
    )


def _kernels_cell(row: dict[str, Any]) -> str:
    cells = [
        f"{device}: " + ", ".join(f"{k['provider']} ({k['priority']})" for k in kernels)
        for device, kernels in row["kernels"].items()
    ]
    return "; ".join(cells) or "reference only"


# passes --------------------------------------------------------------------------------------
@cli.command("passes")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def passes_cmd(as_json: bool) -> None:
    """List the graph passes registered through Spore: stage, priority, device, owner."""
    registry = get_manager().registry("passes")
    rows = [
        {
            "name": e.name,
            "stage": e.value.stage,
            "priority": e.value.priority,
            "device": e.value.device,
            "version": e.value.version,
            "registered_by": e.owner,
        }
        for e in sorted(registry.entries(), key=lambda e: (e.value.stage, -e.value.priority))
    ]
    _emit_rows(
        rows,
        as_json=as_json,
        empty="No graph passes registered (see docs/core/passes.md).",
        title="spore passes (per stage, in the order they run)",
        columns=[
            ("stage", lambda r: r["stage"]),
            ("name", lambda r: r["name"]),
            ("priority", lambda r: str(r["priority"])),
            ("device", lambda r: r["device"] or "any"),
            ("version", lambda r: r["version"]),
            ("registered by", lambda r: r["registered_by"]),
        ],
    )


# backends ------------------------------------------------------------------------------------
@cli.command("backends")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def backends_cmd(as_json: bool) -> None:
    """List the torch.compile backends registered through Spore, and by whom."""
    registry = get_manager().registry("backends")
    rows = [
        {
            "name": e.name,
            "registered_by": e.owner,
            "fallback": e.value.fallback,
            "description": e.value.description,
        }
        for e in registry.entries()
    ]
    _emit_rows(
        rows,
        as_json=as_json,
        empty="No backends registered through Spore (torch's own: torch._dynamo.list_backends()).",
        title="spore backends (torch.compile(model, backend=NAME))",
        columns=[
            ("name", lambda r: r["name"]),
            ("registered by", lambda r: r["registered_by"]),
            ("fallback to eager", lambda r: str(r["fallback"])),
            ("description", lambda r: r["description"]),
        ],
    )


# doctor --------------------------------------------------------------------------------------
@cli.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--quick", is_flag=True, help="Skip checks that measure (the allocator penalty).")
def doctor_cmd(as_json: bool, quick: bool) -> None:
    """Check the environment: python, torch build, devices, compilers, allocator, plugins.

    Measures the fresh-allocation penalty and what `spore run` would gain here (a few seconds;
    --quick skips it). Exits 1 when any check reports an error.
    """
    from rich.table import Table

    from spore import doctor

    report = doctor.run(get_manager(), quick=quick)
    if as_json:
        _echo_json(report.to_dict())
    else:
        table = Table(title="spore doctor")
        for column in ("from", "check", "status", "detail", "fix"):
            table.add_column(column, overflow="fold")
        for c in report.checks:
            table.add_row(c.source, c.name, _styled(c.status), c.detail, c.fix or "")
        _console().print(table)
    if report.worst == "error":
        sys.exit(1)


# run -----------------------------------------------------------------------------------------
def _runtime_options(allocator_help: str) -> Any:
    """The ``--allocator`` and ``--threads`` options shared by ``run`` and ``bench``."""
    from spore.runtime import ALLOCATORS

    allocator = click.option(
        "--allocator",
        type=click.Choice(ALLOCATORS),
        default="auto",
        show_default=True,
        help=allocator_help,
    )
    threads = click.option(
        "--threads", type=click.IntRange(min=1), help="Threads (default: usable cores)."
    )
    return lambda command: allocator(threads(command))


def _plan(allocator: str, threads: int | None) -> Any:
    from spore.runtime import RuntimeConfigError, cpu_plan

    try:
        return cpu_plan(allocator=allocator, threads=threads)
    except RuntimeConfigError as exc:
        raise click.UsageError(str(exc)) from exc


def _report_plan(plan: Any, prefix: str) -> None:
    lines = plan.describe() or ["nothing to change"]
    click.echo(
        f"{prefix}: allocator {plan.allocator}, {plan.threads} threads; " + "; ".join(lines),
        err=True,
    )


@cli.command(
    "run",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@_runtime_options("auto: tcmalloc if installed, else tuned glibc malloc; system: change nothing.")
@click.option("-q", "--quiet", is_flag=True, help="Do not report the settings on stderr.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run_cmd(allocator: str, threads: int | None, quiet: bool, command: tuple[str, ...]) -> None:
    """Run COMMAND under tuned CPU allocator and thread settings: spore run -- CMD ARGS...

    Settings are environment variables set before COMMAND starts; variables you already set
    are kept (and reported). The tuned allocators keep freed memory for reuse: resident memory
    stays higher. Use --allocator system to change nothing.
    """
    import os

    plan = _plan(allocator, threads)
    if not quiet:
        _report_plan(plan, "spore run")
    try:
        os.execvpe(command[0], list(command), plan.env)
    except OSError as exc:
        raise click.ClickException(f"cannot run {command[0]!r}: {exc.strerror}") from exc


# bench ---------------------------------------------------------------------------------------
def _format_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


@cli.command("bench")
@click.argument("plugins", nargs=-1)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--repeat", default=5, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--min-time",
    default=0.05,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Seconds each timed sample lasts at least (calls are looped to reach it).",
)
@click.option("-k", "--filter", "pattern", default="", help="Only cases whose name contains this.")
@click.option("--list", "list_only", is_flag=True, help="List the cases without running them.")
@_runtime_options("Allocator settings both sides run under (bench re-starts itself with them).")
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

    Both sides run in this process, interleaved; the figure is the median over --repeat of
    baseline time / candidate time (above 1: the candidate is faster).
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
            {"name": e.name, "plugin": e.owner, "baseline": e.value.baseline_label} for e in cases
        ]
        if as_json:
            _echo_json(rows)
        else:
            for row in rows:
                click.echo(f"{row['plugin']}:{row['name']} (vs {row['baseline']})")
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
        _echo_json({"settings": settings, "results": [r.to_dict() for r in results]})
    else:
        _print_results(results, settings)
    if any(r.error for r in results):
        sys.exit(1)


def _restart_tuned(ctx: click.Context, allocator: str, threads: int | None) -> None:
    """Re-start this command under the runtime plan unless a plan is already applied.

    Only possible when started through :func:`main`, which records the arguments.
    """
    import os

    from spore.runtime import APPLIED_MARKER

    argv = (ctx.find_root().obj or {}).get("argv")
    if argv is None or APPLIED_MARKER in os.environ:
        return
    plan = _plan(allocator, threads)
    _report_plan(plan, "spore bench")
    os.execve(sys.executable, [sys.executable, "-m", "spore", *argv], plan.env)


def _run_cases(cases: list[Any], repeat: int, min_time: float, progress: bool) -> list[Any]:
    from rich.progress import Progress

    from spore import bench

    results = []
    with Progress(console=_console(stderr=True), disable=not progress, transient=True) as bar:
        task = bar.add_task("benchmarks", total=len(cases))
        for entry in cases:
            bar.update(task, description=f"{entry.owner}:{entry.name}")
            results.append(bench.run(entry.value, entry.owner, repeat=repeat, min_time=min_time))
            bar.advance(task)
    return results


def _extras(extras: dict[str, dict[str, float]]) -> str:
    base, cand = extras.get("baseline", {}), extras.get("candidate", {})
    return ", ".join(f"{k} {base[k]:.4g} -> {cand[k]:.4g}" for k in base if k in cand)


def _print_results(results: list[Any], settings: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="spore bench (speed-up = baseline time / candidate time, median)")
    columns = ("plugin", "case", "baseline", "baseline time", "candidate time", "speed-up", "notes")
    for column in columns:
        table.add_column(column, overflow="fold")
    for r in results:
        if r.error:
            speedup = f"[red]error[/red] {r.error}"
        else:
            speedup = f"{r.ratio:.2f}x ({r.ratio_min:.2f}-{r.ratio_max:.2f})"
        table.add_row(
            r.owner,
            r.name,
            r.baseline_label,
            _format_time(None if r.error else r.baseline_s),
            _format_time(None if r.error else r.candidate_s),
            speedup,
            _extras(r.extras),
        )
    console = _console()
    console.print(table)
    env = ", ".join(f"{k}={v}" for k, v in settings["environment"].items()) or "none"
    console.print(
        f"settings (both sides): allocator {settings['allocator']}, torch threads "
        f"{settings['torch_threads']}, {settings['usable_cores']} usable cores, "
        f"runtime environment: {env}"
    )


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point; plugin errors become one clear message and exit code 2."""
    args = sys.argv[1:] if argv is None else argv
    try:
        cli.main(args=args, prog_name="spore", obj={"argv": args})
    except PluginError as exc:
        cause = f"\n  caused by: {exc.__cause__!r}" if exc.__cause__ else ""
        click.echo(f"Error: {exc}{cause}", err=True)
        sys.exit(2)
