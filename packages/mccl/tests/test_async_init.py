"""Real gloo processes; every launch has a hard timeout so a hang fails the test."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mccl.benchmarks import free_port


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_right_after_the_async_call(ranks, world) -> None:
    results, _ = ranks("collective", world)
    expected_sum = float(sum(range(1, world + 1)))
    for rank, r in enumerate(results):
        assert r["sum"] == [expected_sum] * 4
        assert r["gathered"] == [float(i) for i in range(world)]
        assert r["rank"] == rank
        assert r["guard_removed"]
        assert r["is_initialized"]
    assert any(r["pending_at_call"] for r in results), "no rank issued its collective early"


def test_devicemesh_dtensor_and_fsdp2_before_init_completes(ranks) -> None:
    results, _ = ranks("fsdp", 2)
    for r in results:
        assert r["full"] == [0.0, 1.0, 2.0, 3.0]
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-6)
        assert r["grad_close"]


def test_distributed_checkpoint_as_the_first_call(ranks) -> None:
    results, _ = ranks("dcp", 2)
    assert results == [{"loaded": [10.0, 11.0, 12.0], "step": 7}] * 2


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_that_never_joins_times_out_everywhere(ranks, world) -> None:
    timeout = 4.0
    results, _ = ranks("absent_peer", world, ranks=list(range(world - 1)), timeout=timeout)
    for rank, r in enumerate(results):
        assert r["error"] == "InitTimeoutError"
        assert timeout - 0.5 <= r["after"] <= timeout + 2
        message = r["message"]
        assert f"rank {rank} of world size {world}" in message
        assert "backend gloo" in message
        assert "rendezvous tcp://127.0.0.1:" in message
        assert "process group not ready after" in message
        assert r.get("later", False) is False  # rank 0 has no later read; the others: torch's


def test_unreachable_rendezvous_is_named(ranks) -> None:
    (r,), _ = ranks("absent_peer", 2, ranks=[1], timeout=3.0)
    assert r["error"] == "InitTimeoutError"
    assert "is not reachable" in r["message"]
    assert "check the address" in r["message"]


def test_a_rank_master_waiting_for_peers_says_so(ranks) -> None:
    (r,), _ = ranks("absent_peer", 2, ranks=[0], timeout=3.0)
    assert "accepts connections, so a peer has not joined yet" in r["message"]


def test_a_poll_before_the_deadline_says_how_long_is_left_and_probes_nothing(ranks) -> None:
    """wait(0) probed the rendezvous over TCP at each poll (up to 0.5 s each where the host does
    not answer) and said a peer had not joined, as if the init had timed out."""
    (r,), _ = ranks("poll_pending", 2, ranks=[0], timeout=3.0)
    assert len(r["polls"]) == 3
    for message in r["polls"]:
        assert "rank 0 of world size 2" in message
        assert "still pending" in message
        assert "s before its deadline" in message
        assert "accepts connections" not in message  # no probe
    assert "accepts connections, so a peer has not joined yet" in r["deadline"]


def test_a_retry_after_a_timeout_says_the_first_init_still_runs(ranks) -> None:
    (r,), _ = ranks("retry_after_timeout", 2, ranks=[1], timeout=2.0)
    assert "timed out after 2.0s but is still running in torch" in r["retry"]
    assert "pass timeout= to bound torch's own wait" in r["retry"]
    assert "mccl.pending().wait()" not in r["retry"]  # that wait would raise at once


def test_rank_and_world_size_given_need_no_environment(ranks) -> None:
    (r,), _ = ranks("bad_rank_env", 1)
    assert r["handle"] == "<mccl.InitHandle gloo rank 0/1 done>"


def test_exception_inside_init_surfaces_at_wait(ranks) -> None:
    (r,), _ = ranks("init_error", 1)
    assert r["message"].startswith("background init_process_group failed (backend gloo")
    assert "RuntimeError: No rendezvous handler for nosuchscheme://" in r["message"]
    assert r["cause"] == "RuntimeError"
    assert r["cause_traceback_has_torch"]
    assert r["handle_exception"] == "RuntimeError"
    assert r["is_initialized"] is False


def test_a_failure_before_anything_waits_reaches_the_first_call(ranks) -> None:
    """The failed init removed the guard at once: the rank's first collective then said only
    that the default group was not initialized, and the init's own error was lost."""
    (r,), _ = ranks("init_error_unwaited", 1)
    assert r["guard_kept"] is True
    assert r["first"].startswith("InitFailedError: background init_process_group failed")
    assert "No rendezvous handler for nosuchscheme://" in r["first"]
    assert r["cause"] == "RuntimeError"
    assert r["then_initialized"] is False
    assert r["guard_after"] is False
    assert r["polled"] == "RuntimeError"
    assert r["retried"] is True


