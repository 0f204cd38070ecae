from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spore.doctor import describe_warmup
from spore.runtime import (
    APPLIED_MARKER,
    GLIBC_TUNED,
    JEMALLOC_CONF,
    RuntimeConfigError,
    allocator_in_use,
    cpu_env,
    cpu_plan,
    find_library,
    system_env,
    usable_cores,
)

CLEAN = {"PATH": "/usr/bin:/bin", "HOME": "/root"}


def test_tuned_plan_sets_glibc_tunables_and_threads() -> None:
    plan = cpu_plan(allocator="tuned", base_env=CLEAN)
    cores = len(usable_cores())
    assert plan.allocator == "tuned"
    assert plan.threads == cores
    for key, value in GLIBC_TUNED.items():
        assert plan.env[key] == value
        assert plan.set[key] == value
    assert plan.env["OMP_NUM_THREADS"] == str(cores)
    assert plan.env["MKL_NUM_THREADS"] == str(cores)
    assert plan.env["GLIBC_TUNABLES"] == "glibc.malloc.tcache_max=0"
    assert plan.env[APPLIED_MARKER] == "tuned"
    assert plan.env["PATH"] == CLEAN["PATH"]
    assert plan.kept == {}
    assert allocator_in_use(plan.env) == "tuned"


def test_user_settings_are_kept_and_reported() -> None:
    base = dict(CLEAN, MALLOC_TOP_PAD_="1", OMP_NUM_THREADS=str(len(usable_cores())))
    plan = cpu_plan(allocator="tuned", base_env=base)
    assert plan.env["MALLOC_TOP_PAD_"] == "1"
    assert plan.kept == {"MALLOC_TOP_PAD_": (GLIBC_TUNED["MALLOC_TOP_PAD_"], "1")}
    assert "OMP_NUM_THREADS" not in plan.set
    assert "kept your MALLOC_TOP_PAD_=1 (spore would set 536870912)" in plan.describe()
    assert allocator_in_use(plan.env) == "custom"


def test_the_users_omp_num_threads_is_the_thread_count() -> None:
    """Kept, it was reported as the planned count while MKL got that one."""
    plan = cpu_plan(allocator="tuned", base_env=dict(CLEAN, OMP_NUM_THREADS="1"))
    assert plan.threads == 1
    assert plan.env["OMP_NUM_THREADS"] == plan.env["MKL_NUM_THREADS"] == "1"
    assert plan.kept == {}
    for junk in ("0", "two", " "):
        plan = cpu_plan(allocator="tuned", base_env=dict(CLEAN, OMP_NUM_THREADS=junk))
        assert plan.threads == len(usable_cores())


def test_threads_asked_for_replace_the_users_omp_num_threads() -> None:
    """They were kept while the plan reported the count asked for."""
    plan = cpu_plan(allocator="tuned", threads=2, base_env=dict(CLEAN, OMP_NUM_THREADS="5"))
    assert plan.threads == 2
    assert plan.env["OMP_NUM_THREADS"] == plan.env["MKL_NUM_THREADS"] == "2"
    assert plan.kept == {}
    assert plan.replaced == {"OMP_NUM_THREADS": ("2", "5")}
    assert "set OMP_NUM_THREADS=2 (your 5 replaced: threads were asked for)" in plan.describe()
    assert "set MKL_NUM_THREADS=2" in plan.describe()
    same = cpu_plan(allocator="tuned", threads=5, base_env=dict(CLEAN, OMP_NUM_THREADS="5"))
    assert same.replaced == {}
    assert "OMP_NUM_THREADS" not in same.set


def test_tuned_tunables_join_the_users_glibc_tunables() -> None:
    base = dict(CLEAN, GLIBC_TUNABLES="glibc.cpu.hwcaps=-AVX512F")
    plan = cpu_plan(allocator="tuned", base_env=base)
    assert plan.env["GLIBC_TUNABLES"] == "glibc.cpu.hwcaps=-AVX512F:glibc.malloc.tcache_max=0"
    assert plan.set["GLIBC_TUNABLES"] == plan.env["GLIBC_TUNABLES"]
    assert allocator_in_use(plan.env) == "tuned"
    assert system_env(plan.env)["GLIBC_TUNABLES"] == "glibc.cpu.hwcaps=-AVX512F"
    theirs = "glibc.malloc.tcache_max=1024:glibc.malloc.hugetlb=1"
    plan = cpu_plan(allocator="tuned", base_env=dict(CLEAN, GLIBC_TUNABLES=theirs))
    assert plan.env["GLIBC_TUNABLES"] == theirs
    ours = "glibc.malloc.tcache_max=0:glibc.malloc.hugetlb=1"
    assert plan.kept == {"GLIBC_TUNABLES": (ours, theirs)}
    assert allocator_in_use(plan.env) == "custom"
    assert "GLIBC_TUNABLES" not in system_env(plan.env)
    assert allocator_in_use(dict(CLEAN, GLIBC_TUNABLES=theirs)) == "custom"


