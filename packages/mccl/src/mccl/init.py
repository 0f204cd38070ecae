"""Background process-group initialisation and the guard that makes callers wait for it.

While an init is pending, every read of the default process group waits for it. That read is
``torch.distributed.distributed_c10d._World.default_pg``: ``is_initialized()``,
``get_rank()``/``get_world_size()``, every collective given no group, ``new_group``,
``barrier``, ``destroy_process_group``, ``DeviceMesh``/DTensor/FSDP2/DCP all go through it. The
guard replaces that property for the duration of the init and puts torch's own back the
moment the init succeeds, so afterwards it costs nothing. After a failed init it stays until a
caller has been told (``wait()`` or the first read raises :class:`InitFailedError`).
"""

from __future__ import annotations

import _sitebuiltins
import atexit
import contextlib
import difflib
import dis
import functools
import numbers
import os
import signal
import sys
import threading
import time
import warnings
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlparse

from torch.distributed import distributed_c10d as c10d

from mccl import rendezvous
from spore.distributed import time_limit

DEFAULT_INIT_TIMEOUT_S = 1800.0  # torch's own default process-group timeout

_lock = threading.Lock()
_pending: InitHandle | None = None
_failed: InitHandle | None = None  # a failed init nobody has been told of yet
_in_init = threading.local()
_created: list[weakref.ref[c10d.ProcessGroup]] = []  # the last group a background init made
_ORIGINAL = c10d._World.__dict__["default_pg"]
_exit_raised: SystemExit | None = None  # the main thread's last sys.exit(), for the exit status


class InitTimeoutError(TimeoutError):
    """The process group was not ready within the init timeout."""


class InitFailedError(RuntimeError):
    """``init_process_group`` raised in the background; the original error is the cause."""


class InitPendingError(RuntimeError):
    """A second background init was started while one is pending."""


def _check_backend(backend: str | None) -> None:
    """A ``ValueError`` naming each backend in ``backend`` (``"gloo"``, ``"cpu:gloo,cuda:nccl"``)
    that torch.distributed does not know, at the call rather than in the background init."""
    if backend is None:
        return
    try:
        with warnings.catch_warnings():  # torch warns of an unknown name's device capability
            warnings.simplefilter("ignore")
            names = set(c10d.BackendConfig(c10d.Backend(backend)).get_device_backend_map().values())
    except ValueError as e:
        raise ValueError(f"backend {backend!r}: {e}") from None
    known = [b for b in c10d.Backend.backend_list if b != c10d.Backend.UNDEFINED]
    for name in sorted(names - set(known)):
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"unknown process-group backend {name!r} in {backend!r}; {hint}"
            f"torch.distributed knows {', '.join(known)} (and backends registered with "
            "torch.distributed.Backend.register_backend)"
        )


_ENV_RENDEZVOUS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # read by torch's env://

_ENV_FIX = {
    "RANK": "set it to this process's rank, or pass rank=",
    "WORLD_SIZE": "set it to the number of processes, or pass world_size=",
    "MASTER_PORT": "set it to the port of rank 0's store, the same on every rank",
}


def _int_option(kwargs: dict[str, Any], name: str) -> int:
    """``kwargs[name]`` (``rank``, ``world_size``) as torch takes it: an integer, -1 if not
    given; a ``TypeError`` naming it otherwise (``None`` included)."""
    value = kwargs.get(name, -1)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        what = "this process's rank" if name == "rank" else "the number of processes"
        raise TypeError(f"{name}= must be an int, got {value!r}: pass {what}, or leave it out")
    return int(value)


def _integer(name: str, text: str, where: str, fix: str) -> int:
    """``text``, the value of ``name`` given ``where``, as an integer (torch parses it so); a
    ``ValueError`` naming it, with ``fix``, when it is not one."""
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} {where} is not an integer{fix}") from None


def _env_value(name: str) -> int:
    """The environment's ``name`` (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``), which torch's
    env:// rendezvous parses as an integer."""
    fix = f", as torch's env:// rendezvous reads it: {_ENV_FIX[name]}"
    return _integer(name, os.environ[name], "in the environment", fix)


def _query_value(init_method: str, query: dict[str, str], name: str) -> int:
    """``name`` (``rank``, ``world_size``) in the query of ``init_method``, -1 if absent."""
    if name not in query:
        return -1
    where = f"in the query of init_method {init_method!r}"
    fix = f": write {name}=N there, or leave it out and pass {name}="
    return _integer(name, query[name], where, fix)


