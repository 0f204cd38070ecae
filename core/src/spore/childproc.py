"""Run child processes and read the JSON line each prints last.

The figures behind ``spore plugins``, ``spore doctor`` and the plugins' benchmarks come from
child processes that print one JSON object as their last line of output. :func:`run_json` runs
one; :func:`start_json` starts one to collect later and :func:`run_json_all` runs several at once
(the ranks of a process group). A child that exits non-zero, runs past its timeout or prints no
JSON object raises :class:`ChildError`, which names the command and ends with its stderr.
Each child leads its own process group, so a timeout or a kill also stops what it started.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from contextlib import suppress
from types import TracebackType
from typing import Any

TAIL_CHARS = 2000
POLL_S = 0.05
"""How long :func:`run_json_all` reads one child's output before turning to the next."""


class ChildError(RuntimeError):
    """A child process exited non-zero, ran past its timeout or printed no JSON object."""

    def __init__(
        self,
        args: Sequence[str],
        problem: str,
        *,
        returncode: int | None,
        stdout: str,
        stderr: str,
        timed_out: bool = False,
    ) -> None:
        self.command = list(args)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        self.timed_out = timed_out
        message = f"`{shlex.join(self.command)}` {problem}"
        for name, text in (("stdout", stdout if timed_out else ""), ("stderr", stderr)):
            if text.strip():
                message += f"\n--- {name} (last {TAIL_CHARS} characters) ---\n"
                message += text.strip()[-TAIL_CHARS:]
        super().__init__(message)


def python(*args: str) -> list[str]:
    """The command running this interpreter with ``-P`` and ``args`` (``"-m", module, ...`` or
    ``"-c", code``): the current folder is not put first on ``sys.path``, so a ``spore.py``
    or ``spore/`` there cannot stand in for the installed package."""
    return [sys.executable, "-P", *args]


def last_json(stdout: str) -> dict[str, Any] | None:
    """The last line of ``stdout`` that is a JSON object, or ``None``."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return None


class Child:
    """A started child process whose output is collected by :meth:`wait` or :meth:`result`."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: os.PathLike[str] | str | None = None,
    ) -> None:
        self.args = [str(a) for a in args]
        self._output: tuple[str, str] | None = None
        self._proc = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=None if env is None else dict(env),
            cwd=cwd,
            start_new_session=True,  # its own process group: a kill reaches its children too
        )

    @property
    def pid(self) -> int:
        return self._proc.pid

    def wait(self, timeout: float, *, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Wait up to ``timeout`` seconds; the finished process, its stdout and stderr.

        Raises :class:`ChildError` on timeout (after killing the child) and, with ``check``,
        when it exits non-zero.
        """
        try:
            out, err = self._communicate(timeout)
        except subprocess.TimeoutExpired:
            raise self._timed_out(timeout) from None
        done = subprocess.CompletedProcess(self.args, self._proc.returncode, out, err)
        if check and done.returncode != 0:
            raise ChildError(
                self.args,
                f"exited with status {done.returncode}",
                returncode=done.returncode,
                stdout=out,
                stderr=err,
            )
        return done

    def exited(self, within: float) -> bool:
        """Whether the child has exited, reading its output for up to ``within`` seconds."""
        try:
            self._communicate(within)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _communicate(self, timeout: float) -> tuple[str, str]:
        # a communicate that timed out keeps what it read: the next one goes on from there
        if self._output is None:
            self._output = self._proc.communicate(timeout=timeout)
        return self._output

    def _timed_out(self, timeout: float) -> ChildError:
        """Kill the child; the error saying it ran past ``timeout`` seconds."""
        out, err = self._kill()
        return ChildError(
            self.args,
            f"did not finish within {timeout:g}s (killed)",
            returncode=None,
            stdout=out,
            stderr=err,
            timed_out=True,
        )

    def result(self, timeout: float) -> dict[str, Any]:
        """Wait as :meth:`wait` does; the last JSON object the child printed."""
        done = self.wait(timeout)
        value = last_json(done.stdout)
        if value is None:
            tail = done.stdout.strip()[-TAIL_CHARS:] or "nothing"
            raise ChildError(
                self.args,
                f"exited with status 0 but printed no JSON object; its stdout: {tail}",
                returncode=0,
                stdout=done.stdout,
                stderr=done.stderr,
            )
        return value

    def kill(self) -> None:
        """Kill the child and its process group if it still runs, and reap it."""
        if self._proc.poll() is None:
            self._kill()

    def _kill(self) -> tuple[str, str]:
        with suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        return self._proc.communicate()

    def __enter__(self) -> Child:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()


def run(
    args: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: os.PathLike[str] | str | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``args`` to completion with captured text output (see :meth:`Child.wait`).

    ``env`` is the child's whole environment (``None``: this process's).
    """
    with Child(args, env=env, cwd=cwd) as child:
        return child.wait(timeout, check=check)


def run_json(
    args: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: os.PathLike[str] | str | None = None,
) -> dict[str, Any]:
    """Run ``args`` and return the last JSON object it printed on stdout."""
    with Child(args, env=env, cwd=cwd) as child:
        return child.result(timeout)


def start_json(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: os.PathLike[str] | str | None = None,
) -> Child:
    """Start ``args`` now; ``.result(timeout)`` later returns its last JSON object."""
    return Child(args, env=env, cwd=cwd)


def run_json_all(
    commands: Sequence[Sequence[str]],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: os.PathLike[str] | str | None = None,
) -> list[dict[str, Any]]:
    """Start every command at once; their last JSON objects, in order.

    ``timeout`` bounds the whole group. The first child to fail, in the order they exit (a
    rank that fails while the others wait for it), raises :class:`ChildError` and the children
    still running are killed.
    """
    children: list[Child] = []
    try:
        for args in commands:
            children.append(Child(args, env=env, cwd=cwd))
        deadline = time.monotonic() + timeout
        running = list(children)
        while running:
            for child in list(running):
                if child.exited(within=POLL_S):
                    child.result(0)  # raises for a failed child
                    running.remove(child)
            if running and time.monotonic() > deadline:
                raise running[0]._timed_out(timeout)
        return [c.result(0) for c in children]
    finally:
        for child in children:
            child.kill()
