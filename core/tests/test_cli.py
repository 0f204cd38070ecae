from __future__ import annotations

import io
import json
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner
from rich.console import Console

import spore
from spore import childproc
from spore.cli.render import Column, styled, table
from spore.testing import clean_environ


def test_version(run_spore) -> None:
    out = run_spore("--version")
    assert out.returncode == 0
    assert out.stdout == f"spore-core {spore.__version__}\n"


def test_version_verbose_lists_plugins_without_importing_them(run_spore, tmp_path) -> None:
    log = tmp_path / "imports.log"
    out = run_spore(
        "--version",
        "--verbose",
        plugins=("healthy", "future"),
        env={"SPORE_FIXTURE_IMPORT_LOG": str(log)},
    )
    assert out.returncode == 0, out.stderr
    assert "healthy spore-fixture-healthy 1.0.0 [selected]" in out.stdout
    assert "future spore-fixture-future 2.0.0 [incompatible]" in out.stdout
    assert "torch 2.13" in out.stdout
    assert not log.exists()


@pytest.mark.core_alone
def test_plugins_json_statuses_and_registrations(run_spore) -> None:
    # noeol prints at import without ending its line: the probe's JSON still reads
    out = run_spore("plugins", "--json", plugins=("healthy", "broken", "future", "noeol"))
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert set(rows) == {"healthy", "broken", "future", "noeol"}
    assert rows["noeol"]["status"] == "active"
    assert rows["healthy"]["status"] == "active"
    assert rows["healthy"]["registered"] == {
        "ops": ["fixture_identity"],
        "benchmarks": ["sleep"],
        "commands": ["hello"],
    }
    assert rows["broken"]["status"] == "failed"
    assert "libspore_fixture.so" in rows["broken"]["reason"]
    assert rows["future"]["status"] == "incompatible"


def test_an_unknown_command_names_the_plugins_that_did_not_load(run_spore) -> None:
    """`spore hello` with the plugin providing it disabled said only "No such command"."""
    out = run_spore("hello", plugins=("healthy",), env={"SPORE_DISABLE_PLUGINS": "healthy"})
    assert out.returncode == 2
    assert (
        "No such command 'hello'. Plugins not loaded, which may provide it: healthy "
        "(disabled: listed in SPORE_DISABLE_PLUGINS)." in out.stderr
    )
    assert run_spore("hello", plugins=("healthy",)).returncode == 0


def test_a_plugin_that_ends_the_interpreter_does_not_take_the_listing_down(run_spore) -> None:
    """The probe loading every plugin died with the plugin's os._exit, and `spore plugins`
    listed nothing; each plugin is then loaded alone, the one that ends it is `failed`."""
    for env in ({}, {"SPORE_PLUGINS": "crasher,healthy"}):
        out = run_spore("plugins", "--json", plugins=("crasher", "healthy"), env=env)
        assert out.returncode == 0, out.stderr
        rows = {r["name"]: r for r in json.loads(out.stdout)}
        assert rows["crasher"]["status"] == "failed"
        assert "exited with status 3 while importing it" in rows["crasher"]["reason"]
        assert rows["healthy"]["status"] == "active"
        assert rows["healthy"]["registered"]["ops"] == ["fixture_identity"]


@pytest.mark.core_alone
def test_plugins_all_includes_core_and_table_renders(run_spore) -> None:
    out = run_spore("plugins", "--all", "--json")
    assert [r["name"] for r in json.loads(out.stdout)] == ["core"]
    table = run_spore("plugins", "--all", plugins=("healthy",))
    assert table.returncode == 0
    assert "spore-fixture-healthy" in table.stdout
    assert "spore-core" in table.stdout
    assert "benchmarks: 1" in table.stdout