def _check_ranks(rank: int, rank_from: str, world_size: int, size_from: str) -> None:
    """A ``ValueError`` unless ``world_size`` > 0 and ``rank`` is in ``0..world_size-1``; the
    ``*_from`` say where each came from."""
    if world_size < 1:
        raise ValueError(
            f"world size {world_size} ({size_from}) must be > 0: the number of processes"
        )
    if not 0 <= rank < world_size:
        raise ValueError(
            f"rank {rank} ({rank_from}) must be in 0..{world_size - 1} for world size "
            f"{world_size} ({size_from}): each process has its own rank in that range"
        )


def _check_options(kwargs: dict[str, Any]) -> tuple[int, int]:
    """The argument errors ``init_process_group`` raises before it connects to any peer (its
    ``env://`` rendezvous reads the environment first), raised at the call rather than in the
    background init. Returns the rank and world size torch will use (-1: not known here)."""
    timeout = kwargs.get("timeout")
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(
            f"timeout must be a datetime.timedelta, as torch.distributed.init_process_group "
            f"takes it, got {timeout!r}; init_timeout= takes seconds"
        )
    rank, world_size = _int_option(kwargs, "rank"), _int_option(kwargs, "world_size")
    init_method = kwargs.get("init_method")
    if kwargs.get("store") is not None:
        if init_method is not None:
            raise ValueError("pass init_method= or store=, not both")
        if world_size < 1:
            raise ValueError(f"store= needs world_size= > 0, got {kwargs.get('world_size')!r}")
        if rank < 0:
            raise ValueError(f"store= needs rank= >= 0, got {kwargs.get('rank')!r}")
        _check_ranks(rank, "rank=", world_size, "world_size=")
        return rank, world_size
    if init_method is None:
        init_method = "env://"
    if not isinstance(init_method, str):
        return rank, world_size  # torch raises its own error for it
    url = urlparse(init_method)
    query = dict(pair.partition("=")[::2] for pair in url.query.split("&") if pair)
    if (rank != -1 or world_size != -1) and ("rank" in query or "world_size" in query):
        raise ValueError(
            f"init_method {init_method!r} has rank or world_size in its query, and rank= or "
            f"world_size= is given too: give them in one place"
        )
    rank_from, size_from = "rank=", "world_size="
    if rank == -1 and world_size == -1:
        rank = _query_value(init_method, query, "rank")
        world_size = _query_value(init_method, query, "world_size")
        rank_from = size_from = "the query of init_method"
    if url.scheme == "file":  # as torch reads it: file:/path and FILE:///path too
        folder = Path(url.path).parent
        if not folder.is_dir():  # torch's FileStore would retry opening it holding the GIL
            raise ValueError(
                f"the file:// rendezvous {init_method} is in a directory that does "
                f"not exist ({folder}): create it, or choose a file in an existing one"
            )
    elif url.scheme == "tcp":
        try:
            port = url.port
        except ValueError:  # not a number, or past 65535
            port = None
        if not url.hostname or not port:
            raise ValueError(
                f"the tcp:// rendezvous {init_method!r} needs a host and a port "
                f"(1..65535): write tcp://HOST:PORT, the address of rank 0's store"
            )
    elif url.scheme == "env":
        unset = [
            name
            for name, given in zip(
                _ENV_RENDEZVOUS, (rank != -1, world_size != -1, False, False), strict=True
            )
            if not (given or os.environ.get(name))
        ]
        if unset:
            raise ValueError(
                f"the env:// rendezvous (the default init_method) needs {', '.join(unset)} "
                "in the environment, which are not set (or empty): launch with torchrun, set "
                "them, or pass init_method= or store= (rank= and world_size= stand for RANK "
                "and WORLD_SIZE)"
            )
        port = _env_value("MASTER_PORT")
        if not 0 < port < 2**16:
            raise ValueError(
                f"MASTER_PORT={os.environ['MASTER_PORT']!r} in the environment is not a port "
                f"number (1..65535): {_ENV_FIX['MASTER_PORT']}"
            )
        if rank == -1:
            rank, rank_from = _env_value("RANK"), "RANK in the environment"
        if world_size == -1:
            world_size, size_from = _env_value("WORLD_SIZE"), "WORLD_SIZE in the environment"
    else:  # a rendezvous handler registered with torch: its own rules
        return rank, world_size
    if rank == -1 or world_size == -1:
        raise ValueError(
            f"the {url.scheme}:// rendezvous {init_method!r} needs rank and world_size: pass "
            f"rank= and world_size=, or put them in its query (...?rank=0&world_size=2)"
        )
    _check_ranks(rank, rank_from, world_size, size_from)
    return rank, world_size


