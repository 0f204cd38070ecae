from __future__ import annotations

import sys
import time

import pytest

from spore import childproc


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_run_json_returns_the_last_json_object() -> None:
    code = "print('starting'); print('{\"a\": 1}'); print('{\"b\": 2}'); print('done')"
    assert childproc.run_json(_python(code), timeout=60) == {"b": 2}


def test_environment_and_cwd_reach_the_child(tmp_path) -> None:
    code = "import json, os; print(json.dumps({'v': os.environ['X_CHILD'], 'cwd': os.getcwd()}))"
    got = childproc.run_json(_python(code), timeout=60, env={"X_CHILD": "7"}, cwd=tmp_path)
    assert got == {"v": "7", "cwd": str(tmp_path)}


def test_a_failing_child_names_command_status_and_stderr() -> None:
    code = "import sys; print('{}'); sys.stderr.write('boom: the cause\\n'); sys.exit(3)"
    with pytest.raises(childproc.ChildError, match="exited with status 3") as info:
        childproc.run_json(_python(code), timeout=60)
    assert info.value.returncode == 3
    assert "boom: the cause" in str(info.value)
    assert sys.executable in str(info.value)


def test_a_child_without_json_is_an_error() -> None:
    with pytest.raises(childproc.ChildError, match="printed no JSON object; its stdout: hello"):
        childproc.run_json(_python("print('hello')"), timeout=60)


def test_a_child_past_its_timeout_is_killed_with_its_output_shown() -> None:
    code = "import time; print('partial', flush=True); time.sleep(60)"
    start = time.monotonic()
    with pytest.raises(childproc.ChildError, match=r"did not finish within 1s") as info:
        childproc.run_json(_python(code), timeout=1)
    assert time.monotonic() - start < 30
    assert info.value.timed_out
    assert "partial" in str(info.value)


def test_a_timeout_also_kills_the_childs_children() -> None:
    # The grandchild holds the stdout pipe: killing only the child would leave it open.
    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "time.sleep(120)\n"
    )
    start = time.monotonic()
    with pytest.raises(childproc.ChildError, match="did not finish within 1s"):
        childproc.run(_python(code), timeout=1)
    assert time.monotonic() - start < 30


def test_run_without_check_returns_the_failed_process() -> None:
    done = childproc.run(_python("print('out'); raise SystemExit(4)"), timeout=60, check=False)
    assert (done.returncode, done.stdout) == (4, "out\n")


def test_run_json_all_runs_the_children_at_once(tmp_path) -> None:
    # Each child waits for the other's file: run one after the other, both would time out.
    code = (
        "import json, os, sys, time\n"
        "me, other = sys.argv[1:]\n"
        "open(me, 'w').close()\n"
        "deadline = time.monotonic() + 20\n"
        "while not os.path.exists(other) and time.monotonic() < deadline: time.sleep(0.05)\n"
        "print(json.dumps({'me': os.path.basename(me), 'met': os.path.exists(other)}))\n"
    )
    results = childproc.run_json_all(
        [[*_python(code), "a", "b"], [*_python(code), "b", "a"]], timeout=120, cwd=tmp_path
    )
    assert results == [{"me": "a", "met": True}, {"me": "b", "met": True}]


def test_run_json_all_kills_the_others_when_one_fails() -> None:
    sleeper = _python("import time; time.sleep(600)")
    start = time.monotonic()
    with pytest.raises(childproc.ChildError, match="exited with status 1"):
        childproc.run_json_all([_python("raise SystemExit(1)"), sleeper], timeout=120)
    assert time.monotonic() - start < 60


def test_run_json_all_reports_the_child_that_failed_while_the_others_wait() -> None:
    """A rank that fails while rank 0 waits for it: the group waited out its whole timeout
    and reported rank 0's timeout, never rank 1's error."""
    start = time.monotonic()
    with pytest.raises(childproc.ChildError, match="rank 1: bad config"):
        childproc.run_json_all(
            [
                _python("import time; time.sleep(600)"),
                _python("raise SystemExit('rank 1: bad config')"),
            ],
            timeout=60,
        )
    assert time.monotonic() - start < 30


def test_start_json_collects_later() -> None:
    with childproc.start_json(_python("print('{\"ready\": true}')")) as child:
        assert child.pid > 0
        assert child.result(60) == {"ready": True}
