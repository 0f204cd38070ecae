"""``spore ops``, ``spore passes`` and ``spore backends``: what the plugins registered."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import click

from spore.cli.render import JSON_OPTION, Column, emit
from spore.discovery import CORE_PLUGIN
from spore.plugins import get_manager

INTERRUPTED = 130
"""The status a shell reports for a process ended by Ctrl-C (128 + SIGINT)."""


def _kernels_cell(row: dict[str, Any]) -> str:
    cells = [
        f"{device}: " + ", ".join(f"{k['provider']} ({k['priority']})" for k in kernels)
        for device, kernels in row["kernels"].items()
    ]
    return "; ".join(cells) or "reference only"


@click.command("ops")
@JSON_OPTION
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
    emit(
        rows,
        as_json=as_json,
        empty="No spore ops defined (plugins define them through spore_register_ops).",
        title="spore ops (kernels in the order tried; else the reference)",
        columns=[
            Column("op", lambda r: r["op"], "name"),
            Column("defined by", lambda r: r["defined_by"], "name"),
            Column("kernels", _kernels_cell),
            Column("schema", lambda r: r["schema"], "note"),
        ],
    )


def _script_traceback(exc: BaseException) -> str:
    """``exc`` as ``python SCRIPT`` prints it: the traceback without the runner's leading
    frames (this module's and ``runpy``'s), so from the script's first frame on, or that of the
    code it holds (a ``.pyc``'s frames name its source, a zip's its ``__main__.py``); none at
    all for an error before the script ran, as a ``SyntaxError``, which names its line itself."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in (__name__, "runpy"):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _run_script(script: str, args: tuple[str, ...]) -> dict[str, int]:
    """Run ``script`` as ``__main__`` (its directory first on ``sys.path``, as ``python SCRIPT``
    does) with the passes enabled and Inductor's caches off (so every compile runs them); its
    stdout goes to stderr, and an exception it raises is printed there with its traceback;
    Ctrl-C ends the command with status 130. Returns the rewrites per pass it caused."""
    import contextlib
    import runpy

    from torch._inductor import config

    from spore import passes

    before = passes.totals()
    passes.enable()
    config.fx_graph_cache = False
    config.autotune_local_cache = False
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *args]
    path = os.path.abspath(script)  # its __file__ and frames, as under `python SCRIPT`
    sys.path.insert(0, os.path.dirname(path))
    try:
        with contextlib.redirect_stdout(sys.stderr):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            failed = click.ClickException(f"{script} exited with status {exc.code}")
            code = exc.code if isinstance(exc.code, int) and 0 < exc.code < 256 else 1
            failed.exit_code = code  # the script's own status, as under `python SCRIPT`
            raise failed from exc
    except (Exception, KeyboardInterrupt) as exc:
        click.echo(_script_traceback(exc), err=True, nl=False)
        if not isinstance(exc, KeyboardInterrupt):
            raise click.ClickException(f"{script} raised {type(exc).__name__}: {exc}") from exc
        interrupted = click.ClickException(f"{script} was interrupted (Ctrl-C)")
        interrupted.exit_code = INTERRUPTED  # as under `python SCRIPT` (and `spore run`)
        raise interrupted from exc
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
    after = passes.totals()
    return {name: after[name] - before.get(name, 0) for name in after}


class _ScriptCommand(click.Command):
    """A command whose arguments after ``--run SCRIPT`` are the script's own, spore's option
    names (``--json``, ``--help``) included."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        for i, arg in enumerate(args):
            if arg == "--run" and i + 1 < len(args):
                return super().parse_args(ctx, [*args[: i + 2], "--", *args[i + 2 :]])
            if arg.startswith("--run="):
                return super().parse_args(ctx, [*args[: i + 1], "--", *args[i + 1 :]])
            if arg == "--":
                break
        return super().parse_args(ctx, args)


def _run_order(entry: Any) -> tuple[int, int, str]:
    """Where a pass runs: its stage's place in a compile, then priority and name, as
    :func:`spore.graph_passes.run_passes` orders a stage."""
    from spore.graph_passes import STAGES

    return list(STAGES).index(entry.value.stage), -entry.value.priority, entry.name


@click.command("passes", cls=_ScriptCommand)
@JSON_OPTION
@click.option(
    "--run",
    "script",
    type=click.Path(exists=True, dir_okay=False),
    help="Run this Python script (the arguments after it are its own) with the passes enabled "
    "in every Inductor compile and the FX graph cache off, then list the rewrites per pass.",
)
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def passes_cmd(as_json: bool, script: str | None, script_args: tuple[str, ...]) -> None:
    """List the graph passes registered through Spore: stage, priority, device, owner.

    With --run SCRIPT, also the number of rewrites each pass made while SCRIPT ran; a script
    that exits with a status ends the command with that status, one interrupted by Ctrl-C
    with 130.
    """
    if script_args and script is None:
        raise click.UsageError(f"unexpected arguments {list(script_args)}: use --run SCRIPT ARGS")
    matches = _run_script(script, script_args) if script else None
    registry = get_manager().registry("passes")
    rows = [
        {
            "name": e.name,
            "stage": e.value.stage,
            "priority": e.value.priority,
            "device": e.value.device,
            "version": e.value.version,
            "registered_by": e.owner,
            **({} if matches is None else {"matches": matches.get(e.name, 0)}),
        }
        for e in sorted(registry.entries(), key=_run_order)
    ]
    columns = [
        Column("stage", lambda r: r["stage"], "name"),
        Column("name", lambda r: r["name"], "name"),
        Column("priority", lambda r: str(r["priority"])),
        Column("device", lambda r: r["device"] or "any"),
        Column("version", lambda r: r["version"]),
        Column("registered by", lambda r: r["registered_by"], "name"),
    ]
    if matches is not None:
        columns.append(Column("matches", lambda r: str(r["matches"])))
    emit(
        rows,
        as_json=as_json,
        empty="No graph passes registered (see docs/core/passes.md).",
        title="spore passes (per stage, in the order they run)",
        columns=columns,
    )


@click.command("backends")
@JSON_OPTION
def backends_cmd(as_json: bool) -> None:
    """List the torch.compile backends of spore-core and those registered through Spore.

    torch's own backends are listed by torch._dynamo.list_backends().
    """
    registry = get_manager().registry("backends")
    core = {
        "name": "spore",
        "registered_by": CORE_PLUGIN,
        "fallback": False,
        "description": "Inductor with the graph passes registered through Spore (spore passes)",
    }
    rows = [core] + [
        {
            "name": e.name,
            "registered_by": e.owner,
            "fallback": e.value.fallback,
            "description": e.value.description,
        }
        for e in registry.entries()
    ]
    emit(
        rows,
        as_json=as_json,
        empty="",
        title="spore backends (torch.compile(model, backend=NAME))",
        columns=[
            Column("name", lambda r: r["name"], "name"),
            Column("registered by", lambda r: r["registered_by"], "name"),
            Column("fallback to eager", lambda r: str(r["fallback"])),
            Column("description", lambda r: r["description"]),
        ],
    )