def test_wait_returns_the_group_this_init_created(ranks) -> None:
    """wait() returned the default group of the moment: None after destroy_process_group(),
    and an unrelated group started later."""
    (r,), _ = ranks("wait_after_destroy", 1)
    assert r["first"] is True
    for later in (r["after_destroy"], r["after_another_init"]):
        assert later.startswith("the process group this init created (backend gloo, rank 0")
        assert "has been destroyed" in later


def test_double_init_is_a_clear_error(ranks) -> None:
    results, _ = ranks("double_init", 2)
    for r in results:
        assert "already pending" in r["second"]
        assert r["third"].startswith(
            "ValueError: trying to initialize the default process group twice!"
        )
        assert "torch.distributed.destroy_process_group() first" in r["third"]


def test_destroy_while_pending(ranks) -> None:
    results, _ = ranks("destroy_pending", 2)
    assert results == [{"is_initialized": False, "pending": False}] * 2


def test_process_exit_while_pending_does_not_hang(ranks) -> None:
    (r,), elapsed = ranks("exit_pending", 2, ranks=[0], timeout=600)
    assert r == {"exited_while_pending": True}
    assert elapsed < 30


def run_alone(scenario: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Rank 0 of 2 on its own (its init stays pending), with a hard timeout."""
    worker = Path(__file__).with_name("worker.py")
    command = [sys.executable, str(worker), scenario, "0", "2", str(free_port()), "600"]
    env = dict(os.environ, TMPDIR=str(tmp_path))
    return subprocess.run(
        command, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env
    )


def test_ctrl_c_while_pending_ends_the_process_by_sigint(tmp_path) -> None:
    """As CPython ends a program on an uncaught KeyboardInterrupt (a shell reports 130), not
    with status 1."""
    done = run_alone("interrupted_pending", tmp_path)
    assert json.loads(done.stdout) == {"pending": True}
    assert "KeyboardInterrupt" in done.stderr
    assert done.returncode == -signal.SIGINT


def test_exit_handlers_run_when_exiting_while_pending(tmp_path) -> None:
    """The process ended in mccl's exit handler, skipping those registered before it."""
    done = run_alone("exit_handlers_pending", tmp_path)
    result, *after = done.stdout.splitlines()
    found = json.loads(result)
    assert found["registered_before_mccl"]
    assert after == ["exit handler ran"]
    assert not Path(found["directory"]).exists()
    assert done.returncode == 0


def test_a_failed_init_nothing_was_told_of_is_printed_at_exit(tmp_path) -> None:
    """It was lost: the program exited 0 and printed nothing (plain torch raises at the call)."""
    done = run_alone("init_error_untold", tmp_path)
    assert json.loads(done.stdout) == {"done": True}
    assert done.returncode == 0
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("mccl: warning:")]
    assert "failed and the program never waited" in line
    assert "nosuchscheme" in line


def test_exit_handlers_use_the_group_before_mccl_destroys_it(ranks) -> None:
    """mccl destroyed the group from its own exit handler, before those registered earlier:
    ``atexit.register(dist.destroy_process_group)`` then printed "Exception ignored in atexit
    callback ... Process group cannot be None" at every exit."""
    results, _ = ranks("exit_handler_uses_group", 2)
    assert results == [{"registered_before_mccl": True, "rank_at_exit": r} for r in (0, 1)]


@pytest.mark.parametrize(
    ("scenario", "status"),
    [
        ("sys_exit_pending", 3),
        ("sys_exit_message_pending", 1),
        ("builtin_exit_pending", 3),  # 0: only sys.exit was noted
        ("caught_sys_exit_pending", 0),
        ("converted_sys_exit_pending", 0),  # 2: the ValueError's raise was taken for a re-raise
        ("handler_sys_exit_pending", 3),  # 0: read after the handlers ran
        ("huge_sys_exit_pending", 255),  # 0: 2**63 & 0xFF
    ],
)
def test_the_exit_status_survives_exiting_while_pending(tmp_path, scenario, status) -> None:
    """mccl ended the process with status 0 whatever sys.exit() asked for."""
    done = run_alone(scenario, tmp_path)
    assert done.returncode == status, done.stderr
    if scenario == "sys_exit_message_pending":
        assert done.stderr.endswith("fatal: bad config\n")


def test_a_spawned_child_that_raises_while_pending_fails(ranks) -> None:
    """It exited 0, so multiprocessing and torch.multiprocessing.spawn reported success."""
    (r,), _ = ranks("spawned_raise_pending", 2, ranks=[0], timeout=600)
    assert r == {"exitcode": 1}


