"""hyperparallel as a Spore plugin: the contract, and ``spore train`` reached through it."""

from __future__ import annotations


def test_contract(spore_plugin_contract) -> None:
    info = spore_plugin_contract("hyperparallel")
    assert info.registered["commands"] == ["train"]
    assert info.registered["benchmarks"]


def test_spore_train_help_lists_every_option(run_spore) -> None:
    done = run_spore("train", "--help", timeout=120)
    assert done.returncode == 0, done.stderr
    for option in ("--set", "--nproc", "--resume", "--output", "--print-config", "torchrun"):
        assert option in done.stdout
