"""The booster registry: Python registration, lookup by class name and base classes, options,
boosters from another plugin's hook (and one whose hook raises), the CLI."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pydantic
import pytest
import torch
from click.testing import CliRunner

from lite_boost import boosters
from lite_boost.cli import group

PLUGIN = textwrap.dedent(
    """
    import spore

    def boost_toy(model, options):
        model.boosted_by = "aplugin"

    @spore.hookimpl(optionalhook=True)
    def lite_boost_register_boosters(registry):
        registry.add("PluginToy", boost_toy, ["tags the model"])

    @spore.hookimpl
    def spore_doctor(report):
        pass
    """
)
BROKEN = textwrap.dedent(
    """
    import spore

    @spore.hookimpl(optionalhook=True)
    def lite_boost_register_boosters(registry):
        raise RuntimeError("no video model here")

    @spore.hookimpl
    def spore_doctor(report):
        pass
    """
)


class ToyBase(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class ToyChild(ToyBase):
    pass


class PluginToy(torch.nn.Module):
    pass


@pytest.fixture
def toy_booster() -> Iterator[list]:
    seen: list = []

    @boosters.register_booster("ToyBase", changes=["records the options"])
    def boost_toy(model: torch.nn.Module, options: boosters.BoostOptions) -> None:
        seen.append((type(model).__name__, options.sparsity, options.block_size))

    yield seen
    del boosters._python.boosters["ToyBase"]


def test_boost_finds_the_booster_of_a_base_class_and_passes_the_options(toy_booster):
    model = ToyChild()
    assert boosters.boost(model, sparsity=0.5, block_size=64) is model
    assert toy_booster == [("ToyChild", 0.5, 64)]
    assert model.lite_boost_options.sparsity == 0.5
    assert boosters.find("ToyBase").changes == ("records the options",)


def test_block_size_takes_numpy_and_tensor_integers_as_sparse_attention_does(toy_booster):
    for size in (np.int64(64), np.int32(64), torch.tensor(64)):
        boosters.boost(ToyChild(), block_size=size)
    assert [options[2] for options in toy_booster] == [64, 64, 64]
    assert all(type(options[2]) is int for options in toy_booster)


def test_bad_options_and_unknown_models_are_refused(toy_booster):
    with pytest.raises(pydantic.ValidationError, match="sparsity"):
        boosters.boost(ToyChild(), sparsity=1.0)
    with pytest.raises(pydantic.ValidationError, match="block_size"):
        boosters.boost(ToyChild(), block_size=0)
    with pytest.raises(pydantic.ValidationError, match="greater than 0"):
        boosters.boost(ToyChild(), block_size=np.int64(0))
    for not_an_int in (64.0, True, "64"):
        with pytest.raises(pydantic.ValidationError, match="valid integer"):
            boosters.boost(ToyChild(), block_size=not_an_int)
    for not_a_number in ("0.5", False, torch.tensor(0.5)):  # pydantic would convert each
        with pytest.raises(pydantic.ValidationError, match=r"sparsity\n.*must be a number"):
            boosters.boost(ToyChild(), sparsity=not_a_number)
    assert boosters.boost(ToyChild(), sparsity=np.float32(0.25)).lite_boost_options.sparsity == 0.25
    for width in (np.float16, np.float32):  # as written: 0.7, not 0.699999988 (4 of 10 blocks)
        assert boosters.boost(ToyChild(), sparsity=width(0.7)).lite_boost_options.sparsity == 0.7
    with pytest.raises(TypeError, match=r"boost\(\) patches a model .* got str"):
        boosters.boost("WanTransformer3DModel")
    with pytest.raises(TypeError, match="class_name must be a class's name"):
        boosters.register_booster(123)(lambda m, o: None)
    with pytest.raises(TypeError, match=r"one per change: give \['swaps attention'\]"):
        boosters.register_booster("Other", changes="swaps attention")(lambda m, o: None)
    with pytest.raises(TypeError, match=r"changes must be a list of str, got \[1\]"):
        boosters.register_booster("Other", changes=[1])(lambda m, o: None)
    registry = boosters.BoosterRegistry()  # an iterator is read once, and kept
    kept = registry.add("Other", lambda m, o: None, (c for c in ("one", "two")))
    assert kept.changes == ("one", "two")
    with pytest.raises(LookupError, match=r"no lite-boost booster for Linear \(boosters exist"):
        boosters.boost(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="already registered"):
        boosters.register_booster("ToyBase")(lambda m, o: None)


def test_a_booster_that_is_not_callable_is_refused():
    """``register_booster("X")(None)`` was registered, and failed only when a model was
    boosted."""
    for not_callable in (None, 42, "boost_toy"):
        with pytest.raises(TypeError, match=r"booster must be callable as apply\(model, options\)"):
            boosters.register_booster("NotCallable")(not_callable)
        with pytest.raises(TypeError, match=f"got {type(not_callable).__name__} .* for Other"):
            boosters.BoosterRegistry().add("Other", not_callable)
    assert "NotCallable" not in boosters.boosters()


FIRST_REGISTRATION = """
import pytest
from lite_boost.boosters import find, register_booster

with pytest.raises(ValueError, match="WanTransformer3DModel is already registered.*override=True"):
    register_booster("WanTransformer3DModel")(lambda model, options: None)

