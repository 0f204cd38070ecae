"""``spore doctor``: check the environment, the plugins included."""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING

import click

from spore.cli.render import JSON_OPTION, Column, echo_json, print_table, styled
from spore.plugins import PluginError, get_manager

if TYPE_CHECKING:
    from spore.doctor import Report

COLUMNS = [
    Column("from", lambda c: c.source, "name"),
    Column("check", lambda c: c.name),
    Column("status", lambda c: styled(c.status), "name"),
    Column("detail", lambda c: c.detail),
    Column("fix", lambda c: c.fix or "", "note"),
]


@click.command("doctor")
@JSON_OPTION
@click.option("--quick", is_flag=True, help="Skip checks that measure (the allocator penalty).")
def doctor_cmd(as_json: bool, quick: bool) -> None:
    """Check the environment: python, torch build, devices, compilers, allocator, plugins.

    Measures the fresh-allocation penalty and what `spore run` would gain here (a few seconds;
    --quick skips it). Exits 1 when any check reports an error, or when a plugin asked for by
    name (or any, under SPORE_STRICT_PLUGINS=1) fails.
    """
    report = _report(quick)
    if as_json:
        echo_json(report.to_dict())
    else:
        print_table("spore doctor", COLUMNS, report.checks, label="check")
    if report.worst == "error":
        sys.exit(1)


def _report(quick: bool) -> Report:
    """Run the checks; a plugin error (strict mode, a plugin asked for by name) is an error in
    the report, which is printed and exits 1 as for a failed check, not 2 as other commands."""
    from spore import doctor

    manager = get_manager()
    root = click.get_current_context().find_root().command
    if isinstance(root, click.Group):  # a plugin failing to add its commands is not healthy
        # reported by doctor.run: the loading's error raised again, or the plugin failed
        with contextlib.suppress(PluginError):
            manager.add_commands(root)
    return doctor.run(manager, quick=quick)
