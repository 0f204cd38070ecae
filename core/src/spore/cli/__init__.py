"""The ``spore`` command line: one module per command family, one renderer (``render``).

Plugins add subcommands through ``spore_add_commands``.
"""

from __future__ import annotations

import platform
import sys

import click

from spore._version import __version__
from spore.cli.bench import bench_cmd
from spore.cli.doctor import doctor_cmd
from spore.cli.listings import backends_cmd, ops_cmd, passes_cmd
from spore.cli.plugins import plugins_cmd
from spore.cli.run import run_cmd
from spore.plugins import PluginError, get_manager


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

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        """As click's; an unknown command's error names the plugins that did not load (one
        of them may provide it: ``spore train`` with hyperparallel disabled)."""
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            if args and args[0] not in self.commands:
                idle = [i for i in get_manager().plugins() if i.status != "active"]
                if idle:
                    listed = "; ".join(f"{i.name} ({i.status}: {i.reason})" for i in idle)
                    exc.message += f" Plugins not loaded, which may provide it: {listed}."
            raise


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


for _command in (plugins_cmd, ops_cmd, passes_cmd, backends_cmd, doctor_cmd, run_cmd, bench_cmd):
    cli.add_command(_command)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point; plugin errors become one clear message and exit code 2."""
    args = sys.argv[1:] if argv is None else argv
    try:
        cli.main(args=args, prog_name="spore", obj={"argv": args})
    except PluginError as exc:
        cause = f"\n  caused by: {exc.__cause__!r}" if exc.__cause__ else ""
        click.echo(f"Error: {exc}{cause}", err=True)
        sys.exit(2)


__all__ = ["SporeGroup", "cli", "main"]
