from __future__ import annotations

import functools
import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import spore
from spore import passes


class TimesThree(spore.PatternToPatternPass):
    name = "times-three"

    def pattern(self, x):
        return x * 2 + x

    def replacement(self, x):
        return x * 3

    def example_inputs(self):
        return [torch.randn(8)]


class Record(spore.GraphPass):
    name = "record"

    def __init__(self) -> None:
        self.seen: list[list[str]] = []

    def __call__(self, gm) -> int:
        self.seen.append(sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function"}))
        return 0


def _f(x):
    return (x * 2 + x).sin()


@pytest.fixture
def inductor_slots():
    """Inductor's three custom-pass slots, restored after the test (enable() changes them)."""
    from torch._inductor import config

    saved = {slot: getattr(config, slot) for slot in passes.STAGES.values()}
    yield config
    for slot, value in saved.items():
        setattr(config, slot, value)


@pytest.fixture
def run_passes_script(spore_manager, inductor_slots):
    """Runs ``spore passes --run SCRIPT`` in this process (a child would run the installed
    spore) with only the test's passes, restoring the Inductor caches the run turns off
    (``monkeypatch.setattr`` would delete those settings: they are not in the module's
    ``__dict__``). Returns click's result."""
    from click.testing import CliRunner

    from spore.cli.listings import passes_cmd

    spore_manager({"SPORE_NO_PLUGINS": "1"})
    caches = ("fx_graph_cache", "autotune_local_cache")
    saved = {cache: getattr(inductor_slots, cache) for cache in caches}
    yield lambda script: CliRunner().invoke(passes_cmd, ["--run", str(script)])
    for cache, value in saved.items():
        setattr(inductor_slots, cache, value)


def _g(x):
    return (x * 2 + x).cos()


def test_backend_spore_runs_the_passes_for_its_compile_only(spore_manager, inductor_slots) -> None:
    spore_manager()
    record = Record()
    spore.register_custom_pass(TimesThree(), priority=10)
    spore.register_custom_pass(record, priority=0)
    torch._dynamo.reset()
    x = torch.randn(16)
    before = {slot: getattr(inductor_slots, slot) for slot in passes.STAGES.values()}
    # a cached graph runs no pass
    compiled = torch.compile(_f, backend="spore", options={"fx_graph_cache": False})
    torch.testing.assert_close(compiled(x), (x * 3).sin())
    assert passes.stats()["times-three"] == 1
    assert record.seen[-1] == ["aten.mul.Tensor", "aten.sin.default"]  # the add is gone
    assert {slot: getattr(inductor_slots, slot) for slot in passes.STAGES.values()} == before
    runs = len(record.seen)
    with inductor_slots.patch(fx_graph_cache=False):
        torch.testing.assert_close(torch.compile(_g)(x), _g(x))
    assert len(record.seen) == runs, "a plain torch.compile must run no Spore pass"


def test_registering_alone_runs_nothing(spore_manager, inductor_slots) -> None:
    spore_manager()
    record = Record()
    spore.register_custom_pass(record)
    torch._dynamo.reset()
    with inductor_slots.patch(fx_graph_cache=False):
        torch.compile(_f)(torch.randn(8))
    assert record.seen == []
    assert inductor_slots.post_grad_custom_post_pass is None


def test_plain_functions_are_registered_under_their_own_names(spore_manager) -> None:
    """Named after the function (it was its type, ``function``: a second one clashed, and
    ``override=True`` dropped the first)."""
    spore_manager()

    def fold_adds(gm) -> int:
        return 0

    def drop_clones(gm) -> int:
        return 0

    assert spore.register_custom_pass(fold_adds).name == "fold_adds"
    assert spore.register_custom_pass(drop_clones).name == "drop_clones"
    ran = passes.apply(torch.fx.symbolic_trace(_g))
    assert {"fold_adds", "drop_clones"} <= set(ran)


def _user_pass(tag: str):
    """A user's own pass in Inductor's slot (a ``CustomGraphPass`` keyed ``tag``), counting its
    runs."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class UserPass(CustomGraphPass):
        runs = 0

        def __call__(self, graph) -> None:
            self.runs += 1

        def uuid(self) -> str:
            return tag

    return UserPass()


def test_enable_is_idempotent_chains_the_users_pass_and_sees_later_passes(
    spore_manager, inductor_slots
) -> None:
    spore_manager()
    user = _user_pass("user-pass-v1")
    inductor_slots.post_grad_custom_post_pass = user
    passes.enable()
    multiplexer = inductor_slots.post_grad_custom_post_pass
    passes.enable()
    assert inductor_slots.post_grad_custom_post_pass is multiplexer
    assert multiplexer.previous is user
    assert type(inductor_slots.pre_grad_custom_pass).__name__ == "SporePassMultiplexer"
    record = Record()
    spore.register_custom_pass(record)  # registered after enable(): runs too
    torch._dynamo.reset()
    with inductor_slots.patch(fx_graph_cache=False):
        torch.compile(_f)(torch.randn(8))
    assert len(record.seen) == 1
    assert user.runs == 1


@pytest.mark.parametrize("route", ["backend", "enable"])
def test_a_users_inference_aware_pass_is_chained_with_is_inference(
    route: str, spore_manager, inductor_slots
) -> None:
    from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass

    class InferenceAware(CustomInferenceAwareGraphPass):
        def __init__(self) -> None:
            self.seen: list[bool] = []

        def __call__(self, graph, is_inference: bool) -> None:
            self.seen.append(is_inference)

        def uuid(self) -> str:
            return "inference-aware-v1"

    spore_manager()
    user = InferenceAware()
    inductor_slots.post_grad_custom_post_pass = user
    torch._dynamo.reset()
    x = torch.randn(8)
    with inductor_slots.patch(fx_graph_cache=False):
        if route == "enable":
            passes.enable()
            out = torch.compile(_g)(x)
        else:
            out = torch.compile(_g, backend="spore")(x)
    torch.testing.assert_close(out, _g(x))
    assert user.seen == [True], "Inductor calls it with is_inference; so must the chain"


def test_a_slot_listing_spores_multiplexer_beside_a_users_pass_runs_each_once(
    spore_manager, inductor_slots
) -> None:
    spore_manager()
    record = Record()
    spore.register_custom_pass(record)
    passes.enable()
    user = _user_pass("user-pass-list")
    slot = "post_grad_custom_post_pass"
    setattr(inductor_slots, slot, [getattr(inductor_slots, slot), user])  # torch takes a list
    passes.enable()
    multiplexer = getattr(inductor_slots, slot)
    assert type(multiplexer).__name__ == "SporePassMultiplexer"
    assert multiplexer.previous == [user]
    torch._dynamo.reset()
    with inductor_slots.patch(fx_graph_cache=False):
        torch.compile(_f, backend="spore")(torch.randn(8))
    assert (len(record.seen), user.runs) == (1, 1)


def test_enable_under_a_new_manager_replaces_the_old_registrys_multiplexer(
    spore_manager, inductor_slots
) -> None:
    spore_manager()
    passes.enable()
    old = inductor_slots.joint_custom_post_pass
    second = spore_manager()
    passes.enable()
    new = inductor_slots.joint_custom_post_pass
    assert new is not old
    assert new.registry is second.registry("passes")
    assert new.previous is None, "the old registry's multiplexer is replaced, not chained"


def test_backend_spore_applies_mode_and_options(spore_manager) -> None:
    from torch._inductor import config

    seen: list[tuple[bool, bool]] = []

    def probe(gm) -> int:
        seen.append((config.epilogue_fusion, config.max_autotune))
        return 0

    spore_manager()
    spore.register_custom_pass(probe, name="config-probe")
    x = torch.randn(8)
    for kwargs in (
        {"options": {"epilogue_fusion": False}},
        {"mode": "max-autotune-no-cudagraphs"},
    ):
        torch._dynamo.reset()
        with config.patch(fx_graph_cache=False):
            torch.testing.assert_close(torch.compile(_g, backend="spore", **kwargs)(x), _g(x))
    assert seen == [(False, False), (config.epilogue_fusion, True)]
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown Inductor option 'epilogue_fusio'") as info:
        torch.compile(_g, backend="spore", options={"epilogue_fusio": False})(x)
    assert "did you mean 'epilogue_fusion'?" in str(info.value)
    assert info.value.__cause__ is None  # dynamo raises from None (as the docs say)
    assert isinstance(info.value.inner_exception, ValueError)


def test_apply_without_compiling_is_idempotent(spore_manager) -> None:
    spore_manager({"SPORE_NO_PLUGINS": "1"})  # only this test's pass
    spore.register_custom_pass(TimesThree())
    gm = make_fx(_f)(torch.randn(8))
    assert passes.apply(gm) == {"times-three": 1}
    assert passes.apply(gm) == {"times-three": 0}
    x = torch.randn(8)
    torch.testing.assert_close(gm(x), (x * 3).sin())


def _examples() -> list[torch.Tensor]:
    return [torch.randn(8)]


class TimesThreeForms(spore.PatternToPatternPass):
    """Two forms sharing the pass's replacement, one refused by its own check, one with its own
    replacement."""

    name = "times-three-forms"

    def replacement(self, x):
        return x * 3

    def search_forms(self):
        return [
            spore.SearchForm(lambda x: x * 2 + x, _examples),
            spore.SearchForm(lambda x: x + x * 2, _examples),
            spore.SearchForm(lambda x: x * 2 + x * 2, _examples, extra_check=lambda match: False),
            spore.SearchForm(lambda x: x * 2 - x, _examples, replacement=lambda x: x.neg().neg()),
        ]


def _forms(x):
    return (x * 2 + x).sin() + (x + x * 2).cos() + (x * 2 + x * 2).exp() + (x * 2 - x).tanh()


def _targets(gm) -> list[str]:
    return sorted(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def test_search_forms_share_the_replacement_or_bring_their_own(spore_manager) -> None:
    spore_manager({"SPORE_NO_PLUGINS": "1"})  # only this test's pass
    spore.register_custom_pass(TimesThreeForms())
    x = torch.randn(8)
    gm = make_fx(_forms)(x)
    assert passes.apply(gm) == {"times-three-forms": 3}
    assert passes.apply(gm) == {"times-three-forms": 0}
    # x * 3 twice, x.neg().neg(); the refused x * 2 + x * 2 and the three outer sums stay
    assert _targets(gm) == sorted(
        ["aten.mul.Tensor"] * 4
        + ["aten.add.Tensor"] * 4
        + ["aten.neg.default"] * 2
        + ["aten.sin.default", "aten.cos.default", "aten.exp.default", "aten.tanh.default"]
    )
    torch.testing.assert_close(gm(x), _forms(x))


class FlatTimesTwo(spore.PatternToPatternPass):
    """A pattern with a view: ``x.view(-1) * 2``."""

    name = "flat-times-two"

    def pattern(self, x):
        return x.view(-1) * 2

    def replacement(self, x):
        return x.view(-1) + x.view(-1)

    def example_inputs(self):
        return [torch.randn(2, 4)]


class FlatTimesTwoReshaped(FlatTimesTwo):
    name = "flat-times-two-reshaped"
    reshape_views = True


def _flat(x):
    return (x.view(-1) * 2).sin()


def test_a_post_grad_pattern_with_a_view_matches_with_reshape_views(spore_manager) -> None:
    """Inductor hands post_grad passes graphs whose views are reshapes."""
    spore_manager({"SPORE_NO_PLUGINS": "1"})  # only this test's passes
    spore.register_custom_pass(FlatTimesTwo(), priority=1)
    spore.register_custom_pass(FlatTimesTwoReshaped())
    torch._dynamo.reset()
    x = torch.randn(2, 4)
    compiled = torch.compile(_flat, backend="spore", options={"fx_graph_cache": False})
    torch.testing.assert_close(compiled(x), _flat(x))
    stats = passes.stats()
    assert (stats["flat-times-two"], stats["flat-times-two-reshaped"]) == (0, 1)


def test_device_filter_skips_other_devices(spore_manager) -> None:
    spore_manager({"SPORE_NO_PLUGINS": "1"})  # only this test's pass
    spore.register_custom_pass(TimesThree(), device="cuda")
    gm = make_fx(_f)(torch.randn(8))
    assert passes.apply(gm) == {}


def test_device_filter_holds_in_every_stage_of_a_compile(spore_manager) -> None:
    """Dynamo's pre-grad graph records its inputs as ``example_value``: a ``device="cuda"``
    pre-grad pass ran on CPU graphs."""
    spore_manager({"SPORE_NO_PLUGINS": "1"})  # only this test's passes
    ran = []
    for stage in ("pre_grad", "post_grad"):
        spore.register_custom_pass(
            lambda gm, stage=stage: ran.append(stage) or 0,
            name=f"cuda-{stage}",
            stage=stage,
            device="cuda",
        )
        spore.register_custom_pass(
            lambda gm, stage=stage: ran.append(f"any {stage}") or 0,
            name=f"any-{stage}",
            stage=stage,
        )
    torch._dynamo.reset()
    compiled = torch.compile(_f, backend="spore", options={"fx_graph_cache": False})
    x = torch.randn(8)
    torch.testing.assert_close(compiled(x), _f(x))
    assert sorted(ran) == ["any post_grad", "any pre_grad"]


def test_spore_passes_lists_the_stages_in_the_order_they_run(spore_manager) -> None:
    """The listing sorted stages by name: post_grad came before pre_grad."""
    from click.testing import CliRunner

    from spore.cli.listings import passes_cmd

    spore_manager({"SPORE_NO_PLUGINS": "1"})  # only this test's passes
    for stage in ("post_grad", "joint", "pre_grad"):
        for priority in (1, 9):
            spore.register_custom_pass(
                lambda gm: 0, name=f"{stage}-{priority}", stage=stage, priority=priority
            )
    result = CliRunner().invoke(passes_cmd, ["--json"])
    assert result.exit_code == 0, result.output
    names = [row["name"] for row in json.loads(result.output)]
    assert names == [f"{s}-{p}" for s in ("pre_grad", "joint", "post_grad") for p in (9, 1)]


def test_spore_passes_run_prints_the_traceback_of_a_script_that_raised(
    run_passes_script, tmp_path
) -> None:
    """Only "Error: model.py raised ValueError: boom" was printed; now the script's traceback
    comes first, as under `python model.py`, without the runner's frames."""
    script = tmp_path / "model.py"
    script.write_text('def check(x):\n    raise ValueError(f"boom {x}")\n\ncheck(3)\n')
    result = run_passes_script(script)
    assert result.exit_code == 1
    assert result.output.endswith(
        "Traceback (most recent call last):\n"
        f'  File "{script}", line 4, in <module>\n'
        "    check(3)\n"
        f'  File "{script}", line 2, in check\n'
        '    raise ValueError(f"boom {x}")\n'
        "ValueError: boom 3\n"
        f"Error: {script} raised ValueError: boom 3\n"
    )


def _compiled(tmp_path, source: str) -> str:
    """A ``.pyc`` of ``source``: its frames name ``model.py``, not the script run."""
    import py_compile

    (tmp_path / "model.py").write_text(source)
    return py_compile.compile(str(tmp_path / "model.py"), cfile=str(tmp_path / "model.pyc"))


def _zipped(tmp_path, source: str) -> str:
    """A zip holding ``source`` as ``__main__.py``: its frames name ``app.zip/__main__.py``."""
    import zipfile

    with zipfile.ZipFile(tmp_path / "app.zip", "w") as archive:
        archive.writestr("__main__.py", source)
    return str(tmp_path / "app.zip")


@pytest.mark.parametrize("make", [_compiled, _zipped])
def test_spore_passes_run_prints_the_traceback_of_code_not_under_the_scripts_path(
    run_passes_script, tmp_path, make
) -> None:
    """The traceback was cut from the first frame under the script's own path: a compiled
    script's frames name its source and a zip's its ``__main__.py``, so only the exception
    line was printed. The runner's frames are what is left out now."""
    script = make(tmp_path, 'def check(x):\n    raise ValueError(f"boom {x}")\n\ncheck(3)\n')
    result = run_passes_script(script)
    assert result.exit_code == 1
    traceback = result.output.split("ValueError: boom 3\n")[0]
    assert traceback.startswith("Traceback (most recent call last):\n  File ")
    assert traceback.count("  File ") == 2  # the code's frames, none of the runner's
    assert "line 4, in <module>\n" in traceback
    assert "line 2, in check\n" in traceback
    assert result.output.endswith(f"Error: {script} raised ValueError: boom 3\n")


def test_spore_passes_run_exits_130_when_the_script_is_interrupted(
    run_passes_script, tmp_path
) -> None:
    """Ctrl-C in the script ended the command with status 1 and only "Aborted!" (click's);
    now with 130, as under `python model.py` and `spore run`, after the script's traceback."""
    script = tmp_path / "model.py"
    script.write_text("raise KeyboardInterrupt\n")
    result = run_passes_script(script)
    assert result.exit_code == 130
    assert result.output == (
        "Traceback (most recent call last):\n"
        f'  File "{script}", line 1, in <module>\n'
        "    raise KeyboardInterrupt\n"
        "KeyboardInterrupt\n"
        f"Error: {script} was interrupted (Ctrl-C)\n"
    )


def test_bad_registrations(spore_manager) -> None:
    spore_manager()
    with pytest.raises(ValueError, match="unknown pass stage 'late'"):
        spore.register_custom_pass(TimesThree(), stage="late")
    with pytest.raises(ValueError, match="only 'inductor'"):
        spore.register_custom_pass(TimesThree(), backend="tvm")
    with pytest.raises(TypeError, match="must be callable"):
        spore.register_custom_pass(42)
    # each was accepted: "high" failed every later compile's sort, 5 never matched a device
    with pytest.raises(TypeError, match="priority must be an int, got 'high'"):
        spore.register_custom_pass(TimesThree(), priority="high")
    # so were these, then never ran: the device matched no graph, the class was called with gm
    for device in (5, "CPU", "cpu:0"):
        with pytest.raises(ValueError, match=r"device .* must be a lower-case device type"):
            spore.register_custom_pass(TimesThree(), device=device)
    with pytest.raises(TypeError, match=r"an instance of the pass class TimesThree, not the"):
        spore.register_custom_pass(TimesThree)
    assert "times-three" not in spore.get_registry("passes")


def test_a_pattern_pass_at_pre_grad_is_refused(spore_manager) -> None:
    """It was accepted and then rewrote nothing, without a word: its pattern is traced to aten,
    and Inductor's pre_grad graph holds torch-level calls."""
    spore_manager()
    with pytest.raises(ValueError, match=r"TimesThree is a PatternToPatternPass.*'post_grad'"):
        spore.register_custom_pass(TimesThree(), stage="pre_grad")
    assert "times-three" not in spore.get_registry("passes")
    spore.register_custom_pass(lambda gm: 0, name="pre-grad-fn", stage="pre_grad")
    assert "pre-grad-fn" in spore.get_registry("passes")


def test_a_partial_pass_is_keyed_by_what_it_wraps() -> None:
    """Every functools.partial had the key 'functools.partial:1': a changed one hit the FX
    graph cache and never ran."""
    from spore.graph_passes import PassEntry

    def keyed(fn):
        return PassEntry("p", fn, "post_grad").cache_key()

    def scale(gm, factor):
        return 0

    def shift(gm, factor):
        return 0

    assert keyed(functools.partial(scale, factor=2)) != keyed(functools.partial(shift, factor=2))
    assert keyed(functools.partial(scale, factor=2)) != keyed(functools.partial(scale, factor=3))
    assert keyed(functools.partial(scale, factor=2)) == keyed(functools.partial(scale, factor=2))
    # a tensor's repr is shortened: two that differ in one element had one key; no caching
    big = torch.zeros(5000)
    assert keyed(functools.partial(scale, factor=big)) is None

    class Versioned:
        version = "1"

        def __call__(self, gm, factor):
            return 0

        def uuid(self):
            return None  # "do not cache": a partial of it hit the cache all the same

    assert keyed(functools.partial(Versioned(), factor=2)) is None
    Versioned.uuid = lambda self: "u"
    first = keyed(functools.partial(Versioned(), factor=2))
    Versioned.version = "2"  # read from the partial, not the pass: the key did not change
    assert keyed(functools.partial(Versioned(), factor=2)) not in (None, first)


def test_an_edited_pass_is_a_new_key(tmp_path, monkeypatch) -> None:
    """A pass's key named its function or class and version, not its code: after editing a
    pass, Inductor's FX graph cache replayed the graph the old pass had made."""
    import importlib

    from spore.graph_passes import PassEntry

    def keyed(fn):
        return PassEntry("p", fn, "post_grad").cache_key()

    def made(body):  # a function or class defined where there is no file (a notebook cell)
        space = {"spore": spore}
        exec(textwrap.dedent(body), space)
        return space["p"]

    returns_zero, returns_one = "def p(gm):\n    return 0", "def p(gm):\n    return 1"
    assert keyed(made(returns_zero)) == keyed(made(returns_zero))
    assert keyed(made(returns_zero)) != keyed(made(returns_one))
    as_class = "class P(spore.GraphPass):\n    def __call__(self, gm):\n        return {}\np = P()"
    assert keyed(made(as_class.format(0))) == keyed(made(as_class.format(0)))
    assert keyed(made(as_class.format(0))) != keyed(made(as_class.format(1)))

    monkeypatch.syspath_prepend(str(tmp_path))
    source = tmp_path / "edited_pass.py"
    helper = "def helper(gm):\n    return {}\n\ndef p(gm):\n    return helper(gm)\n"
    source.write_text(helper.format(0))
    module = importlib.import_module("edited_pass")
    try:
        before = keyed(module.p)
        assert keyed(module.p) == before
        source.write_text(helper.format(10))  # only a helper the pass calls changes
        importlib.reload(module)
        assert keyed(module.p) != before
    finally:
        sys.modules.pop("edited_pass", None)


def _cached_run(script: str, folder, **env: str) -> dict:
    """``script`` run in a child process in ``folder`` with Inductor's FX graph cache on, in
    ``folder/inductor``, and no SPORE_ variables but ``env``: the JSON of its last line."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SPORE_")}
    environ.update(
        TORCHINDUCTOR_CACHE_DIR=str(folder / "inductor"), TORCHINDUCTOR_FX_GRAPH_CACHE="1", **env
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=environ,
        timeout=600,
        cwd=folder,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_a_pass_without_a_file_has_one_key_in_every_process() -> None:
    """A set literal's constant (a frozenset) is ordered by the hash seed: a pass defined in a
    notebook cell with one had another FX-cache key in each process (a miss each time)."""
    cell = "def p(gm):\n    return int(gm in {'aa', 'bb', 'cc', 'dd'})"
    script = (
        "from spore.graph_passes import PassEntry\n"
        f"space = {{}}\nexec({cell!r}, space)\n"
        "print(PassEntry('p', space['p'], 'post_grad').cache_key())\n"
    )
    keys = {
        subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": seed, "SPORE_NO_PLUGINS": "1"},
            timeout=120,
            check=True,
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(keys) == 1, keys


EDITED_SCRIPT = textwrap.dedent(
    """
    import json, torch, spore
    from user_pass import user_pass
    spore.register_custom_pass(user_pass, name="user-pass")
    out = torch.compile(lambda x: x * 2, backend="spore")(torch.ones(3))
    print(json.dumps(dict(out=out.tolist(), stats=spore.passes.stats())))
    """
)
PASS_SOURCES = (
    "def user_pass(gm):\n    return 0\n",
    "import torch\n\ndef user_pass(gm):\n    n = 0\n    for node in gm.graph.nodes:\n"
    "        if node.target is torch.ops.aten.mul.Tensor:\n"
    "            node.target, n = torch.ops.aten.add.Tensor, n + 1\n    return n\n",
)


def test_the_fx_graph_cache_misses_after_a_pass_is_edited(tmp_path) -> None:
    """Two runs of one script sharing a cache directory, the pass's file edited between them:
    the second compiles again and runs the edited pass (it replayed the old graph)."""
    runs = []
    for source in PASS_SOURCES:
        (tmp_path / "user_pass.py").write_text(source)
        # the installed plugins' passes are not this test's
        runs.append(_cached_run(EDITED_SCRIPT, tmp_path, SPORE_NO_PLUGINS="1"))
    assert runs[0] == {"out": [2.0, 2.0, 2.0], "stats": {"user-pass": 0}}
    assert runs[1] == {"out": [3.0, 3.0, 3.0], "stats": {"user-pass": 1}}


def test_a_pass_returning_anything_but_a_count_is_named() -> None:
    """A pass returning the graph (FX's habit) failed with int()'s TypeError, naming neither
    the pass nor what it should return."""
    from spore.graph_passes import PassEntry, run_passes

    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    counts = run_passes(
        gm,
        [PassEntry("n", lambda g: None, "post_grad"), PassEntry("b", lambda g: True, "post_grad")],
    )
    assert counts == {"b": 1, "n": 0}
    with pytest.raises(TypeError, match=r"pass 'gm' returned the GraphModule; a spore pass rewr"):
        run_passes(gm, [PassEntry("gm", lambda g: g, "post_grad")])
    with pytest.raises(TypeError, match=r"pass 's' returned str; a spore pass rewrites"):
        run_passes(gm, [PassEntry("s", lambda g: "done", "post_grad")])


def test_a_pass_returning_a_graph_traced_from_a_function_is_named_as_the_graph() -> None:
    """FX names a GraphModule's class after the function it traced: the error said the pass
    "returned model_forward"."""
    from spore.graph_passes import PassEntry, run_passes

    def model_forward(x):
        return x.sin()

    gm = make_fx(model_forward)(torch.randn(3))
    with pytest.raises(TypeError, match=r"pass 'fx' returned the GraphModule; a spore pass"):
        run_passes(gm, [PassEntry("fx", lambda g: g, "post_grad")])


def test_a_pass_class_missing_a_method_names_the_pass_and_the_method() -> None:
    """A PatternToPatternPass without example_inputs() registered fine, then failed every
    compile with a bare NotImplementedError('')."""
    from spore.graph_passes import PassEntry, run_passes

    class NoExamples(spore.PatternToPatternPass):
        name = "no-examples"

        def pattern(self, x):
            return x * 2 + x

        def replacement(self, x):
            return x * 3

    class NoCall(spore.GraphPass):
        pass

    gm = make_fx(_f)(torch.randn(8))
    with pytest.raises(
        NotImplementedError,
        match=r"pass 'no-examples' \(.*NoExamples\) does not define example_inputs\(\); a "
        r"PatternToPatternPass defines pattern\(\), replacement\(\) and example_inputs\(\)",
    ):
        run_passes(gm, [PassEntry("no-examples", NoExamples(), "post_grad")])
    with pytest.raises(
        NotImplementedError,
        match=r"pass 'NoCall' \(.*NoCall\) does not define __call__\(gm\); a GraphPass defines",
    ):
        run_passes(gm, [PassEntry("NoCall", NoCall(), "post_grad")])


def test_a_pass_missing_a_method_is_named_as_registered() -> None:
    """The error named a pass by its class's ``name``: one registered as 'mine' (what
    ``spore passes`` lists) was called 'half', and two instances under two names looked alike."""
    from spore.graph_passes import PassEntry, UndefinedPassMethodError, run_passes

    class Half(spore.GraphPass):
        name = "half"

    gm = make_fx(_f)(torch.randn(8))
    with pytest.raises(UndefinedPassMethodError, match=r"^pass 'mine' \(.*Half\) does not"):
        run_passes(gm, [PassEntry("mine", Half(), "post_grad")])
    with pytest.raises(NotImplementedError, match=r"^pass 'half' \(.*Half\) does not") as info:
        Half()(gm)  # not registered: its own name
    copied = pickle.loads(pickle.dumps(info.value))  # as a worker process sends it back
    assert (type(copied), str(copied)) == (UndefinedPassMethodError, str(info.value))
    assert copied.method == "__call__(gm)"


def test_a_pass_returning_none_after_rewriting_in_place_is_recompiled() -> None:
    """A pass that edits the graph and returns None ("an int, or None") left the GraphModule
    running its old code: it was recompiled only after a count above 0."""
    from spore.graph_passes import PassEntry, run_passes

    def sin_to_cos(gm):
        for node in gm.graph.nodes:
            if node.target is torch.ops.aten.sin.default:
                node.target = torch.ops.aten.cos.default

    gm = make_fx(lambda x: x.sin())(torch.randn(4))
    assert run_passes(gm, [PassEntry("sin_to_cos", sin_to_cos, "post_grad")]) == {"sin_to_cos": 0}
    x = torch.randn(4)
    torch.testing.assert_close(gm(x), x.cos())


def test_an_instance_or_closure_pass_is_keyed_by_the_constants_it_holds() -> None:
    """ScaleMul(3.0) and ScaleMul(5.0) had one FX-cache key (the class and its version): after
    replacing one by the other the cache replayed the old rewrite. Closures from one factory
    alike. Other state is not seen (a function it holds), nor private attributes (caches)."""
    from spore.graph_passes import PassEntry

    def keyed(fn):
        return PassEntry("p", fn, "post_grad").cache_key()

    class ScaleMul:
        def __init__(self, factor, helper=None):
            self.factor, self.helper, self._cache = factor, helper, object()

        def __call__(self, gm):
            return 0

    def scaling(factor):
        def scale(gm):
            return factor * 0

        return scale

    assert keyed(ScaleMul(3.0)) != keyed(ScaleMul(5.0))
    assert keyed(ScaleMul(3.0, helper=len)) == keyed(ScaleMul(3.0, helper=print))
    registered = PassEntry("p", ScaleMul(3.0), "post_grad")
    before = registered.cache_key()
    registered.pass_.factor = 4.0  # as registered: a run counter must not change the key
    assert registered.cache_key() == before
    assert keyed(scaling(3.0)) != keyed(scaling(5.0))
    assert keyed(scaling(3.0)) == keyed(scaling(3.0))
    assert keyed(ScaleMul(3.0).__call__) != keyed(ScaleMul(5.0).__call__)  # a bound method
    assert keyed(lambda gm, f=3.0: 0) != keyed(lambda gm, f=5.0: 0)  # a default
    # a set's repr follows the hash seed: never part of a key (the cache would always miss)
    assert keyed(ScaleMul(frozenset({"mm", "addmm"}))) == keyed(ScaleMul(frozenset()))


CACHE_SCRIPT = textwrap.dedent(
    """
    import json, torch, spore, spore.passes
    from torch._dynamo.utils import counters
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class UserPass(CustomGraphPass):
        runs = 0
        def __call__(self, graph):
            UserPass.runs += 1
        def uuid(self):
            return "user-pass-v1"

    config.post_grad_custom_post_pass = UserPass()

    class Count(spore.GraphPass):
        def __init__(self, name):
            self.name, self.runs = name, 0
        def __call__(self, gm):
            self.runs += 1
            return 0

    def f(x):
        return (x * 2 + 1).sin()

    def compile_once():
        torch._dynamo.reset()
        torch.compile(f)(torch.randn(8))
        return dict(hit=counters["inductor"]["fxgraph_cache_hit"],
                    miss=counters["inductor"]["fxgraph_cache_miss"])

    first = Count("first")
    spore.register_custom_pass(first)
    spore.passes.enable()
    a = compile_once()
    b = compile_once()
    second = Count("second")
    spore.register_custom_pass(second)
    c = compile_once()
    print(json.dumps(dict(a=a, b=b, c=c, first=first.runs, second=second.runs,
                          user=UserPass.runs)))
    """
)


def test_fx_graph_cache_hits_when_unchanged_and_misses_after_a_new_pass(tmp_path) -> None:
    """After enable(), in one process: a new pass changes the key; the user's pass still runs."""
    r = _cached_run(CACHE_SCRIPT, tmp_path)
    assert r["a"] == {"hit": 0, "miss": 1}
    assert r["b"] == {"hit": 1, "miss": 1}, "an unchanged setup must hit the FX graph cache"
    assert r["c"] == {"hit": 1, "miss": 2}, "a new pass must change the cache key"
    assert r["first"] == 2  # compiled twice (a, c); the cache hit ran no pass
    assert r["second"] == 1
    assert r["user"] == 2, "the pass the user had in the slot keeps running"


def test_uuid_follows_the_registered_set_and_versions(spore_manager, inductor_slots) -> None:
    spore_manager()
    first = Record()
    spore.register_custom_pass(first, name="uuid-probe")
    passes.enable()
    multiplexer = inductor_slots.post_grad_custom_post_pass
    assert type(multiplexer).__name__ == "SporePassMultiplexer"
    before = multiplexer.uuid()
    assert multiplexer.uuid() == before  # stable while nothing changes
    first.version = "2"
    bumped = multiplexer.uuid()
    assert bumped != before
    spore.register_custom_pass(Record(), name="uuid-probe-2")
    assert multiplexer.uuid() not in (before, bumped)


def test_uuid_follows_a_registered_passs_own_uuid_and_what_it_is(
    spore_manager, inductor_slots
) -> None:
    class Keyed(Record):
        key: str | None = "keyed-1"

        def uuid(self) -> str | None:
            return self.key

    class Other(Record):
        pass

    spore_manager()
    keyed = Keyed()
    spore.register_custom_pass(keyed, name="keyed")
    passes.enable()
    multiplexer = inductor_slots.post_grad_custom_post_pass
    before = multiplexer.uuid()
    keyed.key = "keyed-2"  # its behaviour changed, its name and version did not
    assert multiplexer.uuid() != before
    keyed.key = None  # a pass that asks Inductor not to cache
    assert multiplexer.uuid() is None

    spore_manager()  # a fresh manager: one pass, then another under its name and version
    spore.register_custom_pass(Record(), name="swapped")
    passes.enable()
    record_key = inductor_slots.post_grad_custom_post_pass.uuid()
    spore_manager()
    spore.register_custom_pass(Other(), name="swapped")
    passes.enable()
    assert inductor_slots.post_grad_custom_post_pass.uuid() != record_key


def test_a_chained_pass_without_uuid_turns_the_fx_graph_cache_off(
    spore_manager, inductor_slots
) -> None:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Keyed(CustomGraphPass):
        def __call__(self, graph) -> None:
            pass

        def uuid(self) -> str:
            return "keyed-1"

    spore_manager()
    inductor_slots.post_grad_custom_post_pass = Keyed()
    passes.enable()
    keyed = inductor_slots.post_grad_custom_post_pass.uuid()
    assert isinstance(keyed, str)
    inductor_slots.post_grad_custom_post_pass = lambda graph: None  # a plain function: no uuid
    passes.enable()
    assert inductor_slots.post_grad_custom_post_pass.uuid() is None  # Inductor then bypasses


COUNTING_SCRIPT = """
import sys, torch, spore
import beside  # a module next to the script, importable as under `python model.py`
class Muls(spore.GraphPass):
    name = "count-muls"
    def __call__(self, gm):
        return sum(n.target == torch.ops.aten.mul.Tensor for n in gm.graph.nodes)
spore.register_custom_pass(Muls())
print("ran with", sys.argv[1:])
torch.compile(lambda x: x * 2 * x)(torch.randn(4))
if sys.argv[1:] == ["fail"]:
    raise RuntimeError("boom")
if sys.argv[1:] == ["exit"]:
    sys.exit(3)
"""


def test_spore_passes_run_lists_the_rewrites_a_script_caused(run_spore, tmp_path) -> None:
    script = tmp_path / "model.py"
    script.write_text(COUNTING_SCRIPT)
    (tmp_path / "beside.py").write_text("")
    only_user = {"SPORE_NO_PLUGINS": "1"}  # installed plugins' passes stay out of the listing
    script_args = ("--flag", "--json", "--help")  # spore's option names too are the script's
    out = run_spore("passes", "--json", "--run", str(script), *script_args, env=only_user)
    assert out.returncode == 0, out.stderr
    assert "ran with ['--flag', '--json', '--help']" in out.stderr  # its stdout: to stderr
    (row,) = json.loads(out.stdout)
    assert (row["name"], row["registered_by"], row["matches"]) == ("count-muls", "user", 2)
    failed = run_spore("passes", f"--run={script}", "fail")
    assert failed.returncode == 1
    assert "model.py raised RuntimeError: boom" in failed.stderr
    exited = run_spore("passes", "--run", str(script), "exit")
    assert exited.returncode == 3  # the script's own status, as under `python model.py`
    assert "model.py exited with status 3" in exited.stderr
    stray = run_spore("passes", "extra")
    assert stray.returncode == 2
    assert "use --run SCRIPT ARGS" in stray.stderr
