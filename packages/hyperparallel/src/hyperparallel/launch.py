"""Start the ranks: join a ``torchrun`` job when started by one, else start ``nproc`` local
processes with torch's elastic launcher, under the CPU runtime plan (allocator, threads)."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import signal
import socket
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hyperparallel.config import Config

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class TrainingFailed(RuntimeError):
    """A rank exited with an error (already printed: its one-line message or its traceback)."""


class TrainingInterrupted(RuntimeError):
    """The launcher got SIGINT (Ctrl-C) or SIGTERM and stopped the ranks."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}; the ranks were stopped")


class OutputBusy(RuntimeError):
    """Another ``spore train`` holds the run's output directory."""


LOCK_FILE = ".spore-train.lock"


def holder() -> bool:
    """Whether this process holds the output for its run: the launcher, or rank 0 of a
    torchrun job (the other ranks run beside it)."""
    return not under_torchrun() or os.environ.get("RANK") == "0"


def busy(output: str) -> str | None:
    """Why ``output`` cannot be written now: another run holds it (see :func:`hold_output`), or
    its lock file cannot be opened or written; ``None`` when neither."""
    lock = Path(output) / LOCK_FILE
    if not lock.is_file():
        return None
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError as exc:
        return (
            f"run.output {output}: its lock file {LOCK_FILE} cannot be opened "
            f"({exc.strerror}); choose another --output"
        )
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        who = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process"
        return (
            f"run.output {output} is in use by another spore train ({who}); wait for it to "
            f"end, or choose another --output"
        )
    finally:
        os.close(fd)  # and the shared lock with it
    if not os.access(lock, os.W_OK):  # hold_output opens it for writing
        return (
            f"run.output {output}: its lock file {LOCK_FILE} cannot be written by this user; "
            f"choose another --output"
        )
    return None


@contextlib.contextmanager
def hold_output(output: str) -> Iterator[None]:
    """Hold ``run.output`` while this run writes it (the launcher, or rank 0 of a torchrun
    job): another run on it is refused with :class:`OutputBusy`, where two used to remove each
    other's checkpoints in progress and mix their logs. The lock (``flock`` on ``LOCK_FILE``
    there) ends with the process."""
    if not holder():
        yield
        return
    path = Path(output)
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputBusy(busy(output) or f"run.output {output} is in use") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


PR_SET_PDEATHSIG = 1
"""prctl(2)'s option: the signal this process gets when its parent ends (Linux)."""


def end_with_launcher(launcher: int) -> None:
    """End this rank with its launcher (pid ``launcher``), which holds the output's lock
    (:func:`hold_output`): the kernel lets the lock go however the launcher dies, and a rank
    that outlived it would write beside the next run. On Linux the kernel sends the rank
    SIGKILL when the launcher ends (torch's spawn asks for SIGINT, which a rank turns into an
    exception, handles late or ignores after a first Ctrl-C); on any system a rank whose
    launcher died before this call (while the rank started) ends here. Elsewhere a rank
    outlives a launcher killed later. SIGKILL leaves a save in progress in its temporary
    folder: checkpoints are renamed into place whole."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != launcher:  # it died first: this rank was handed to another parent
        os.kill(os.getpid(), signal.SIGKILL)


def under_torchrun(env: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """True when this process is a rank of a job started by torchrun (or its env contract)."""
    return "TORCHELASTIC_RUN_ID" in env or all(k in env for k in TORCHRUN_VARIABLES)


def _apply_cpu_plan(nproc: int) -> list[str]:
    """Allocator and per-rank thread settings for the children, unless already planned."""
    from spore.runtime import APPLIED_MARKER, RuntimeConfigError, cpu_plan

    if APPLIED_MARKER in os.environ:
        return []
    try:
        plan = cpu_plan(ranks=nproc)
    except RuntimeConfigError as exc:
        return [f"CPU runtime plan not applied: {exc}"]
    os.environ.update(plan.set)
    os.environ[APPLIED_MARKER] = plan.allocator
    return plan.describe()


TRACEBACK = "Traceback (most recent call last):"
"""How a traceback a rank hands to its launcher begins (:func:`hyperparallel.train.worker`)."""


def _failure_lines(failures: dict[int, Any]) -> list[str]:
    """What to print of the ranks' failures: each distinct error a rank handed over, once (a
    one-line ``error: ...``, or a traceback under a line naming the ranks that raised it, so
    that N ranks failing alike print one traceback, not N interleaved), and each rank a signal
    killed (nothing of it was printed: an OOM kill sends SIGKILL)."""
    errors = {f.message for f in failures.values() if str(f.message).startswith("error: ")}
    raised: dict[str, list[int]] = {}
    for rank, failure in sorted(failures.items()):
        if str(failure.message).startswith(TRACEBACK):
            raised.setdefault(failure.message, []).append(rank)
    tracebacks = [
        f"rank(s) {', '.join(map(str, ranks))} raised:\n{text.rstrip()}"
        for text, ranks in raised.items()
    ]
    killed = [
        f"error: rank {rank} was killed by {failure.signal_name()}"
        + (" (the kernel's out-of-memory killer sends it)" if failure.exitcode == -9 else "")
        for rank, failure in sorted(failures.items())
        if failure.exitcode < 0
    ]
    return [*sorted(errors), *tracebacks, *killed]


def _with_handed_over(failures: dict[int, Any], agent_dir: Path) -> dict[int, Any]:
    """``failures`` and each other rank that handed an error over in ``agent_dir`` (its
    ``error.json``): torch reports only the first rank to fail, and stops the others, some of
    which may have raised too and written their own error first."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    found = dict(failures)
    for error_file in sorted(agent_dir.glob("*/attempt_*/*/error.json")):
        rank = error_file.parent.name
        if rank.isdigit() and int(rank) not in found:  # it exits with status 1 once written
            found[int(rank)] = ProcessFailure(
                local_rank=int(rank), pid=0, exitcode=1, error_file=str(error_file)
            )
    return found