@register_booster("WanTransformer3DModel", override=True)
def mine(model, options):
    pass

assert find("WanTransformer3DModel").apply is mine
assert find("AutoencoderKLWan").class_name == "AutoencoderKLWan"
print("ok")
"""


def test_a_clash_with_a_builtin_booster_is_found_at_the_registration():
    """In a fresh process (lite-boost's own boosters not yet loaded): registering one of their
    class names raised only at a later find(), there for every class; now the decorator refuses
    it and ``override=True`` replaces ours."""
    done = subprocess.run(
        [sys.executable, "-c", FIRST_REGISTRATION], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


@pytest.fixture
def booster_plugins(spore_plugin_source: Callable[[str, str], None]) -> None:
    for name, source in {"aplugin": PLUGIN, "zbroken": BROKEN}.items():
        spore_plugin_source(name, source)


def _only(*keep: str) -> dict[str, str]:
    """Every installed plugin but ``keep`` disabled (none of them asked for by name)."""
    from importlib import metadata

    from spore.plugins import ENTRY_POINT_GROUP

    names = {ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    return {"SPORE_DISABLE_PLUGINS": ",".join(sorted(names - set(keep)))}


def test_a_plugin_provides_boosters_and_a_broken_hook_is_skipped(
    booster_plugins: None, spore_manager: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    spore_manager(_only("lite-boost", "kernels", "aplugin", "zbroken"))
    with caplog.at_level(logging.WARNING, logger="lite_boost"):
        model = boosters.boost(PluginToy())
    assert model.boosted_by == "aplugin"
    assert boosters.find("PluginToy").owner == "aplugin"
    assert (
        "spore plugin 'zbroken': hook lite_boost_register_boosters raised: RuntimeError: "
        "no video model here; its boosters are skipped"
    ) in caplog.text


CLASHING = """
import spore

def boost(model, options):
    model.boosted_by = {name!r}

@spore.hookimpl(optionalhook=True)
def lite_boost_register_boosters(registry):
    registry.add("WanTransformer3DModel", boost, override={override})
    registry.add("PluginToy", boost)
"""


def test_clashing_boosters_are_settled_by_precedence_and_logged(
    spore_plugin_source: Callable[[str, str], None],
    spore_manager: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A plugin's booster for a class lite-boost boosts was dropped silently even with
    ``override=True``, and a user's ``register_booster`` replaced a plugin's silently."""
    spore_plugin_source("clasha", CLASHING.format(name="clasha", override=False))
    spore_plugin_source("clashb", CLASHING.format(name="clashb", override=True))
    spore_manager(_only("lite-boost", "kernels", "clasha", "clashb"))
    with caplog.at_level(logging.WARNING, logger="lite_boost"):
        table = boosters.boosters()
    assert table["WanTransformer3DModel"].owner == "clashb"  # override=True replaces ours
    assert table["PluginToy"].owner == "clasha"  # the first by plugin name
    assert (
        "spore plugin 'clasha' registers a booster for WanTransformer3DModel, which lite-boost "
        "boosts itself; the plugin's is skipped"
    ) in caplog.text
    assert "plugins 'clasha' and 'clashb' both register a booster for PluginToy" in caplog.text
    caplog.clear()

    @boosters.register_booster("PluginToy")
    def mine(model: torch.nn.Module, options: boosters.BoostOptions) -> None:
        model.boosted_by = "python"

    try:
        with caplog.at_level(logging.WARNING, logger="lite_boost"):
            assert boosters.boost(PluginToy()).boosted_by == "python"
            boosters.boost(PluginToy())
        assert caplog.text.count("replaces spore plugin 'clasha'") == 1  # logged once
    finally:
        del boosters._python.boosters["PluginToy"]


def test_a_broken_hook_is_an_error_when_asked_for_by_name(
    booster_plugins: None, spore_manager: Callable[..., Any]
) -> None:
    from spore.plugins import PluginError

    spore_manager({"SPORE_PLUGINS": "lite-boost,kernels,zbroken"})
    with pytest.raises(PluginError, match="'zbroken': hook lite_boost_register_boosters raised"):
        boosters.boosters()


def test_cli_explains_a_booster_and_refuses_an_unknown_class(toy_booster):
    result = CliRunner().invoke(group, ["explain", "ToyBase"])
    assert result.exit_code == 0, result.output
    assert result.output == "ToyBase: booster from python\n  - records the options\n"
    result = CliRunner().invoke(group, ["explain", "NoSuchModel"])
    assert result.exit_code == 1
    assert "no lite-boost booster for NoSuchModel" in result.output
    listed = CliRunner().invoke(group, ["boosters"])
    assert "ToyBase  (python)" in listed.output
    toy = {"model_class": "ToyBase", "registered_by": "python", "changes": ["records the options"]}
    rows = json.loads(CliRunner().invoke(group, ["boosters", "--json"]).output)
    assert toy in rows
    owners = {r["model_class"]: r["registered_by"] for r in rows}
    assert owners["WanTransformer3DModel"] == owners["AutoencoderKLWan"] == "lite-boost"
    assert [r["model_class"] for r in rows] == sorted(r["model_class"] for r in rows)
    assert json.loads(CliRunner().invoke(group, ["explain", "ToyBase", "--json"]).output) == toy