def _init_limit(init_timeout: Any, timeout: Any) -> float:
    """The init's deadline in seconds: ``init_timeout`` (seconds or a ``timedelta``), else
    torch's ``timeout``, else 30 minutes; a clear error for a value that is no positive, finite
    time (``timeout`` itself is checked by :func:`_check_options`)."""
    if init_timeout is not None:
        return time_limit(init_timeout, "init_timeout")
    if isinstance(timeout, timedelta):
        return time_limit(timeout, "timeout")
    return DEFAULT_INIT_TIMEOUT_S


class InitHandle:
    """A pending (or finished) background ``init_process_group``."""

    _group: weakref.ref[c10d.ProcessGroup]  # the group this init created, set on success

    def __init__(
        self,
        backend: str | None,
        kwargs: dict[str, Any],
        init_timeout: float,
        rank: int,
        world_size: int,
    ) -> None:
        self.backend = backend or "default"
        self.rank = rank
        self.world_size = world_size
        self.address = rendezvous.address(kwargs)
        self.init_timeout = init_timeout
        self.started = time.monotonic()
        self._backend_arg = backend
        self._kwargs = kwargs
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._timed_out = False  # a caller was told it timed out: a later failure is no news
        self._thread = threading.Thread(target=self._run, name="mccl-init", daemon=True)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<mccl.InitHandle {self.backend} rank {self.rank}/{self.world_size} {state}>"

    def done(self) -> bool:
        """True once init has finished, successfully or not."""
        return self._done.is_set()

    def exception(self) -> BaseException | None:
        """What init raised, once done; ``None`` while pending or on success. Reading a
        failure counts as being told of it (as :meth:`wait` raising it does)."""
        if self._error is not None:
            _told(self)
        return self._error

    def wait(self, timeout: float | None = None) -> c10d.ProcessGroup:
        """Block until the group is ready and return it: the group this init created.

        Waits at most until the init deadline (``timeout`` can shorten it), then raises
        :class:`InitTimeoutError`; if init failed, raises :class:`InitFailedError` from the
        original exception; if the group has since been destroyed, raises ``RuntimeError``.
        """
        remaining = self.started + self.init_timeout - time.monotonic()
        limit = remaining if timeout is None else min(timeout, remaining)
        if not self._done.wait(max(0.0, limit)):
            deadline = limit >= remaining  # the init's own deadline, not a shorter poll
            if deadline:
                self._timed_out = True
                _told(self)
            raise InitTimeoutError(self._timeout_message(deadline))
        if self._error is not None:
            _told(self)
            raise InitFailedError(
                f"background init_process_group failed ({self._where()}): "
                f"{type(self._error).__name__}: {self._error}"
            ) from self._error
        group = self._group()
        if group is None or group not in c10d._world.pg_map:
            raise RuntimeError(
                f"the process group this init created ({self._where()}) has been destroyed "
                f"(torch.distributed.destroy_process_group()); start a new init for another"
            )
        return group

    def _where(self) -> str:
        return (
            f"backend {self.backend}, rank {self.rank} of world size {self.world_size}, "
            f"rendezvous {self.address}"
        )

    def _timeout_message(self, deadline: bool) -> str:
        """Why a wait ended unready: at the init's ``deadline``, with what a probe of the
        rendezvous finds; before it (a shorter poll), how long the init has left, unprobed."""
        now = time.monotonic()
        if deadline:
            found = self._probe
            hint = found.hint(self.world_size) if found else ""
        else:
            hint = (
                f"still pending, {self.started + self.init_timeout - now:.1f}s before its deadline"
            )
        return (
            f"process group not ready after {now - self.started:.1f}s (init timeout "
            f"{self.init_timeout:.1f}s; {self._where()})" + (f": {hint}" if hint else "")
        )

    @functools.cached_property
    def _probe(self) -> rendezvous.Probe | None:
        """The rendezvous, probed once: each read of the group after the deadline waits again."""
        return rendezvous.probe(self.address)

    def _pending_message(self) -> str:
        """Why another init cannot start while this one runs, and what to do."""
        if time.monotonic() < self.started + self.init_timeout:
            return (
                f"a background process-group init is already pending ({self!r}); wait for it "
                f"with mccl.pending().wait() before starting another"
            )
        return (
            f"a background process-group init ({self!r}) timed out after "
            f"{self.init_timeout:.1f}s but is still running in torch, which cannot cancel it "
            f"(it ends at torch's own timeout, and may still succeed if a peer joins: "
            f"handle.done()); restart the process to try again, and pass timeout= to bound "
            f"torch's own wait"
        )

    def _run(self) -> None:
        global _pending, _failed
        _in_init.active = True
        try:
            c10d.init_process_group(backend=self._backend_arg, **self._kwargs)
            self._group = weakref.ref(_ORIGINAL.fget(c10d._world))
            _created[:] = [self._group]
        except BaseException as exc:
            self._error = exc
        finally:
            with _lock:
                if _pending is self:
                    _pending = None
                    if self._error is None or self._timed_out:
                        _set_guard(False)
                    else:  # the guard stays until a caller is told (wait() or the next read)
                        _failed = self
            self._done.set()