def launch(config: Config, resume: str | None = None, *, echo: Any = print) -> None:
    """Run the training described by ``config``, holding its output; raises
    :class:`TrainingFailed` on failure, :class:`OutputBusy` when another run holds it."""
    with hold_output(config.run.output):
        _launch(config, resume, echo)


def _launch(config: Config, resume: str | None, echo: Any) -> None:
    from hyperparallel.train import device_type, worker

    settings = config.to_dict()
    if under_torchrun():
        worker(settings, resume)
        return
    nproc = config.parallel.nproc
    if device_type(config.parallel) == "cpu":
        for line in _apply_cpu_plan(nproc):
            echo(f"runtime: {line}")
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Failures and interrupts are reported by spore train; the elastic agent's own log lines
    # would repeat them as tracebacks and warnings (its loggers each set their own level), and
    # torch.multiprocessing's would announce that it stops the surviving ranks.
    quiet = ("torch.distributed.elastic", "torch.multiprocessing")
    for name in [*quiet, *logging.root.manager.loggerDict]:
        if name.startswith(quiet):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    sys.stdout.flush()
    # The agent's own folder (the ranks' error files), removed at the end: by default it is a
    # new torchelastic_* folder in the system's temporary folder, never removed.
    try:
        with tempfile.TemporaryDirectory(prefix="spore-train-") as agent_dir:
            launch_config = LaunchConfig(
                min_nodes=1,
                max_nodes=1,
                nproc_per_node=nproc,
                run_id=f"spore-train-{uuid.uuid4().hex[:8]}",
                rdzv_backend="c10d",
                rdzv_endpoint="127.0.0.1:0",
                max_restarts=0,
                monitor_interval=0.1,
                start_method="spawn",
                logs_specs=DefaultLogsSpecs(log_dir=agent_dir),
            )
            try:
                elastic_launch(launch_config, worker)(settings, resume, os.getpid())
            except ChildFailedError as exc:
                failures = _with_handed_over(exc.failures, Path(agent_dir))
                for line in _failure_lines(failures):
                    print(line, file=sys.stderr, flush=True)
                ranks = ", ".join(str(r) for r in sorted(failures)) or "?"
                raise TrainingFailed(
                    f"training failed on rank(s) {ranks}; see the error above"
                ) from None
    except SignalException as exc:
        raise TrainingInterrupted(exc.sigval) from None
    except KeyboardInterrupt:
        raise TrainingInterrupted(signal.SIGINT) from None