def test_system_changes_no_allocator_variable() -> None:
    plan = cpu_plan(allocator="system", threads=1, base_env=CLEAN)
    assert set(plan.set) == {"OMP_NUM_THREADS", "MKL_NUM_THREADS"}
    assert allocator_in_use(plan.env) == "system"
    assert system_env(dict(CLEAN, MALLOC_TOP_PAD_="1", **{APPLIED_MARKER: "x"})) == CLEAN
    preloaded = dict(CLEAN, LD_PRELOAD="/lib/libtcmalloc.so.4:/x/libother.so")
    assert system_env(preloaded) == dict(CLEAN, LD_PRELOAD="/x/libother.so")
    assert system_env(dict(CLEAN, LD_PRELOAD="/lib/libjemalloc.so.2")) == CLEAN


def test_ranks_split_cores_and_pin_with_affinity() -> None:
    cores = usable_cores()
    share = max(1, len(cores) // 2)
    last = cpu_plan(allocator="system", ranks=2, rank=1, affinity=True, base_env=CLEAN)
    assert last.threads == share
    expected = [cores[(share + i) % len(cores)] for i in range(share)]
    assert last.cores == expected
    assert last.env["OMP_PLACES"] == ",".join(f"{{{c}}}" for c in expected)
    assert last.env["OMP_PROC_BIND"] == "close"
    first = cpu_plan(allocator="system", ranks=2, rank=0, affinity=True, base_env=CLEAN)
    if len(cores) >= 2:
        assert set(first.cores).isdisjoint(last.cores)
    assert "OMP_PLACES" not in cpu_plan(allocator="system", ranks=2, base_env=CLEAN).env


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"allocator": "mimalloc"}, "unknown allocator 'mimalloc'"),
        ({"ranks": 2, "rank": 2}, "rank 2 of 2 ranks"),
        ({"threads": 0}, "threads must be >= 1"),
        ({"threads": 2.5}, "threads must be an int, got 2.5"),
        ({"threads": True}, "threads must be an int, got True"),
        ({"ranks": "2"}, "ranks must be an int, got '2'"),
    ],
)
def test_bad_settings_are_clear_errors(kwargs, message) -> None:
    with pytest.raises(RuntimeConfigError, match=message):
        cpu_plan(base_env=CLEAN, **kwargs)


@pytest.mark.parametrize("allocator", ["jemalloc", "tcmalloc"])
def test_preloaded_allocators_follow_what_is_installed(allocator) -> None:
    path = find_library(allocator)
    if path is None:
        with pytest.raises(RuntimeConfigError, match="apt-get install"):
            cpu_plan(allocator=allocator, base_env=CLEAN)
        return
    plan = cpu_plan(allocator=allocator, base_env=dict(CLEAN, LD_PRELOAD="/x/libother.so"))
    assert plan.env["LD_PRELOAD"] == f"{path}:/x/libother.so"
    assert allocator_in_use(plan.env) == allocator
    assert (plan.env.get("MALLOC_CONF") == JEMALLOC_CONF) == (allocator == "jemalloc")


def test_auto_prefers_tcmalloc_else_tuned() -> None:
    expected = "tcmalloc" if find_library("tcmalloc") else "tuned"
    assert cpu_plan(base_env=CLEAN).allocator == expected
    assert cpu_env(base_env=CLEAN)[APPLIED_MARKER] == expected


ENV_DUMP = "import json, os; print(json.dumps(dict(os.environ)))"