def test_plugins_listing_process_imports_no_plugin(tmp_path, fixtures_dir) -> None:
    log = tmp_path / "imports.log"
    env = clean_environ({"PYTHONPATH": str(fixtures_dir / "healthy")})
    env["SPORE_FIXTURE_IMPORT_LOG"] = str(log)
    command = [sys.executable, "-m", "spore", "plugins", "--json"]
    with childproc.Child(command, env=env, cwd=tmp_path) as listing:
        done = listing.wait(240)
    assert json.loads(done.stdout)[0]["status"] == "active"
    importers = log.read_text().split()
    assert len(importers) == 1
    assert importers != [str(listing.pid)]


def test_strict_env_turns_listing_into_an_error(run_spore) -> None:
    strict = {"SPORE_STRICT_PLUGINS": "1"}
    out = run_spore("plugins", plugins=("broken",), env=strict)
    assert out.returncode == 2  # a plugin error, as in the other commands
    assert "Error: spore plugin 'broken'" in out.stderr
    assert "caused by: ImportError" in out.stderr
    check = run_spore("plugins", "check", plugins=("broken",), env=strict)
    assert check.returncode == 1  # check's own status: a plugin is not active
    assert "'broken'" in check.stderr
    assert "ImportError" in check.stderr


def test_plugins_listing_notes_an_unknown_name_in_the_deny_list(run_spore) -> None:
    """The note was logged in the probe's child only: the listing, where a user looks after
    disabling a plugin, showed nothing."""
    typo = {"SPORE_DISABLE_PLUGINS": "healthyy"}
    for args in (("plugins",), ("plugins", "--json")):
        out = run_spore(*args, plugins=("healthy",), env=typo)
        assert out.returncode == 0, out.stderr
        assert (
            "Note: SPORE_DISABLE_PLUGINS names 'healthyy', which is not an installed plugin "
            "(did you mean 'healthy'?" in " ".join(out.stderr.split())
        )
    assert json.loads(out.stdout)[0]["status"] == "active"  # stdout is still only the JSON


def test_doctor_warns_of_a_name_in_the_deny_list_that_is_no_installed_plugin(run_spore) -> None:
    """doctor logged such a name at most (``core``: not even that), and its report said
    nothing."""
    denied = {"SPORE_DISABLE_PLUGINS": "healthyy,core"}
    out = run_spore("doctor", "--json", "--quick", plugins=("healthy",), env=denied)
    notes = [c for c in json.loads(out.stdout)["checks"] if c["name"] == "plugin selection"]
    assert [(c["source"], c["status"]) for c in notes] == [("core", "warn")] * 2
    assert "names 'core', which is not an installed plugin" in notes[0]["detail"]
    assert "names 'healthyy', which is not an installed plugin" in notes[1]["detail"]
    assert out.returncode == (1 if json.loads(out.stdout)["worst"] == "error" else 0)


def test_plugins_check_exit_codes(run_spore) -> None:
    assert run_spore("plugins", "check", plugins=("healthy",)).returncode == 0
    bad = run_spore("plugins", "check", "--json", plugins=("healthy", "broken"))
    assert bad.returncode == 1
    data = json.loads(bad.stdout)
    assert data["ok"] is False
    assert [p.split(":")[0] for p in data["problems"]] == ["broken"]
    group_json = run_spore("plugins", "--json", "check", plugins=("healthy", "broken"))
    assert json.loads(group_json.stdout) == data  # --json before `check` is the same
    assert run_spore("plugins", "check", "healthy", plugins=("healthy", "broken")).returncode == 0
    missing = run_spore("plugins", "check", "nope", plugins=("healthy",))
    assert missing.returncode == 1
    assert "nope: not installed" in missing.stderr
    disabled = run_spore(
        "plugins", "check", plugins=("healthy",), env={"SPORE_DISABLE_PLUGINS": "healthy"}
    )
    assert disabled.returncode == 0
    core = run_spore("plugins", "check", "--json", "core", "healthy", plugins=("healthy",))
    assert core.returncode == 0, core.stdout  # the built-in plugin was "not installed"
    assert {"core", "healthy"} <= {r["name"] for r in json.loads(core.stdout)["plugins"]}