def test_a_child_forked_while_pending_does_not_wait_for_the_init(ranks) -> None:
    """It waited for the parent's init, whose thread a fork does not copy: until the timeout."""
    (r,), _ = ranks("fork_pending", 2, ranks=[0], timeout=30.0)
    assert r == {"child_exit": 0, "pending": True}


@pytest.mark.parametrize(
    ("backend", "unknown", "hint"),
    [("glooo", "glooo", "did you mean 'gloo'?"), ("cpu:glo,cuda:nccl", "glo", "did you mean")],
)
def test_an_unknown_backend_is_refused_at_the_call(backend, unknown, hint) -> None:
    """It was found by the background init and raised only at the first wait, as torch's
    ``AssertionError: Unknown backend type``."""
    import mccl

    with pytest.raises(ValueError, match=f"unknown process-group backend {unknown!r}") as e:
        mccl.init_process_group_async(
            backend, init_method="tcp://127.0.0.1:9", rank=0, world_size=1
        )
    assert hint in str(e.value)
    assert mccl.init._pending is None


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (
            {"timeout": 30, "rank": 0, "world_size": 1},
            TypeError,
            "timeout must be a datetime.timedelta, .* got 30; init_timeout= takes seconds",
        ),
        (
            {"init_method": "tcp://127.0.0.1:9", "rank": 0, "world_size": 1},
            ValueError,
            "pass init_method= or store=, not both",
        ),
        ({"rank": 0}, ValueError, "store= needs world_size= > 0, got None"),
        ({"rank": -1, "world_size": 1}, ValueError, "store= needs rank= >= 0, got -1"),
    ],
)
def test_argument_errors_are_refused_at_the_call(options, error, message) -> None:
    """torch raises them before any rendezvous; mccl accepted them and the first wait raised
    ``InitFailedError`` from torch's ``TypeError`` or ``AssertionError``."""
    import torch.distributed as dist

    import mccl

    with pytest.raises(error, match=message):
        mccl.init_process_group_async("gloo", store=dist.HashStore(), **options)
    assert mccl.init._pending is None
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("options", "unset"),
    [
        ({}, "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"),
        ({"rank": 0, "world_size": 1}, "MASTER_ADDR, MASTER_PORT"),
        ({"init_method": "env://", "rank": 0, "world_size": 1}, "MASTER_ADDR, MASTER_PORT"),
    ],
)
def test_env_rendezvous_without_its_variables_is_refused_at_the_call(
    monkeypatch, options, unset
) -> None:
    """A script started without torchrun: torch's env:// raises at once; mccl returned, and
    the first read of the group, maybe minutes later, raised ``InitFailedError``."""
    import torch.distributed as dist

    import mccl

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "")  # set but empty: as good as unset
    message = f"rendezvous .* needs {unset} in the environment, which are not set \\(or empty\\)"
    with pytest.raises(ValueError, match=message):
        mccl.init_process_group_async("gloo", **options)
    assert mccl.init._pending is None
    assert not dist.is_initialized()


@pytest.mark.parametrize("spelling", ["file:///path", "file:/path"])
def test_a_file_rendezvous_in_a_missing_directory_is_refused_at_the_call(
    tmp_path, spelling
) -> None:
    """torch's FileStore retries opening the file for its own 5 minutes (whatever timeout=
    says) while holding the GIL: mccl's call did not return, and the whole process froze.
    ``file:/path``, which torch's rendezvous takes as ``file:///path``, froze it too."""
    missing = tmp_path / "missing" / "store"
    url = missing.as_uri() if spelling == "file:///path" else f"file:{missing}"
    code = (
        "import mccl\n"
        "try:\n"
        f"    mccl.init_process_group_async('gloo', init_method={url!r}, "
        "rank=0, world_size=1)\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
        "print('pending:', mccl.init._pending)\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=tmp_path
        )
    except subprocess.TimeoutExpired:
        pytest.fail("init_process_group_async froze the process", pytrace=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"the file:// rendezvous {url} is in a directory that does not exist "
        f"({missing.parent}): create it, or choose a file in an existing one",
        "pending: None",
    ]


_RENDEZVOUS_ENV = {
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "RANK": "0",
    "WORLD_SIZE": "1",
}