def test_spore_run_sets_the_child_environment(run_spore) -> None:
    out = run_spore(
        "run",
        "--allocator",
        "tuned",
        "--threads",
        "1",
        "--",
        sys.executable,
        "-c",
        ENV_DUMP,
        env={"MALLOC_TOP_PAD_": "4096"},
    )
    assert out.returncode == 0, out.stderr
    child = json.loads(out.stdout)
    assert child["MALLOC_MMAP_THRESHOLD_"] == GLIBC_TUNED["MALLOC_MMAP_THRESHOLD_"]
    assert child["MALLOC_TOP_PAD_"] == "4096"
    assert child["OMP_NUM_THREADS"] == "1"
    assert "kept your MALLOC_TOP_PAD_=4096" in out.stderr
    assert "set MALLOC_MMAP_THRESHOLD_=4294967296" in out.stderr
    quiet = run_spore("run", "-q", "--", sys.executable, "-c", "pass")
    assert quiet.stderr == ""


def test_spore_run_exit_codes(run_spore) -> None:
    assert run_spore("run", "--", sys.executable, "-c", "raise SystemExit(3)").returncode == 3
    assert run_spore("run").returncode == 2
    empty = run_spore("run", "-q", "--", "")  # a traceback (execve's ValueError) before
    assert empty.returncode == 2
    assert "the command is empty" in empty.stderr
    assert "Traceback" not in empty.stderr
    typo = run_spore("run", "--thread", "2", "--", "true")  # ran '--thread' as the command
    assert typo.returncode == 2
    assert "No such option '--thread'. Did you mean '--threads'?" in typo.stderr


def _script(path, first_line, mode):
    path.write_text(f"{first_line}\necho ran\n")
    path.chmod(mode)
    return str(path)


def _no_loader(path):
    """A copy of /bin/true whose ELF loader path names no file (it was said to be a missing
    #! interpreter)."""
    binary = Path("/bin/true").resolve().read_bytes()
    loader = re.search(rb"/lib[^\0]*ld-linux[^\0]*\.so\.\d", binary).group()
    path.write_bytes(binary.replace(loader, loader[:-1] + b"9"))
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize(
    ("make", "reason", "status"),
    [
        (lambda tmp: "no-such-command-here", "command not found", 127),
        (lambda tmp: str(tmp / "missing"), "no such file", 127),
        (lambda tmp: str(tmp), "it is a directory", 126),
        (lambda tmp: _script(tmp / "plain.sh", "#!/bin/sh", 0o644), "Permission denied", 126),
        (
            lambda tmp: _script(tmp / "bad.sh", "#!/no/such/shell", 0o755),
            "the interpreter its #! line names was not found",
            127,
        ),
        (
            lambda tmp: _no_loader(tmp / "badelf"),
            "a file it requires (its loader) was not found",
            127,
        ),
    ],
    ids=["not-found", "no-file", "directory", "not-executable", "bad-interpreter", "no-loader"],
)
def test_spore_run_says_why_a_command_did_not_start_with_the_shells_status(
    tmp_path, make, reason, status
) -> None:
    """A command not found exited 1 (shells: 127), one that cannot run 1 too (shells: 126),
    and a directory was "Permission denied". In process: a child would run the installed
    spore (every command here fails to start, so none replaces the test's process)."""
    from click.testing import CliRunner

    from spore.cli.run import run_cmd

    command = make(tmp_path)
    result = CliRunner().invoke(run_cmd, ["-q", "--", command])
    assert result.exit_code == status, result.output
    assert f"Error: cannot run {command!r}: {reason}\n" in result.output


def test_tuned_child_stops_page_faulting_on_fresh_tensors(run_spore) -> None:
    """glibc really honours the settings in the child: steady-state fresh 128 MiB tensors."""
    figures = {}
    for allocator in ("system", "tuned"):
        out = run_spore(
            "run",
            "-q",
            "--allocator",
            allocator,
            "--",
            sys.executable,
            "-m",
            "spore._workloads",
            "fresh",
            "--iters",
            "3",
        )
        assert out.returncode == 0, out.stderr
        figures[allocator] = json.loads(out.stdout)
    assert figures["system"]["faults_per_iter"] > 30000  # 128 MiB / 4 KiB pages = 32768
    assert figures["tuned"]["faults_per_iter"] < 100


def test_bench_restarts_itself_under_the_chosen_allocator(run_spore) -> None:
    for allocator in ("tuned", "system"):
        out = run_spore(
            "bench",
            "healthy",
            "--json",
            "--repeat",
            "1",
            "--min-time",
            "0",
            "--allocator",
            allocator,
            plugins=("healthy",),
        )
        assert out.returncode == 0, out.stderr
        settings = json.loads(out.stdout)["settings"]
        assert settings["allocator"] == allocator
        assert settings["environment"][APPLIED_MARKER] == allocator
        assert f"spore bench: allocator {allocator}" in out.stderr