def _told(handle: InitHandle) -> None:
    """A caller has been told that ``handle`` failed (or timed out at its deadline): later
    reads go to torch directly."""
    global _failed
    with _lock:
        if _failed is handle:
            _failed = None
            if _pending is None:
                _set_guard(False)


def _guarded_default_pg(world: c10d._World) -> c10d.ProcessGroup | None:
    if not getattr(_in_init, "active", False):
        handle = _pending or _failed
        if handle is not None:
            handle.wait()
    return _ORIGINAL.fget(world)


_GUARD = property(_guarded_default_pg, _ORIGINAL.fset, doc=_ORIGINAL.__doc__)


def _set_guard(on: bool) -> None:
    c10d._World.default_pg = _GUARD if on else _ORIGINAL


def guard_installed() -> bool:
    """True while the default-group guard is in place: while an init is pending, and after a
    failed one until a caller is told (``wait()``, ``exception()`` or the next read)."""
    return c10d._World.__dict__["default_pg"] is _GUARD


def pending() -> InitHandle | None:
    """The init in progress, if any."""
    return _pending


def init_process_group_async(
    backend: str | None = None,
    *,
    init_timeout: float | timedelta | None = None,
    **kwargs: Any,
) -> InitHandle:
    """Start ``torch.distributed.init_process_group(backend, **kwargs)`` in the background.

    Returns at once. Any read of the default process group (collectives, ``get_rank``,
    ``is_initialized``, DeviceMesh, FSDP2, DCP...) waits for the init first. ``init_timeout``
    (seconds or a timedelta; default: ``kwargs["timeout"]``, else 30 minutes) bounds that wait:
    past it the waiting call raises :class:`InitTimeoutError`.
    """
    global _pending, _failed
    _check_backend(backend)
    limit = _init_limit(init_timeout, kwargs.get("timeout"))
    rank, world_size = _check_options(kwargs)
    with _lock:
        if _pending is not None:
            raise InitPendingError(_pending._pending_message())
        if _ORIGINAL.fget(c10d._world) is not None:
            raise ValueError(  # what torch.distributed.init_process_group raises
                "trying to initialize the default process group twice! It is initialized "
                "already: use it, or call torch.distributed.destroy_process_group() first"
            )
        handle = InitHandle(backend, kwargs, limit, rank, world_size)
        _pending, _failed = handle, None
        _set_guard(True)
        try:
            handle._thread.start()
        except BaseException:
            _pending = None
            _set_guard(False)
            raise
    return handle


def _forget_in_child() -> None:
    """A child forked while an init is pending (a fork-started DataLoader worker) is no rank of
    that group, and has no copy of the init thread: it starts with no init pending, as
    torch would have it, instead of waiting for one that never ends there."""
    global _lock, _pending, _failed
    _lock = threading.Lock()  # the parent's init thread may have held it at the fork
    if _pending is not None or _failed is not None:
        _pending = _failed = None
        _set_guard(False)


os.register_at_fork(after_in_child=_forget_in_child)


