"""``spore plugins`` and ``spore plugins check``: which plugins load, and what each registered."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import click

from spore import childproc
from spore.cli.render import JSON_OPTION, Column, console, echo_json, emit, print_table, styled
from spore.discovery import CORE_PLUGIN
from spore.plugins import PluginError, get_manager

PROBE_TIMEOUT_S = 300


_PROBE = childproc.python("-m", "spore._probe")


def _probe(env: dict[str, str] | None = None) -> dict[str, Any]:
    return childproc.run_json(_PROBE, timeout=PROBE_TIMEOUT_S, env=env)


def probe_plugins() -> tuple[list[dict[str, Any]], list[str]]:
    """Load the plugins in a child process; their status, and the notes loading logged about
    the selection (see spore._probe). When loading ends that process, each plugin is loaded
    alone to find the ones that do: they are listed ``failed``, the others as they load."""
    try:
        data = _probe()
    except childproc.ChildError as exc:
        if exc.timed_out:
            raise click.ClickException(
                f"loading the plugins took more than {PROBE_TIMEOUT_S}s; run `spore plugins "
                f"check` to see which one hangs"
            ) from exc
        data = _probe_without_crashes(exc)
    if "error" in data:  # spore's main() prints it and exits 2, as for any plugin error
        cause = f"\n  caused by: {data['cause']}" if data.get("cause") else ""
        raise PluginError(f"{data['error']}{cause}")
    return data["plugins"], data.get("notes", [])


def _probe_without_crashes(crash: childproc.ChildError) -> dict[str, Any]:
    """The probe's status with each plugin that ends the interpreter (or hangs) when loaded
    alone, each in a probe of its own run at once, left out of the loading and reported
    ``failed``; ``crash`` is the first probe's error."""
    import time

    from spore.discovery import Selection, discover_entry_points

    selection = Selection.from_env(os.environ)
    names = [i.name for i in discover_entry_points(selection) if i.status is None]
    crashed: dict[str, str] = {}
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    with contextlib.ExitStack() as running:  # each killed if still running when this ends
        children = [
            (name, running.enter_context(childproc.start_json(_PROBE, env=_alone(name))))
            for name in names
        ]
        for name, child in children:
            try:  # a second at least: one that hung must not make the others' late
                child.result(max(1.0, deadline - time.monotonic()))
            except childproc.ChildError as exc:
                crashed[name] = _how_it_ended(exc)
    if not crashed:  # only plugins together end it
        raise click.ClickException(
            f"the plugin probe printed no status (the plugins loaded together crash the "
            f"interpreter; each loads alone): {crash}"
        ) from crash
    env = dict(os.environ)
    if selection.allow is not None:
        env["SPORE_PLUGINS"] = ",".join(sorted(selection.allow - crashed.keys()))
    else:
        env["SPORE_DISABLE_PLUGINS"] = ",".join(sorted(selection.deny | crashed.keys()))
    try:
        data = _probe(env)
    except childproc.ChildError as exc:  # the others crash together
        raise click.ClickException(
            f"the plugin probe printed no status, also without "
            f"{', '.join(sorted(crashed))} (each of which ends it alone): {exc}"
        ) from exc
    for row in data.get("plugins", []):
        if row["name"] in crashed:
            row["status"], row["reason"] = "failed", crashed[row["name"]]
    return data


def _alone(name: str) -> dict[str, str]:
    """This process's environment, with only plugin ``name`` selected."""
    return {**os.environ, "SPORE_PLUGINS": name}


def _how_it_ended(exc: childproc.ChildError) -> str:
    """A plugin's reason from the error of the probe that loaded it alone."""
    if exc.timed_out:
        return f"loading it took more than {PROBE_TIMEOUT_S}s"
    code = exc.returncode
    how = (
        f"was killed by signal {-code}"
        if code is not None and code < 0
        else f"exited with status {code}"
    )
    last = exc.stderr.strip().splitlines()[-1:] or ["nothing on stderr"]
    return f"the interpreter {how} while importing it: {last[0]}"


def _registered(row: dict[str, Any]) -> str:
    registered = row.get("registered", {})
    return ", ".join(f"{k}: {len(v)}" for k, v in registered.items() if v) or "-"


COLUMNS = [
    Column("name", lambda r: r["name"], "name"),
    Column("distribution", lambda r: r["distribution"], "name"),
    Column("version", lambda r: r["version"], "name"),
    Column("status", lambda r: styled(r["status"] or "-"), "name"),
    Column("registered", _registered),
    Column("reason", lambda r: r.get("reason") or "", "note"),
]


@click.group("plugins", invoke_without_command=True)
@JSON_OPTION
@click.option("--all", "show_all", is_flag=True, help="Include spore-core's built-in plugin.")
@click.pass_context
def plugins_cmd(ctx: click.Context, as_json: bool, show_all: bool) -> None:
    """List installed plugins: status, reason and what each registered.

    The plugins are loaded in a child process; this process imports none of them.
    """
    if ctx.invoked_subcommand is not None:
        return
    plugins, notes = probe_plugins()
    rows = [r for r in plugins if show_all or not r["builtin"]]
    for note in notes:  # stderr, so --json's stdout stays JSON
        click.echo(f"Note: {note}", err=True)
    emit(
        rows,
        as_json=as_json,
        title="spore plugins",
        columns=COLUMNS,
        empty="No spore plugins installed (see docs/writing-a-plugin.md).",
    )


@plugins_cmd.command("check")
@click.argument("names", nargs=-1)
@JSON_OPTION
@click.pass_context
def plugins_check(ctx: click.Context, names: tuple[str, ...], as_json: bool) -> None:
    """Load plugins here and exit non-zero unless each is active.

    With NAMES: those plugins must be installed and active. Without: every installed plugin
    that is not disabled must be active.
    """
    from spore.plugins import name_hint, normalize

    as_json = as_json or ctx.parent.params["as_json"]  # `spore plugins --json check` too
    manager = get_manager()
    wanted = [normalize(n) for n in names]
    try:
        manager.add_commands(ctx.find_root().command)
        rows = [i.to_dict() for i in manager.plugins(include_builtin=CORE_PLUGIN in wanted)]
    except PluginError as exc:  # strict mode: a plugin that is not active, so exit 1 too
        cause = f" (cause: {exc.__cause__!r})" if exc.__cause__ else ""
        raise click.ClickException(f"{exc}{cause}") from exc
    known = {r["name"] for r in rows}
    problems = []
    for name in wanted:
        if name not in known:
            hint = name_hint(name, manager.plugins(include_builtin=True))
            problems.append(f"{name}: not installed" + (f" ({hint})" if hint else ""))
    for row in rows:
        required = row["name"] in wanted if wanted else row["status"] != "disabled"
        if required and row["status"] != "active":
            problems.append(f"{row['name']}: {row['status']} ({row['reason']})")
    if as_json:
        echo_json({"ok": not problems, "problems": problems, "plugins": rows})
    else:
        if rows:
            print_table("spore plugins check", COLUMNS, rows)
        from rich.text import Text

        for line in problems:
            console(stderr=True).print(Text.assemble(("not active", "red"), f" {line}"))
        if not problems:
            click.echo("All required plugins are active.")
    if problems:
        sys.exit(1)
