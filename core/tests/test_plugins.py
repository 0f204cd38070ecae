from __future__ import annotations

import logging
import sys
import threading

import click
import pluggy
import pytest
import torch
from click.testing import CliRunner

import spore
from spore import dispatch
from spore.plugins import PluginError, PluginManager, Selection, Status


def _statuses(manager) -> dict[str, tuple[Status, str]]:
    return {i.name: (i.status, i.reason) for i in manager.plugins()}


@pytest.mark.core_alone
def test_healthy_plugin_is_lazy_active_and_attributed(fixture_plugins, spore_manager) -> None:
    fixture_plugins("healthy")
    manager = spore_manager()
    assert [i.name for i in manager.discover()] == ["healthy"]
    assert "spore_fixture_healthy" not in sys.modules
    benchmarks = spore.get_registry("benchmarks")
    assert "spore_fixture_healthy" in sys.modules
    entry = benchmarks.entry("sleep")
    assert entry.owner == "healthy"
    (info,) = manager.plugins()
    assert info.status is Status.ACTIVE
    assert info.distribution == "spore-fixture-healthy"
    assert info.version == "1.0.0"
    assert info.core_requirement == "<0.2,>=0.1"
    assert info.registered["benchmarks"] == ["sleep"]
    assert info.registered["ops"] == ["fixture_identity"]
    assert "spore_doctor" in info.hooks