def test_bench_and_plugins_check_name_the_plugin_meant(
    fixture_plugins, spore_manager, capsys
) -> None:
    """`spore bench spore-fixture-healthy` (a distribution name) and `spore plugins check
    healthyy` gave no hint of the plugin's name, and bench's list of installed plugins left
    out core, which it takes. In process: a child would run the installed spore."""
    from spore.cli import main
    from spore.cli.plugins import plugins_cmd

    fixture_plugins("healthy")
    spore_manager()
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "spore-fixture-healthy", "--list"])
    assert exit_.value.code == 2
    assert (
        "(did you mean 'healthy', the plugin of distribution spore-fixture-healthy? installed "
        "plugins: core, "
    ) in " ".join(capsys.readouterr().err.split())
    spore_manager()  # that one keeps its error
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "core", "--list"])
    assert exit_.value.code == 0
    assert "core:" in capsys.readouterr().out
    root = click.Group("spore")  # the plugins' commands go onto it, not onto spore's own
    root.add_command(plugins_cmd)
    result = CliRunner().invoke(root, ["plugins", "check", "healthyy", "spore-fixture-healthy"])
    assert result.exit_code == 1
    output = " ".join(result.output.split())
    assert "healthyy: not installed (did you mean 'healthy'?)" in output
    assert (
        "spore-fixture-healthy: not installed (did you mean 'healthy', the plugin of "
        "distribution spore-fixture-healthy?)"
    ) in output


def test_plugin_command_runs(run_spore) -> None:
    out = run_spore("hello", "ada", plugins=("healthy",))
    assert out.returncode == 0, out.stderr
    assert out.stdout == "hello ada from healthy\n"
    help_text = run_spore("--help", plugins=("healthy",)).stdout
    assert "hello" in help_text
    assert "doctor" in help_text


def test_unknown_command_is_a_usage_error(run_spore) -> None:
    out = run_spore("trian")
    assert out.returncode == 2
    assert "No such command 'trian'" in out.stderr