@pytest.mark.parametrize(
    ("env", "options", "message"),
    [
        (
            {"MASTER_PORT": "abc"},
            {},
            "MASTER_PORT='abc' in the environment is not an integer, .*: set it to the port",
        ),
        ({"MASTER_PORT": "70000"}, {}, r"MASTER_PORT='70000' .* not a port number \(1..65535\)"),
        ({"MASTER_PORT": "0"}, {}, r"MASTER_PORT='0' .* not a port number \(1..65535\)"),
        (
            {"RANK": "zero"},
            {},
            "RANK='zero' in the environment is not an integer, .*: set it to this process's "
            "rank, or pass rank=",
        ),
        ({"WORLD_SIZE": "two"}, {}, "WORLD_SIZE='two' in the environment is not an integer"),
        (
            {"RANK": "3", "WORLD_SIZE": "2"},
            {},
            r"rank 3 \(RANK in the environment\) must be in 0..1 for world size 2 \(WORLD_SIZE",
        ),
        ({"WORLD_SIZE": "0"}, {}, r"world size 0 \(WORLD_SIZE in the environment\) must be > 0"),
        (
            {"RANK": "5"},
            {"world_size": 2},
            r"rank 5 \(RANK in .*\) .* world size 2 \(world_size=\)",
        ),
        (
            {},
            {"init_method": "tcp://127.0.0.1:29500"},
            r"the tcp:// rendezvous 'tcp://127.0.0.1:29500' needs rank and world_size: pass "
            r"rank= and world_size=, or put them in its query",
        ),
        (
            {},
            {"init_method": "tcp://127.0.0.1:29500", "rank": 0},
            "the tcp:// rendezvous .* needs rank and world_size",
        ),
        (
            {},
            {"init_method": "tcp://127.0.0.1:29500?rank=0&world_size=1", "rank": 0},
            "has rank or world_size in its query, and rank= or world_size= is given too",
        ),
        (
            {},
            {"init_method": "tcp://127.0.0.1:29500?rank=x&world_size=1"},
            "rank='x' in the query of init_method .* is not an integer",
        ),
        (
            {},
            {"init_method": "tcp://127.0.0.1:29500", "rank": 2, "world_size": 2},
            r"rank 2 \(rank=\) must be in 0..1 for world size 2 \(world_size=\)",
        ),
        (
            {},
            {"init_method": "tcp://127.0.0.1", "rank": 0, "world_size": 1},
            r"the tcp:// rendezvous 'tcp://127.0.0.1' needs a host and a port \(1..65535\)",
        ),
    ],
)
def test_a_malformed_rendezvous_is_refused_at_the_call(monkeypatch, env, options, message) -> None:
    """The environment was only checked to be set, and tcp:// not at all: the first wait,
    maybe minutes later, raised ``InitFailedError`` from torch's ``int()`` or "rank parameter
    missing", naming no variable, and the handle said rank -1."""
    import torch.distributed as dist

    import mccl

    for name, value in {**_RENDEZVOUS_ENV, **env}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        mccl.init_process_group_async("gloo", init_timeout=5, **options)
    assert mccl.init._pending is None
    assert not mccl.guard_installed()
    assert not dist.is_initialized()


def test_the_handle_reads_rank_and_world_size_from_the_query() -> None:
    """A tcp:// query's rank and world size were reported as -1 (only the keywords were read)."""
    import torch.distributed as dist

    import mccl

    url = f"tcp://127.0.0.1:{free_port()}?rank=0&world_size=1"
    handle = mccl.init_process_group_async("gloo", init_method=url, init_timeout=30)
    try:
        assert (handle.rank, handle.world_size) == (0, 1)
        assert handle.wait() is dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (
            {"rank": 0, "world_size": None},
            TypeError,
            "world_size= must be an int, got None: pass the number of processes",
        ),
        ({"rank": "0", "world_size": 1}, TypeError, "rank= must be an int, got '0'"),
        (
            {"rank": 0, "world_size": 1, "init_timeout": "abc"},
            TypeError,
            r"init_timeout must be a number of seconds > 0 or a datetime.timedelta, got 'abc' "
            r"\(str\)",
        ),
        ({"rank": 0, "world_size": 1, "init_timeout": "30"}, TypeError, "got '30' \\(str\\)"),
        ({"rank": 0, "world_size": 1, "init_timeout": True}, TypeError, "got True \\(bool\\)"),
    ],
)
def test_wrong_types_name_the_argument(options, error, message) -> None:
    """``world_size=None`` raised "'>' not supported between instances of 'NoneType' and
    'int'", ``init_timeout="abc"`` "could not convert string to float", and ``"30"`` was
    taken as 30 s."""
    import torch.distributed as dist

    import mccl

    with pytest.raises(error, match=message):
        mccl.init_process_group_async("gloo", store=dist.HashStore(), **options)
    assert mccl.init._pending is None
    assert not dist.is_initialized()


@pytest.mark.parametrize("limit", [5, 2.5, datetime.timedelta(seconds=5)])
def test_init_timeout_takes_seconds_or_a_timedelta(limit) -> None:
    import torch.distributed as dist

    import mccl

    handle = mccl.init_process_group_async(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, init_timeout=limit
    )
    try:
        handle.wait()
        seconds = limit.total_seconds() if isinstance(limit, datetime.timedelta) else limit
        assert handle.init_timeout == seconds
    finally:
        dist.destroy_process_group()