def test_loads_once_per_manager_and_thread_safe(fixture_plugins, spore_manager) -> None:
    fixture_plugins("healthy")
    manager = spore_manager()
    threads = [threading.Thread(target=manager.registry, args=("ops",)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    manager.registry("benchmarks")
    assert sys.modules["spore_fixture_healthy"].LOADS == ["benchmarks"]


@pytest.mark.core_alone
def test_reentrant_registry_use_during_load(fixture_plugins, spore_manager) -> None:
    fixture_plugins("reentrant", "healthy")
    manager = spore_manager()
    assert _statuses(manager)["reentrant"][0] is Status.ACTIVE
    # ops are registered before benchmarks, so the plugin saw the healthy plugin's op
    assert sys.modules["spore_fixture_reentrant"].SEEN == [1]


def test_import_failure_is_isolated(fixture_plugins, spore_manager, caplog) -> None:
    fixture_plugins("healthy", "broken")
    manager = spore_manager()
    with caplog.at_level("WARNING", logger="spore.plugins"):
        statuses = _statuses(manager)
    status, reason = statuses["broken"]
    assert status is Status.FAILED
    assert "import of 'spore_fixture_broken' failed" in reason
    assert "libspore_fixture.so" in reason
    assert statuses["healthy"][0] is Status.ACTIVE
    (record,) = [r for r in caplog.records if "broken" in r.getMessage()]
    assert "spore-fixture-broken 1.0.0" in record.getMessage()


def test_a_malformed_requirement_fails_that_plugin_only(fixture_plugins, spore_manager) -> None:
    fixture_plugins("healthy", "badmeta")
    manager = spore_manager()
    statuses = _statuses(manager)
    status, reason = statuses["badmeta"]
    assert status is Status.FAILED
    assert reason.startswith("its metadata has a malformed requirement 'spore-core>=0.1 ;")
    assert statuses["healthy"][0] is Status.ACTIVE
    assert "sleep" in manager.registry("benchmarks")
    assert "spore_fixture_badmeta" not in sys.modules


def test_a_malformed_twin_does_not_hide_the_valid_plugin_or_a_disabled_one(
    fixture_plugins, spore_manager
) -> None:
    """The name clash and the user's deny-list are decided before the metadata is judged."""
    fixture_plugins("badmeta", "badmeta_twin")
    manager = spore_manager()
    found = {(i.name, i.distribution): (i.status, i.reason) for i in manager.plugins()}
    assert found[("badmeta", "spore-fixture-a-badmeta")][0] is Status.ACTIVE
    status, reason = found[("badmeta", "spore-fixture-badmeta")]
    assert status is Status.FAILED
    assert "also provided by spore-fixture-a-badmeta" in reason
    assert "twin" in manager.registry("benchmarks")


def test_a_disabled_plugin_is_disabled_whatever_its_metadata(fixture_plugins, spore_manager):
    fixture_plugins("badmeta")
    disabled = _statuses(spore_manager({"SPORE_DISABLE_PLUGINS": "badmeta"}))
    assert disabled["badmeta"] == (Status.DISABLED, "listed in SPORE_DISABLE_PLUGINS")


def test_an_unknown_name_in_the_deny_list_is_logged(fixture_plugins, spore_manager, caplog):
    fixture_plugins("healthy")
    with caplog.at_level(logging.WARNING, logger="spore.plugins"):
        statuses = _statuses(spore_manager({"SPORE_DISABLE_PLUGINS": "healthyy,core"}))
    assert statuses["healthy"][0] is Status.ACTIVE  # the typo disabled nothing
    core, typo = [r.getMessage() for r in caplog.records if "SPORE_DISABLE" in r.getMessage()]
    assert "names 'healthyy', which is not an installed plugin (did you mean 'healthy'?" in typo
    assert (  # 'core' was left out without a word
        "names 'core', which is not an installed plugin (it is spore-core's built-in plugin, "
        "which cannot be disabled; to load no other plugin, set SPORE_NO_PLUGINS=1;" in core
    )


@pytest.mark.parametrize(
    ("fixture", "reason"),
    [
        ("sysexit", "import of 'spore_fixture_sysexit' failed: SystemExit: plugin gave up"),
        ("hookexit", "hook spore_register_backends raised: SystemExit: plugin gave up in its hook"),
    ],
)
def test_a_plugin_calling_sys_exit_fails_without_ending_the_host(
    fixture, reason, fixture_plugins, spore_manager
) -> None:
    fixture_plugins("healthy", fixture)
    manager = spore_manager()
    statuses = _statuses(manager)
    assert statuses[fixture] == (Status.FAILED, reason)
    assert statuses["healthy"][0] is Status.ACTIVE
    assert "spore_fixture_quitter" not in manager.registry("backends")


def test_hook_exception_fails_plugin_and_withdraws_its_entries(
    fixture_plugins, spore_manager
) -> None:
    fixture_plugins("raises", "healthy")
    manager = spore_manager()
    status, reason = _statuses(manager)["raises"]
    assert status is Status.FAILED
    assert reason == ("hook spore_register_benchmarks raised: RuntimeError: boom while registering")
    assert "half-done" not in manager.registry("benchmarks")
    assert "sleep" in manager.registry("benchmarks")
    from spore import doctor

    report = doctor.run(manager)
    assert not [c for c in report.checks if c.source == "raises"]
    assert [c.name for c in report.checks if c.source == "healthy"] == ["fixture"]
    (health,) = [c for c in report.checks if c.name == "plugin raises"]
    assert health.status == "error"


def test_a_load_interrupted_by_a_base_exception_is_undone_and_retried(
    spore_plugin_source, spore_manager
) -> None:
    """A KeyboardInterrupt (or a test's skip) out of a plugin's hook left the manager marked
    loaded: later uses got half-filled registries, the plugin no status, and the plugins after
    it were never loaded."""
    spore_plugin_source(
        "interrupted",
        "import spore\n"
        "CALLS = []\n"
        "@spore.hookimpl\n"
        "def spore_register_passes(registry):\n"
        "    registry.add(lambda gm: 0, name='half_registered')\n"
        "    CALLS.append(1)\n"
        "    if len(CALLS) == 1:\n"
        "        raise KeyboardInterrupt\n",
    )
    spore_plugin_source(
        "zlater",
        "import spore\n"
        "@spore.hookimpl\n"
        "def spore_register_passes(registry):\n"
        "    registry.add(lambda gm: 0, name='zlater_pass')\n",
    )
    manager = spore_manager({"SPORE_PLUGINS": "interrupted,zlater"})
    with pytest.raises(KeyboardInterrupt):
        manager.registry("passes")
    assert [r.names() for r in manager.registries.values()] == [[], [], [], []]
    assert manager.registry("passes").names() == ["half_registered", "zlater_pass"]
    statuses = _statuses(manager)
    assert statuses["interrupted"][0] is statuses["zlater"][0] is Status.ACTIVE


def test_an_undone_load_keeps_a_disabled_plugins_kernels(
    spore_plugin_source, spore_manager
) -> None:
    """Undoing withdrew the kernels of every plugin found, a disabled one's too: those its
    package registered when imported (spore_kernels does) were gone for good."""
    spore_plugin_source("switchedoff", "")
    spore_plugin_source(
        "interrupting",
        "import spore\n"
        "@spore.hookimpl\n"
        "def spore_register_passes(registry):\n"
        "    raise KeyboardInterrupt\n",
    )
    op = dispatch.define("t_undone_load", "(Tensor x) -> Tensor", reference=torch.neg)
    dispatch.register_kernel(op, "cpu", torch.neg, provider="switchedoff")
    manager = spore_manager({"SPORE_DISABLE_PLUGINS": "switchedoff"})
    with pytest.raises(KeyboardInterrupt):
        manager.registry("passes")
    assert list(op.kernels) == [("cpu", "switchedoff")]


def test_an_interrupted_add_commands_is_undone_and_retried(
    spore_plugin_source, spore_manager
) -> None:
    """A KeyboardInterrupt out of a plugin's spore_add_commands was not undone: the commands
    of the plugins after it were never added, and every later call added none."""
    spore_plugin_source(
        "interrupted",
        "import click, spore\n"
        "CALLS = []\n"
        "@spore.hookimpl\n"
        "def spore_add_commands(cli):\n"
        "    cli.add_command(click.Command('half'))\n"
        "    CALLS.append(1)\n"
        "    if len(CALLS) == 1:\n"
        "        raise KeyboardInterrupt\n",
    )
    spore_plugin_source(
        "zlater",
        "import click, spore\n"
        "@spore.hookimpl\n"
        "def spore_add_commands(cli):\n"
        "    cli.add_command(click.Command('later'))\n",
    )
    manager = spore_manager({"SPORE_PLUGINS": "interrupted,zlater"})
    cli = click.Group(commands=[click.Command("own")])
    with pytest.raises(KeyboardInterrupt):
        manager.add_commands(cli)
    assert list(cli.commands) == ["own"]
    manager.add_commands(cli)
    assert sorted(cli.commands) == ["half", "later", "own"]
    registered = {i.name: i.registered["commands"] for i in manager.plugins()}
    assert (registered["interrupted"], registered["zlater"]) == (["half"], ["later"])


def test_a_plugin_error_in_add_commands_keeps_the_other_plugins_commands(
    spore_plugin_source, spore_manager
) -> None:
    """Unlike an interruption, a plugin error is not undone: the failed plugin's commands are
    withdrawn, the ones added before it stay, and a later call adds nothing again."""
    spore_plugin_source(
        "aearly",
        "import click, spore\n"
        "@spore.hookimpl\n"
        "def spore_add_commands(cli):\n"
        "    cli.add_command(click.Command('early'))\n",
    )
    spore_plugin_source(
        "broken",
        "import click, spore\n"
        "@spore.hookimpl\n"
        "def spore_add_commands(cli):\n"
        "    cli.add_command(click.Command('half'))\n"
        "    raise RuntimeError('no more')\n",
    )
    manager = spore_manager({"SPORE_PLUGINS": "aearly,broken"})
    cli = click.Group(commands=[click.Command("own")])
    with pytest.raises(PluginError, match="hook spore_add_commands raised: no more"):
        manager.add_commands(cli)
    assert sorted(cli.commands) == ["early", "own"]
    manager.add_commands(cli)
    assert sorted(cli.commands) == ["early", "own"]


def test_an_interrupted_load_whose_undoing_fails_raises_at_each_later_use(
    spore_plugin_source, spore_manager, monkeypatch
) -> None:
    """An undo that raised left the manager "loading": later uses returned at once, with
    half-filled registries and no word."""
    spore_plugin_source(
        "interrupting",
        "import spore\n"
        "@spore.hookimpl\n"
        "def spore_register_passes(registry):\n"
        "    registry.add(lambda gm: 0, name='half_registered')\n"
        "    raise KeyboardInterrupt\n",
    )
    manager = spore_manager({"SPORE_PLUGINS": "interrupting"})

    def refuse(owner: str) -> None:
        raise RuntimeError("cannot withdraw")

    monkeypatch.setattr(manager.registries["passes"], "remove_owner", refuse)
    with pytest.raises(KeyboardInterrupt):
        manager.registry("passes")
    for _ in range(2):
        with pytest.raises(PluginError, match=r"interrupted \(KeyboardInterrupt\) and") as err:
            manager.registry("passes")
        assert "RuntimeError: cannot withdraw" in str(err.value)
        assert "start a new process" in str(err.value)


def test_hook_with_unknown_arguments_fails(fixture_plugins, spore_manager) -> None:
    fixture_plugins("badargs")
    status, reason = _statuses(spore_manager())["badargs"]
    assert status is Status.FAILED
    assert reason.startswith("registration failed: PluginValidationError")
    assert "device" in reason


def test_unknown_hook_fails_with_suggestion(fixture_plugins, spore_manager) -> None:
    fixture_plugins("typo")
    status, reason = _statuses(spore_manager())["typo"]
    assert status is Status.FAILED
    assert "'spore_register_benchmark' has no specification" in reason
    assert "did you mean 'spore_register_benchmarks'?" in reason


def test_incompatible_core_range_is_never_imported(fixture_plugins, spore_manager) -> None:
    fixture_plugins("future")
    status, reason = _statuses(spore_manager())["future"]
    assert status is Status.INCOMPATIBLE
    assert "requires spore-core<10,>=9.0" in reason
    assert f"spore-core {spore.__version__} is running" in reason
    assert "spore_fixture_future" not in sys.modules


def test_duplicate_registration_names_both_owners(fixture_plugins, spore_manager) -> None:
    fixture_plugins("dup_a", "dup_b")
    manager = spore_manager()
    statuses = _statuses(manager)
    assert statuses["dup-a"][0] is Status.ACTIVE
    status, reason = statuses["dup-b"]
    assert status is Status.FAILED
    assert "benchmark 'shared' is registered by both 'dup-a' and 'dup-b'" in reason
    benchmarks = manager.registry("benchmarks")
    assert benchmarks.entry("shared").owner == "dup-a"
    assert "only-b" not in benchmarks
    assert "only-a" in benchmarks


def test_strict_mode_raises_with_cause(fixture_plugins, spore_manager) -> None:
    fixture_plugins("broken")
    manager = spore_manager({"SPORE_STRICT_PLUGINS": "1"})
    with pytest.raises(PluginError, match="'broken'") as info:
        manager.load()
    assert isinstance(info.value.__cause__, ImportError)
    with pytest.raises(PluginError):
        manager.registry("ops")


@pytest.mark.parametrize(
    ("plugins", "message"),
    [(("badmeta",), "malformed requirement"), (("badmeta", "badmeta_twin"), "also provided by")],
)
def test_strict_mode_raises_for_a_plugin_failed_at_discovery(
    fixture_plugins, spore_manager, plugins, message
) -> None:
    """Bad metadata and a name two distributions provide fail a plugin before its import;
    strict mode let both through."""
    fixture_plugins(*plugins, "healthy")
    manager = spore_manager({"SPORE_STRICT_PLUGINS": "1"})
    with pytest.raises(PluginError, match=rf"spore plugin 'badmeta' \(.*\) .*{message}"):
        manager.load()
    for switchedoff in ({"SPORE_DISABLE_PLUGINS": "badmeta"}, {"SPORE_PLUGINS": "healthy"}):
        quiet = spore_manager({"SPORE_STRICT_PLUGINS": "1", **switchedoff})
        assert "sleep" in quiet.registry("benchmarks")  # the remedy the message suggests


def test_plugin_asked_for_by_name_fails_hard(fixture_plugins, spore_manager) -> None:
    fixture_plugins("raises", "healthy")
    manager = spore_manager(requested=["raises"])
    with pytest.raises(PluginError, match="hook spore_register_benchmarks raised") as info:
        manager.load()
    assert isinstance(info.value.__cause__, RuntimeError)


def test_request_after_load_checks_status(fixture_plugins, spore_manager) -> None:
    fixture_plugins("future", "healthy")
    manager = spore_manager()
    manager.load()
    manager.request(["healthy"])
    with pytest.raises(PluginError, match=r"'future'.*incompatible"):
        manager.request(["future"])
    with pytest.raises(PluginError, match=r"'nope' was asked for but is not installed"):
        manager.request(["nope"])


@pytest.mark.parametrize(
    ("env", "active"),
    [
        ({}, {"healthy", "reentrant"}),
        ({"SPORE_DISABLE_PLUGINS": "healthy"}, {"reentrant"}),
        ({"SPORE_PLUGINS": "Healthy"}, {"healthy"}),
        ({"SPORE_PLUGINS": ""}, set()),
        ({"SPORE_PLUGINS": "healthy", "SPORE_DISABLE_PLUGINS": "healthy"}, {"healthy"}),
        ({"SPORE_NO_PLUGINS": "1", "SPORE_PLUGINS": "healthy"}, set()),
        ({"SPORE_NO_PLUGINS": "0"}, {"healthy", "reentrant"}),
    ],
)
@pytest.mark.core_alone
def test_environment_precedence(fixture_plugins, spore_manager, env, active) -> None:
    fixture_plugins("healthy", "reentrant")
    manager = spore_manager(env)
    statuses = _statuses(manager)
    assert {n for n, (s, _) in statuses.items() if s is Status.ACTIVE} == active
    for name, (status, reason) in statuses.items():
        if name not in active:
            assert status is Status.DISABLED
            assert "SPORE_" in reason
    for name in statuses.keys() - active:
        assert f"spore_fixture_{name}" not in sys.modules


def test_selection_reasons() -> None:
    assert Selection.from_env({"SPORE_NO_PLUGINS": "yes"}).why_disabled("a") == (
        "SPORE_NO_PLUGINS is set"
    )
    assert Selection.from_env({"SPORE_PLUGINS": "b, c"}).why_disabled("a") == (
        "not listed in SPORE_PLUGINS"
    )
    assert Selection.from_env({"SPORE_DISABLE_PLUGINS": "a_x"}).why_disabled("A-X") == (
        "listed in SPORE_DISABLE_PLUGINS"
    )
    assert Selection.from_env({}).why_disabled("a") is None


def test_a_plugin_name_not_found_is_answered_with_the_name_meant(
    fixture_plugins, spore_manager, caplog
) -> None:
    """A typo in SPORE_PLUGINS or `spore bench NAME` got no "did you mean" (one in
    SPORE_DISABLE_PLUGINS did), a distribution name (as the README tables show) no word that
    the plugin is named otherwise, and the installed plugins listed left out core."""
    fixture_plugins("healthy")
    manager = spore_manager()
    manager.load()
    for asked, hint in (
        ("healthyy", "did you mean 'healthy'? "),
        (
            "spore_fixture_healthy",
            "did you mean 'healthy', the plugin of distribution spore-fixture-healthy? ",
        ),
        ("spore-core", "did you mean 'core', the plugin of distribution spore-core? "),
        ("zzzz", ""),
    ):
        with pytest.raises(PluginError) as info:
            manager.request([asked])
        assert f"is not installed ({hint}installed plugins: core, " in str(info.value)
    with pytest.raises(PluginError, match=r"not installed \(did you mean 'healthy'\? installed"):
        spore_manager({"SPORE_PLUGINS": "healthyy"}).load()
    with caplog.at_level(logging.WARNING, logger="spore.plugins"):
        spore_manager({"SPORE_DISABLE_PLUGINS": "spore-fixture-healthy"}).load()
    assert (
        "(did you mean 'healthy', the plugin of distribution spore-fixture-healthy? installed:"
        in caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="spore.plugins"):  # no word of core's name
        spore_manager({"SPORE_DISABLE_PLUGINS": "Spore_Core"}).load()
    assert "it is spore-core's built-in plugin, which cannot be disabled" in caplog.text


def test_allow_list_names_are_requested(fixture_plugins, spore_manager) -> None:
    fixture_plugins("healthy")
    manager = spore_manager({"SPORE_PLUGINS": "healthy,missing"})
    with pytest.raises(PluginError, match="'missing' was asked for but is not installed"):
        manager.load()


def test_a_listing_of_a_missing_plugin_names_no_empty_cause(run_spore) -> None:
    done = run_spore("plugins", env={"SPORE_PLUGINS": "missing"})
    assert done.returncode == 2  # a plugin error, as in the other commands
    assert "spore plugin 'missing' was asked for but is not installed" in done.stderr
    assert "cause" not in done.stderr  # it ended "(cause: None)"


@pytest.mark.core_alone
def test_commands_are_added_and_clashes_fail(fixture_plugins, spore_manager) -> None:
    fixture_plugins("healthy")
    manager = spore_manager()
    group = click.Group("spore")
    manager.add_commands(group)
    result = CliRunner().invoke(group, ["hello", "bob"])
    assert result.output == "hello bob from healthy\n"
    (info,) = manager.plugins()
    assert info.registered["commands"] == ["hello"]

    clash = spore_manager()
    taken = click.Group("spore")

    @taken.command("hello")
    def builtin_hello() -> None:
        click.echo("builtin")

    clash.add_commands(taken)
    (info,) = clash.plugins()
    assert info.status is Status.FAILED
    assert "command 'hello' is added by both 'spore' and 'healthy'" in info.reason
    assert taken.commands["hello"] is builtin_hello
    assert "sleep" not in clash.registry("benchmarks")


@pytest.mark.core_alone
def test_core_builtin_plugin_is_listed_with_include_builtin(spore_manager) -> None:
    manager = spore_manager()
    assert manager.plugins() == []
    (core,) = manager.plugins(include_builtin=True)
    assert core.name == "core"
    assert core.builtin
    assert core.status is Status.ACTIVE
    assert core.hooks == ["spore_doctor", "spore_register_benchmarks"]
    assert manager.registry("benchmarks").names(owner="core") == [
        "allocator-mlp",
        "allocator-rmsnorm",
        "dispatch-mode-overhead",
        "fallback-tensor-overhead",
        "offload-disk-mlp-step",
    ]


class _PublishedHooks:
    hookspec = pluggy.HookspecMarker("spore")

    @hookspec
    def acme_register_widgets(self, registry):
        """A hook a plugin publishes for others."""


class _Widgets:
    def __init__(self, name: str) -> None:
        self.name, self.items = name, []


def _manager_with(plugins: dict[str, object], **kwargs) -> PluginManager:
    manager = PluginManager({}, **kwargs)
    manager._state = "loaded"  # registered by hand below, not discovered from entry points
    manager.pm.add_hookspecs(_PublishedHooks)
    for name, plugin in plugins.items():
        manager.pm.register(plugin, name=name)
    return manager


class _Good:
    @staticmethod
    @spore.hookimpl
    def acme_register_widgets(registry):
        registry.items.append("gear")


class _Broken:
    @staticmethod
    @spore.hookimpl
    def acme_register_widgets(registry):
        raise RuntimeError("no widgets today")


def test_collect_calls_a_published_hook_once_per_plugin(caplog) -> None:
    manager = _manager_with({"zbroken": _Broken(), "agood": _Good()})
    with caplog.at_level(logging.WARNING, logger="spore.plugins"):
        found = manager.collect("acme_register_widgets", _Widgets, skipped="its widgets are lost")
    assert [(name, w.name, w.items) for name, w in found] == [("agood", "agood", ["gear"])]
    assert (
        "spore plugin 'zbroken': hook acme_register_widgets raised: RuntimeError: no widgets "
        "today; its widgets are lost"
    ) in caplog.text
    assert manager.collect("nobody_published_this", _Widgets, skipped="") == []


@pytest.mark.parametrize("kwargs", [{"strict": True}, {"requested": ["zbroken"]}])
def test_collect_raises_for_a_broken_plugin_when_strict_or_asked_for(kwargs) -> None:
    manager = _manager_with({"zbroken": _Broken()}, **kwargs)
    with pytest.raises(PluginError, match="'zbroken': hook acme_register_widgets raised"):
        manager.collect("acme_register_widgets", _Widgets, skipped="")
