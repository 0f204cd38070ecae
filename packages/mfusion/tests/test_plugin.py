"""mfusion as a Spore plugin: the contract and what it registers."""

from __future__ import annotations

import mfusion
from mfusion.selection import PREFIX


def test_contract(spore_plugin_contract) -> None:
    info = spore_plugin_contract("mfusion")
    assert info.registered["passes"] == sorted(PREFIX + n for n in mfusion.pass_names())


def test_passes_are_registered_for_their_stage_in_priority_order(spore_manager) -> None:
    """The norms' training twins (``*_train``) run before autograd, every other pass post-grad."""
    registry = spore_manager({"SPORE_PLUGINS": "mfusion"}).registry("passes")
    entries = [registry.get(PREFIX + n) for n in mfusion.pass_names()]
    stages = {e.name.removeprefix(PREFIX): e.stage for e in entries}
    training = ["add_rms_norm_train", "layer_norm_train", "rms_norm_train"]
    assert sorted(n for n, stage in stages.items() if stage == "pre_grad") == training
    assert {stage for n, stage in stages.items() if n not in training} == {"post_grad"}
    by_name = {e.name: e.priority for e in entries}
    assert by_name[PREFIX + "add_rms_norm"] > by_name[PREFIX + "rms_norm"]
    assert by_name[PREFIX + "swiglu"] > by_name[PREFIX + "silu_mul"]
    assert min(by_name, key=by_name.get) == PREFIX + "autofuse"
