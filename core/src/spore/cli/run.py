"""``spore run``: a command under tuned CPU allocator and thread settings."""

from __future__ import annotations

import os
import shutil
from typing import Any

import click


def runtime_options(allocator_help: str) -> Any:
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
        "--threads",
        type=click.IntRange(min=1),
        help="OMP and MKL threads, over yours (default: OMP_NUM_THREADS, else the cores).",
    )
    return lambda command: allocator(threads(command))


def plan(allocator: str, threads: int | None) -> Any:
    """The runtime plan for these options; a bad combination is a usage error."""
    from spore.runtime import RuntimeConfigError, cpu_plan

    try:
        return cpu_plan(allocator=allocator, threads=threads)
    except RuntimeConfigError as exc:
        raise click.UsageError(str(exc)) from exc


def report_plan(runtime_plan: Any, prefix: str) -> None:
    """One line on stderr: the allocator, the threads and what the plan changes."""
    lines = runtime_plan.describe() or ["nothing to change"]
    click.echo(
        f"{prefix}: allocator {runtime_plan.allocator}, {runtime_plan.threads} threads; "
        + "; ".join(lines),
        err=True,
    )


@click.command(
    "run",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@runtime_options(
    "auto: tcmalloc if installed, else tuned glibc malloc; system: the allocator as it is."
)
@click.option("-q", "--quiet", is_flag=True, help="Do not report the settings on stderr.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run_cmd(allocator: str, threads: int | None, quiet: bool, command: tuple[str, ...]) -> None:
    """Run COMMAND under tuned CPU allocator and thread settings: spore run -- CMD ARGS...

    Settings are environment variables set before COMMAND starts; variables you already set
    are kept (and reported). The tuned allocators keep freed memory for reuse: resident memory
    stays higher. --allocator system leaves the allocator as it is; the thread variables are
    still set unless you set them yourself.

    Exits with COMMAND's status; as shells do, 127 when COMMAND (or its #! interpreter) is not
    found and 126 when it cannot run (a directory, not executable).
    """
    if not command[0]:
        raise click.UsageError('the command is empty (an unset variable in `spore run -- "$CMD"`?)')
    if command[0].startswith("-"):  # unknown options are passed on: no command starts so
        known = [opt for param in click.get_current_context().command.params for opt in param.opts]
        raise click.NoSuchOption(command[0].split("=")[0], possibilities=known)
    runtime_plan = plan(allocator, threads)
    if not quiet:
        report_plan(runtime_plan, "spore run")
    try:
        os.execvpe(command[0], list(command), runtime_plan.env)
    except OSError as exc:
        reason, status = _exec_failure(command[0], exc, runtime_plan.env.get("PATH"))
        failed = click.ClickException(f"cannot run {command[0]!r}: {reason}")
        failed.exit_code = status
        raise failed from exc


def _missing_interpreter(path: str) -> str:
    """What a file that exists but is "not found" by exec lacks: its ``#!`` interpreter, or for
    a binary, its loader or a file it requires."""
    try:
        with open(path, "rb") as file:
            script = file.read(2) == b"#!"
    except OSError:
        script = False
    return "the interpreter its #! line names" if script else "a file it requires (its loader)"


def _exec_failure(name: str, exc: OSError, path: str | None) -> tuple[str, int]:
    """Why ``name`` did not start, and the status bash exits with then: 127 when it (or the
    interpreter its ``#!`` line names) is not found, 126 when it cannot run (a directory, not
    executable)."""
    has_dir = os.sep in name
    if isinstance(exc, FileNotFoundError):
        found = name if has_dir and os.path.exists(name) else None
        found = found or (None if has_dir else shutil.which(name, path=path))
        if found:
            return f"{_missing_interpreter(found)} was not found", 127
        return ("no such file" if has_dir else "command not found"), 127
    if has_dir and os.path.isdir(name):
        return "it is a directory", 126
    return exc.strerror or str(exc), 126