def test_core_allocator_benchmark_compares_children(run_spore) -> None:
    out = run_spore("bench", "core", "-k", "rmsnorm", "--repeat", "1", "--json")
    assert out.returncode == 0, out.stderr
    (result,) = json.loads(out.stdout)["results"]
    assert result["error"] is None
    assert result["ratio"] > 0
    extras = result["extras"]
    assert extras["baseline"]["faults_per_iter"] > 10 * extras["candidate"]["faults_per_iter"]
    assert extras["candidate"]["rss_mib"] > 0


def test_doctor_measures_the_allocation_penalty(run_spore) -> None:
    plain = run_spore("doctor", "--json", env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    checks = {c["name"]: c for c in json.loads(plain.stdout)["checks"]}
    assert "a fresh 128 MiB tensor costs" in checks["allocator"]["detail"]
    assert checks["allocator"]["detail"].startswith("allocator custom")
    tuned = run_spore(
        "run", "-q", "--allocator", "tuned", "--", sys.executable, "-m", "spore", "doctor", "--json"
    )
    checks = {c["name"]: c for c in json.loads(tuned.stdout)["checks"]}
    assert checks["allocator"]["status"] == "ok", checks["allocator"]
    assert checks["allocator"]["detail"].startswith("allocator tuned")


WARMUP = "import json; from spore.doctor import clone_warmup; print(json.dumps(clone_warmup(12)))"


def test_tuned_child_reuses_freed_blocks_from_the_second_clone(run_spore) -> None:
    """Only the first of 12 clones of a 128 MiB tensor touches new pages under ``tuned``.

    With glibc's tcache on, the slivers ``posix_memalign`` cuts off each block sit in the tcache
    and keep the freed block from merging, so the next clone took fresh heap pages (32768 faults)
    for about 7 clones before the blocks coalesced.
    """
    out = run_spore("run", "-q", "--allocator", "tuned", "--", sys.executable, "-c", WARMUP)
    assert out.returncode == 0, out.stderr
    faults = json.loads(out.stdout)["faults"]
    assert faults[0] > 30000, faults  # the first clone: 128 MiB / 4 KiB = 32768 new pages
    assert max(faults[1:]) < 1000, faults


def test_doctor_describes_the_warmup_of_a_new_process() -> None:
    settled, ok = describe_warmup({"faults": [32783, 0, 2, 0], "ms": [250.0, 30.0, 31.0, 29.0]})
    assert ok
    assert "first of 4 clones of a 128 MiB tensor page-faults 32783 times (250 ms)" in settled
    assert "clones 2-4 take no new pages (2 faults, at most 31 ms each)" in settled
    before_fix = {"faults": [32783, 0, 32768, 32768, 0], "ms": [250.0, 30.0, 240.0, 190.0, 30.0]}
    warming, ok = describe_warmup(before_fix)
    assert not ok
    assert "2 of clones 2-5 take new pages too (the last: clone 4; at most 240 ms each)" in warming


def test_restart_tuned_reruns_a_script_once_under_the_plan(tmp_path) -> None:
    script = tmp_path / "tool.py"
    script.write_text(
        "import os, sys\n"
        "from spore import runtime\n"
        "print('start', flush=True)\n"
        "runtime.restart_tuned()\n"
        "print(os.environ[runtime.APPLIED_MARKER], sys.argv[1:])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != APPLIED_MARKER}

    def run(extra: dict[str, str]) -> list[str]:
        done = subprocess.run(
            [sys.executable, str(script), "--flag"],
            env=env | extra,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return done.stdout.splitlines()

    planned = cpu_plan(base_env=env).env[APPLIED_MARKER]
    assert run({}) == ["start", "start", f"{planned} ['--flag']"]  # once, arguments kept
    assert run({APPLIED_MARKER: "system"}) == ["start", "system ['--flag']"]  # already planned
    # the interpreter's own options and -m: the command line as started, not sys.argv
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "tool.py").write_text(
        "import sys\nfrom spore import runtime\nruntime.restart_tuned()\n"
        "from . import __name__ as parent\nprint(parent, sys.flags.optimize, sys.argv[1:])\n"
    )
    done = subprocess.run(
        [sys.executable, "-O", "-m", "pkg.tool", "--flag"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stdout) == (0, "pkg 1 ['--flag']\n"), done.stderr
