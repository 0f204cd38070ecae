"""dvm as a Spore plugin: the contract, the ``dvm`` backend in Spore's registry and in dynamo
(also through dynamo's own entry point alone), and the region-compiler hook."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import torch

from dvm import benchmarks, plugin
from dvm.region_compiler import COMPILER, DvmRegionCompiler
from spore.testing import clean_environ


def test_contract(spore_plugin_contract: Any) -> None:
    info = spore_plugin_contract("dvm")
    assert info.registered["backends"] == ["dvm"]
    assert info.registered["benchmarks"] == sorted(c.name for c in benchmarks.benchmarks())


def test_the_backend_is_registered_with_spore_and_dynamo(spore_manager: Any) -> None:
    from dvm.backend import dvm_backend

    registry = spore_manager({"SPORE_PLUGINS": "dvm"}).registry("backends")
    entry = registry.entry("dvm")
    assert entry.owner == "dvm"
    assert entry.value.compiler_fn is dvm_backend
    assert not entry.value.fallback
    assert "dvm" in torch._dynamo.list_backends()

    def chain(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x) * y

    x, y = torch.randn(16, 32), torch.randn(16, 32)
    torch.testing.assert_close(torch.compile(chain, backend="dvm")(x, y), chain(x, y))


def test_spore_backends_lists_dvm(run_spore: Any) -> None:
    out = run_spore("backends", "--json", env={"SPORE_PLUGINS": "dvm"}, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert sorted(rows) == ["dvm", "spore"]  # spore-core's own backend, and dvm's
    row = rows["dvm"]
    assert (row["name"], row["registered_by"], row["fallback"]) == ("dvm", "dvm", False)
    assert "VM" in row["description"]


def test_spore_plugins_check_dvm(run_spore: Any) -> None:
    out = run_spore("plugins", "check", "dvm", "--json", env={"SPORE_PLUGINS": "dvm"}, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["ok"], report["problems"]
    (row,) = [r for r in report["plugins"] if r["name"] == "dvm"]
    assert row["status"] == "active"


CHILD = textwrap.dedent(
    """
    import sys

    import torch

    assert not [m for m in sys.modules if m.split(".")[0] in ("dvm", "spore")], "imported early"


    def chain(x, y):
        return torch.softmax(x * torch.sigmoid(x) * y, dim=-1)


    x, y = torch.randn(8, 64), torch.randn(8, 64)
    torch.testing.assert_close(torch.compile(chain, backend="dvm")(x, y), chain(x, y))
    print("loaded", sorted(m for m in sys.modules if m.startswith("dvm.")))
    """
)


def test_torch_compile_finds_dvm_through_the_dynamo_entry_point_alone(tmp_path: Any) -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        env=clean_environ({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}),
        cwd=tmp_path,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.split("loaded", 1)[1]
    assert "'dvm.backend'" in loaded
    assert "'dvm.compile'" in loaded


class _Collecting:
    """What mfusion passes to the hook, reduced to what the hook uses."""

    def __init__(self) -> None:
        self.added: list[Any] = []

    def add(self, compiler: Any) -> Any:
        self.added.append(compiler)
        return compiler


def test_the_hook_adds_one_region_compiler_object_for_the_process() -> None:
    first, second = _Collecting(), _Collecting()
    plugin.mfusion_register_region_compilers(first)
    plugin.mfusion_register_region_compilers(second)
    assert first.added == [COMPILER]
    assert second.added == [COMPILER]
    assert second.added[0] is first.added[0]
    assert isinstance(COMPILER, DvmRegionCompiler)
    impl = plugin.mfusion_register_region_compilers.spore_impl  # type: ignore[attr-defined]
    assert impl["optionalhook"] is True