def _destroy_created() -> None:
    """Destroy the default group if a background init created it and the program did not.

    A gloo group created in a background thread and never destroyed can abort the process
    (SIGABRT) during interpreter teardown once a peer has exited.
    """
    current = _ORIGINAL.fget(c10d._world)
    if current is not None and any(current is ref() for ref in _created):
        with contextlib.suppress(Exception):  # exiting anyway; the group is unusable
            c10d.destroy_process_group()


def _note_exit(raised: SystemExit) -> None:
    """Note the main thread's ``sys.exit()`` (or ``exit()``) for :func:`_exit_status`."""
    global _exit_raised
    if threading.current_thread() is threading.main_thread():
        _exit_raised = raised


@functools.wraps(sys.exit)  # sys.exit, noting its SystemExit for _exit_status
def _recording_exit(status: object = None, /) -> NoReturn:
    if isinstance(status, SystemExit):  # raised as it is, as sys.exit does
        raised = status
    else:
        raised = SystemExit() if status is None else SystemExit(status)
    _note_exit(raised)
    raise raised


_QUIT = _sitebuiltins.Quitter.__call__


@functools.wraps(_QUIT)  # the exit() and quit() builtins, noted as sys.exit() is
def _recording_quit(self: _sitebuiltins.Quitter, code: object = None) -> NoReturn:
    try:
        _QUIT(self, code)
    except SystemExit as raised:
        _note_exit(raised)
        raise


sys.exit = _recording_exit
_sitebuiltins.Quitter.__call__ = _recording_quit


_RERAISE, _RAISE_VARARGS = dis.opmap["RERAISE"], dis.opmap["RAISE_VARARGS"]


def _exit_status() -> int:
    """The status of the ``sys.exit()`` that ended the program, as Python computes it; 0 if
    none did (the main thread's last one, if any, was caught).

    Its traceback starts at the outermost frame it reached (on Python 3.11: that handled it
    on the way; with none it has no traceback): a frame that caught it ran on from there, one
    that it left stopped there or at the statement that raised it again.
    """
    raised = _exit_raised
    if raised is None or raised.code is None:
        return 0
    tb = raised.__traceback__
    if tb is not None:
        frame = tb.tb_frame
        code = frame.f_code.co_code
        op, arg = code[frame.f_lasti], code[frame.f_lasti + 1]
        # only RERAISE and a bare raise pass it on without a traceback entry of their own
        reraised = op == _RERAISE or (op == _RAISE_VARARGS and arg == 0)
        if frame.f_lasti != tb.tb_lasti and not reraised:
            return 0
    if not isinstance(raised.code, int):
        return 1
    return raised.code & 0xFF if -(2**63) <= raised.code < 2**63 else 255


def _at_exit() -> None:
    """The first exit handler: run the others, then destroy the group mccl created if the
    program did not (they may still use it: ``atexit.register(dist.destroy_process_group)``).

    A failed init nothing was told of (no wait, no read of the group) is printed to stderr,
    not lost. The others run without the guard, so they do not wait for an init. With one
    still pending, the process ends here: the init thread returning from torch's rendezvous
    while the interpreter is being torn down aborts the process (SIGABRT). It ends by SIGINT
    after an uncaught ``KeyboardInterrupt`` (as CPython ends such a program; a shell reports
    130), else with ``os._exit``: status 1 after an uncaught exception, else that of the
    ``sys.exit()`` that ended the program, else 0.
    """
    global _pending, _failed
    with _lock:
        pending = _pending is not None
        untold = _failed
        _pending = _failed = None
        _set_guard(False)
    if untold is not None:
        _say_untold(untold)
    last = getattr(sys, "last_value", None)
    status = (1 if last is not None else _exit_status()) if pending else 0  # before theirs
    atexit.unregister(_at_exit)
    atexit._run_exitfuncs()
    if not pending:
        _destroy_created()
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    if isinstance(last, KeyboardInterrupt):
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


def _say_untold(handle: InitHandle) -> None:
    """Print, at exit, that ``handle``'s init failed and nothing read the group to be told."""
    error = handle._error
    with contextlib.suppress(OSError, ValueError):
        print(
            f"mccl: warning: the background process-group init ({handle!r}) failed and the "
            f"program never waited for it or used the group: {type(error).__name__}: {error}",
            file=sys.stderr,
            flush=True,
        )


# At shutdown, before any exit handler runs, so that it is registered last and runs first
# (imported during shutdown, too late for that: no init can start then either).
with contextlib.suppress(RuntimeError):
    threading._register_atexit(atexit.register, _at_exit)