def test_bench_reports_ratios(run_spore) -> None:
    out = run_spore(
        "bench", "healthy", "--json", "--repeat", "3", "--min-time", "0.02", plugins=("healthy",)
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    (result,) = data["results"]
    assert result["name"] == "sleep"
    assert result["owner"] == "healthy"
    assert result["baseline_label"] == "sleep 20 ms"
    assert result["ratio"] > 2
    assert result["repeats"] == 3
    assert "environment" in data["settings"]
    table = run_spore("bench", "healthy", "--repeat", "1", "--min-time", "0", plugins=("healthy",))
    assert table.returncode == 0
    assert "sleep 20 ms" in table.stdout
    assert "settings (both sides): allocator" in table.stdout


def test_bench_under_an_applied_runtime_refuses_other_settings(run_spore) -> None:
    """Inside ``spore run`` (SPORE_RUNTIME set) bench does not restart: explicit --allocator or
    --threads were ignored and the figures printed under other settings."""
    inside = {"SPORE_RUNTIME": "system", "OMP_NUM_THREADS": "2"}
    args = ("bench", "healthy", "--repeat", "1", "--min-time", "0")
    refused = run_spore(
        *args, "--allocator", "tuned", "--threads", "1", env=inside, plugins=("healthy",)
    )
    assert refused.returncode == 2
    assert "--allocator tuned --threads 1 would not apply" in refused.stderr
    assert "allocator system with OMP_NUM_THREADS=2" in refused.stderr
    same = run_spore(
        *args, "--allocator", "system", "--threads", "2", env=inside, plugins=("healthy",)
    )
    assert same.returncode == 0, same.stderr
    assert "settings (both sides): allocator system" in same.stdout


@pytest.mark.parametrize("bad", ["nan", "inf", "1e308"])
def test_bench_refuses_a_min_time_that_is_no_number_of_seconds(run_spore, bad: str) -> None:
    """Each passed ``FloatRange(min=0)``, then every case failed converting it to a count."""
    done = run_spore("bench", "healthy", "--repeat", "1", "--min-time", bad, plugins=("healthy",))
    assert done.returncode == 2
    assert "Invalid value for '--min-time'" in done.stderr


def test_a_spore_module_in_the_current_folder_is_not_imported(run_spore, tmp_path) -> None:
    """The plugin probe, bench's restart and doctor's children ran ``python -m spore...``, which
    put the current folder first on sys.path: a ``spore.py`` there was imported instead."""
    (tmp_path / "spore.py").write_text("print('the spore.py of the current folder')\n")
    for args in (("plugins", "--json"), ("bench", "healthy", "--repeat", "1", "--min-time", "0")):
        done = run_spore(*args, plugins=("healthy",), cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert "the spore.py of the current folder" not in done.stdout + done.stderr
        assert "healthy" in done.stdout


@pytest.mark.core_alone
def test_bench_list_filter_and_errors(run_spore) -> None:
    listed = run_spore("bench", "--list", plugins=("healthy", "dup_a"))
    assert listed.stdout.splitlines() == [
        "core:allocator-mlp (vs glibc malloc defaults (child process); self-timed)",
        "core:allocator-rmsnorm (vs glibc malloc defaults (child process); self-timed)",
        "core:dispatch-mode-overhead (vs 100 small eager adds, no mode)",
        "core:fallback-tensor-overhead (vs 100 small eager adds on a plain tensor)",
        "core:offload-disk-mlp-step (vs MLP block 8192x256->2048 fwd+bwd, activations in memory)",
        "dup-a:only-a (vs nothing)",
        "dup-a:shared (vs nothing)",
        "healthy:sleep (vs sleep 20 ms)",
    ]
    rows = json.loads(run_spore("bench", "--list", "--json", plugins=("healthy",)).stdout)
    assert {r["name"]: r["self_timed"] for r in rows}["allocator-mlp"] is True
    assert {r["name"]: r["self_timed"] for r in rows}["sleep"] is False
    helped = run_spore("bench", "--help", plugins=("healthy",)).stdout
    assert "Self-timed cases (marked in --list)" in " ".join(helped.split())
    none = run_spore("bench", "-k", "zzz", plugins=("healthy",))
    assert none.returncode == 1
    assert "no benchmark cases match and filter 'zzz'" in none.stderr
    broken = run_spore("bench", "broken", plugins=("healthy", "broken"))
    assert broken.returncode == 2
    assert "Error: spore plugin 'broken'" in broken.stderr
    assert "caused by: ImportError" in broken.stderr
    assert run_spore("bench", "--repeat", "0").returncode == 2


def test_doctor_json_and_plugin_checks(run_spore) -> None:
    out = run_spore("doctor", "--json", "--quick", plugins=("healthy", "future"))
    data = json.loads(out.stdout)
    checks = {(c["source"], c["name"]): c for c in data["checks"]}
    assert checks[("core", "torch")]["status"] == "ok"
    assert checks[("healthy", "fixture")]["detail"] == "healthy fixture plugin is fine"
    assert checks[("core", "plugin future")]["status"] == "warn"
    assert out.returncode == (1 if data["worst"] == "error" else 0)


def test_json_goes_to_a_python_stdout_that_is_no_descriptor() -> None:
    """Where stdout is a Python stream (a test runner, a notebook), --json's JSON went to
    stderr with the noise."""
    from spore.cli.render import JSON_OPTION, echo_json

    @click.command()
    @JSON_OPTION
    def show(as_json: bool) -> None:
        print("noise")
        echo_json({"a": 1})

    result = CliRunner().invoke(show, ["--json"])
    assert json.loads(result.stdout) == {"a": 1}
    assert result.stderr == "noise\n"


def test_json_has_null_for_a_nan_or_an_infinity() -> None:
    """JSON has no NaN nor Infinity: a self-timed bench case reporting an infinite time or a
    NaN extra printed them, which strict parsers refuse."""
    from spore.cli.render import JSON_OPTION, echo_json

    @click.command()
    @JSON_OPTION
    def show(as_json: bool) -> None:
        echo_json({"s": float("inf"), "extras": {"rss": [float("nan"), 1.5, -float("inf")]}})

    result = CliRunner().invoke(show, ["--json"])

    def refuse(constant: str) -> None:
        raise ValueError(constant)

    data = json.loads(result.stdout, parse_constant=refuse)
    assert data == {"s": None, "extras": {"rss": [None, 1.5, None]}}


def test_json_works_when_stderr_has_no_descriptor(tmp_path) -> None:
    """With stderr a Python stream (or closed), moving fd 1 onto it raised, leaking the
    descriptors it had opened."""
    script = (
        "import contextlib, io, os, sys\n"
        "from spore.cli import main\n"
        "before = len(os.listdir('/proc/self/fd'))\n"
        "with contextlib.redirect_stderr(io.StringIO()):\n"
        "    try:\n"
        "        main(['backends', '--json'])\n"
        "    except SystemExit as exc:\n"
        "        assert not exc.code, exc.code\n"
        "print(len(os.listdir('/proc/self/fd')) - before, file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert isinstance(json.loads(done.stdout), list)
    assert done.stderr.strip().splitlines()[-1] == "0"


def test_doctor_reports_a_plugin_whose_commands_fail(run_spore) -> None:
    """doctor never asked plugins for their commands, and called such a plugin active."""
    out = run_spore("doctor", "--json", "--quick", plugins=("badcommand",))
    checks = {(c["source"], c["name"]): c for c in json.loads(out.stdout)["checks"]}
    check = checks[("core", "plugin badcommand")]
    assert check["status"] == "error"
    assert "hook spore_add_commands raised: RuntimeError: no commands today" in check["detail"]
    assert out.returncode == 1


def test_doctor_exits_1_when_a_plugin_asked_for_by_name_fails(
    spore_plugin_source, spore_manager, capsys
) -> None:
    """A failing doctor hook of a plugin in SPORE_PLUGINS exited 2 (the plugin-error status
    of other commands) where the docs promise 1 for any error; so did one in strict mode. Then
    it exited 1 with the error alone: no report, nor JSON under --json. The error is a check of
    the report now, after the checks made before it."""
    from spore.cli import main

    spore_plugin_source(
        "sickly",
        "import spore\n"
        "@spore.hookimpl\n"
        "def spore_doctor(report):\n"
        "    raise RuntimeError('cannot examine')\n",
    )
    for env in ({"SPORE_PLUGINS": "sickly"}, {"SPORE_STRICT_PLUGINS": "1"}):
        spore_manager(env)
        with pytest.raises(SystemExit) as exit_:
            main(["doctor", "--quick", "--json"])
        assert exit_.value.code == 1
        report = json.loads(capsys.readouterr().out)
        assert report["worst"] == "error"
        checks = {(c["source"], c["name"]): c for c in report["checks"]}
        assert checks[("core", "python")]["status"] == "ok"
        error = checks[("core", "plugin error")]
        assert error["status"] == "error"
        assert error["detail"].startswith(
            "spore plugin 'sickly' (sickly 0.1.0) hook spore_doctor raised: cannot examine"
        )
        assert error["detail"].endswith("(cause: RuntimeError('cannot examine'))")
        assert checks[("core", "plugin sickly")]["status"] == "error"
        assert (
            "plugins after the failed one ran no checks"
            in checks[("core", "plugin checks")]["detail"]
        )
    spore_manager({"SPORE_PLUGINS": "absent"})  # the loading fails: the core's checks alone
    with pytest.raises(SystemExit) as exit_:
        main(["doctor", "--quick", "--json"])
    assert exit_.value.code == 1
    checks = {(c["source"], c["name"]): c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks[("core", "python")]["status"] == "ok"
    assert checks[("core", "plugin error")]["detail"].startswith(
        "spore plugin 'absent' was asked for but is not installed"
    )
    with pytest.raises(SystemExit) as exit_:  # and as a table
        main(["doctor", "--quick"])
    assert exit_.value.code == 1
    assert "spore doctor" in capsys.readouterr().out


def test_doctor_shows_the_selection_notes_when_a_plugin_fails_to_load(
    fixture_plugins, spore_manager, capsys
) -> None:
    """A plugin failing to load under strict mode stopped doctor before its selection notes:
    the typo in SPORE_DISABLE_PLUGINS that let the plugin load went unreported beside its
    error."""
    from spore.cli import main

    fixture_plugins("broken")
    spore_manager({"SPORE_STRICT_PLUGINS": "1", "SPORE_DISABLE_PLUGINS": "brokn"})
    with pytest.raises(SystemExit) as exit_:
        main(["doctor", "--quick", "--json"])
    assert exit_.value.code == 1
    checks = json.loads(capsys.readouterr().out)["checks"]
    found = {(c["source"], c["name"]): c for c in checks}
    assert found[("core", "plugin error")]["detail"].startswith(
        "spore plugin 'broken' (spore-fixture-broken 1.0.0) import of"
    )
    note = found[("core", "plugin selection")]
    assert note["status"] == "warn"
    assert note["detail"].startswith(
        "SPORE_DISABLE_PLUGINS names 'brokn', which is not an installed plugin (did you mean "
        "'broken'?"
    )
    with pytest.raises(SystemExit):
        main(["doctor", "--quick"])
    assert "names 'brokn'" in " ".join(capsys.readouterr().out.split())


def test_json_stdout_is_only_json_when_a_plugin_prints(run_spore) -> None:
    # noeol prints at import; each --json command loading it in-process kept that on stdout
    for command in (
        ("ops",),
        ("backends",),
        ("passes",),
        ("bench", "--list"),
        ("doctor", "--quick"),
        ("plugins", "check"),
    ):
        out = run_spore(*command, "--json", plugins=("noeol",))
        assert out.returncode == 0, (command, out.stderr)
        json.loads(out.stdout)
        assert "noeol: warming up..." in out.stderr, command
    for command in (("ops",), ("doctor", "--quick"), ("bench", "--list")):
        out = run_spore(*command, "--json", plugins=("fdnoise",))  # written to fd 1 itself
        json.loads(out.stdout)
        assert "fdnoise: straight to fd 1" in out.stderr, command
    run = run_spore(  # restarted under the runtime plan: the new process must get stdout back
        "bench", "healthy", "--json", "--repeat", "1", "--min-time", "0", plugins=("healthy",)
    )
    assert "spore bench: allocator" in run.stderr
    assert [r["name"] for r in json.loads(run.stdout)["results"]] == ["sleep"]
    table = run_spore("ops", plugins=("noeol",))
    assert table.stdout.startswith("noeol: warming up...")  # without --json it stays as it was


@pytest.mark.core_alone
def test_doctor_explains_torch_npu_autoload(run_spore) -> None:
    broken = run_spore("doctor", "--json", "--quick", plugins=("fake_torch_npu",))
    assert broken.returncode == 1
    checks = {c["name"]: c for c in json.loads(broken.stdout)["checks"]}
    assert checks["torch"]["status"] == "error"
    assert "libhccl.so" in checks["torch"]["detail"]
    assert checks["torch_npu"]["status"] == "error"
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in checks["torch_npu"]["fix"]
    fixed = run_spore(
        "doctor",
        "--json",
        "--quick",
        plugins=("fake_torch_npu",),
        env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
    )
    checks = {c["name"]: c for c in json.loads(fixed.stdout)["checks"]}
    assert checks["torch"]["status"] == "ok"
    assert checks["torch_npu"]["status"] == "info"
    assert "autoload is off" in checks["torch_npu"]["detail"]


def _lines_holding(text: str, *words: str) -> None:
    lines = text.splitlines()
    for word in words:
        assert any(word in line for line in lines), f"{word!r} is not whole on one line:\n{text}"
    assert max(map(len, lines)) <= 80, text


def _render(columns: list[Column], rows: list[dict[str, str]], width: int) -> str:
    out = io.StringIO()
    rendered = table("t", columns, rows, width=width)
    Console(width=width, file=out, highlight=False).print(rendered, crop=False)
    return out.getvalue()


def test_table_keeps_names_whole_at_80_columns() -> None:
    names = [f"plugin-name-{i}" for i in range(3)]
    reason = "import failed: ImportError: libsomething_quite_long.so: cannot open shared object"
    rows = [{"name": n, "dist": f"spore-fixture-{n}", "reason": reason} for n in names]
    columns = [
        Column("name", lambda r: r["name"], "name"),
        Column("distribution", lambda r: r["dist"], "name"),
        Column("status", lambda r: styled("incompatible"), "name"),
        Column("registered", lambda r: "ops: 3, benchmarks: 140, commands: 1"),
        Column("reason", lambda r: r["reason"], "note"),
    ]
    text = _render(columns, rows, 80)
    _lines_holding(text, *names, *(r["dist"] for r in rows), "incompatible", *reason.split())
    _lines_holding(text, "ops:", "3,", "benchmarks:", "140,", "commands:")
    wide = _render(columns[:3], [{"name": "n" * 50, "dist": "d" * 50}], 80)
    assert "n" * 50 in wide
    assert "d" * 50 in wide
    assert "incompatible" in wide
    assert len(wide.splitlines()[1]) > 80


def test_cells_are_shown_as_written_not_read_as_markup() -> None:
    """Plugin errors and paths went through rich markup: ``pip install 'pkg[cuda]'`` lost its
    ``[cuda]``, and a ``[/docs]`` in a message crashed ``spore plugins`` (MarkupError)."""
    reason = "needs its CUDA extra: pip install 'pkg[cuda]' (see [/docs/install])"
    columns = [
        Column("name", lambda r: r["name"], "name"),
        Column("status", lambda r: styled("failed", " [bold]x"), "name"),
        Column("reason", lambda r: r["reason"], "note"),
    ]
    text = _render(columns, [{"name": "a[/b]", "reason": reason}], 120)
    assert "a[/b]" in text
    assert "failed [bold]x" in text
    assert reason in text


def test_listings_keep_names_whole_at_80_columns(run_spore) -> None:
    narrow = {"COLUMNS": "80"}
    listed = run_spore("plugins", plugins=("healthy", "broken", "future"), env=narrow)
    assert listed.returncode == 0, listed.stderr
    _lines_holding(
        listed.stdout,
        "spore-fixture-healthy",
        "spore-fixture-future",
        "incompatible",
        "libspore_fixture.so:",
    )
    ops = run_spore("ops", plugins=("ops",), env=narrow)
    _lines_holding(ops.stdout, "spore::fixture_scale", "cpu: ops (5)")
    doctor = run_spore("doctor", "--quick", plugins=("future",), env=narrow)
    _lines_holding(doctor.stdout, "plugin future", "incompatible")


def test_bench_notes_show_a_figure_only_one_side_reports() -> None:
    from spore.cli.bench import _extras

    notes = _extras(
        {"baseline": {"regions": 1.0, "rss": 2.0}, "candidate": {"regions": 1.0, "own_us": 25.0}}
    )
    assert notes == "regions 1 -> 1, rss 2 (baseline), own_us 25 (candidate)"
    assert _extras({}) == ""
