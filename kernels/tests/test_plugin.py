"""spore-kernels as a Spore plugin and as an op library: the plugin contract, and
``import spore_kernels`` defining the ops in a fresh process without loading any plugin, while
``spore ops`` still names the ``kernels`` plugin as their owner once the plugin manager loads it.

The children run with a stand-in plugin (``sentinel``) installed on their ``PYTHONPATH``, so
"loads no plugin" is checked against a plugin that is always there to be loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from spore_kernels.registration import PROVIDER

OPS = ["add_rms_norm", "gelu", "layer_norm", "mean_var", "rms_norm", "rope", "silu_mul", "swiglu"]
ALL_OPS = sorted(
    OPS
    + [f"{op}_backward" for op in [*OPS, "triangle_attention"]]
    + ["block_sparse_attention", "triangle_attention"]
)


@pytest.fixture(scope="module")
def sentinel_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding an installed stand-in plugin ``sentinel`` (module ``spore_sentinel``)."""
    root = tmp_path_factory.mktemp("sentinel")
    (root / "spore_sentinel.py").write_text(
        "import spore\n\n\n@spore.hookimpl\ndef spore_doctor(report):\n    pass\n"
    )
    info = root / "spore_sentinel-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: spore-sentinel\nVersion: 0.1.0\n"
        "Requires-Dist: spore-core>=0.1,<0.2\n"
    )
    (info / "entry_points.txt").write_text("[spore.plugins]\nsentinel = spore_sentinel\n")
    return root


def _child(code: str, sentinel: Path, tmp_path: Path, **env: str) -> dict[str, Any]:
    """Run ``code`` in a fresh Python with the sentinel installed; its last stdout line (JSON)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SPORE_")}
    paths = [str(sentinel), environ.get("PYTHONPATH", "")]
    environ.update(env, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=environ,
    )
    assert done.returncode == 0, f"child failed:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


IMPORT_ONLY = """
    import json, sys
    from importlib.metadata import entry_points

    import torch
    import spore_kernels
    from spore import dispatch

    MANAGER = {"spore.plugins", "spore.discovery", "spore.builtin"}
    PLUGINS = {ep.value.split(":")[0] for ep in entry_points(group="spore.plugins")}
    assert {"spore_kernels.plugin", "spore_sentinel"} <= PLUGINS, PLUGINS

    x, w = torch.randn(4, 64), torch.randn(64)
    y = torch.ops.spore.rms_norm(x, w, 1e-6)
    ref = spore_kernels.ops.rms_norm.reference(x, w, 1e-6)
    print(json.dumps({
        "defined": sorted(op.name for op in dispatch.defined()),
        "cpu": {op.name: [k.provider for k in op.candidates("cpu")] for op in dispatch.defined()},
        "runs": dispatch.explain("rms_norm", x, w, 1e-6).chosen,
        "close": bool(torch.allclose(y, ref, atol=1e-5)),
        "plugin_modules": sorted(
            m for m in sys.modules
            if m in MANAGER or m in PLUGINS or m.split(".")[0] in {"hyperparallel", "mccl"}
        ),
    }))
"""

LOADED = """
    import json
    import spore, spore_kernels

    ops = spore.get_registry("ops")
    print(json.dumps({
        "status": {i.name: str(i.status) for i in spore.get_manager().plugins()},
        "owned": ops.names(owner="kernels"),
    }))
"""


def test_plugin_contract(spore_plugin_contract) -> None:
    info = spore_plugin_contract("kernels")
    registered = set(info.registered["ops"])
    for name in ALL_OPS:
        assert name in registered, name
        assert f"{name}[cpu]@kernels" in registered, name


def test_the_provider_is_the_entry_point_name() -> None:
    from importlib.metadata import entry_points

    names = [
        ep.name for ep in entry_points(group="spore.plugins") if ep.value == "spore_kernels.plugin"
    ]
    assert names == [PROVIDER]


def test_import_defines_the_ops_and_loads_no_plugin(sentinel_path: Path, tmp_path: Path) -> None:
    found = _child(IMPORT_ONLY, sentinel_path, tmp_path)
    assert found["plugin_modules"] == []
    assert set(ALL_OPS) <= set(found["defined"])
    for name in ALL_OPS:
        assert found["cpu"][name] == [PROVIDER], name
    assert found["runs"] == PROVIDER
    assert found["close"]


def test_the_sentinel_is_loaded_by_the_plugin_manager(sentinel_path: Path, tmp_path: Path) -> None:
    """The control for the test above: the sentinel is installed and loads when plugins do."""
    found = _child(LOADED, sentinel_path, tmp_path)
    assert found["status"]["sentinel"] == "active"


def test_loading_the_plugin_after_the_import_records_the_ops_as_its_own(
    sentinel_path: Path, tmp_path: Path
) -> None:
    found = _child(LOADED, sentinel_path, tmp_path, SPORE_STRICT_PLUGINS="1")
    assert found["status"]["kernels"] == "active"
    owned = set(found["owned"])
    for name in ALL_OPS:
        assert name in owned, name
        assert f"{name}[cpu]@kernels" in owned, name


PLUGIN_STATUS = """
    import json
    import spore

    info = {i.name: i for i in spore.get_manager().plugins()}["kernels"]
    print(json.dumps({"status": str(info.status), "reason": info.reason}))
"""


@pytest.mark.parametrize("isa", ["bogus", "V3"])
def test_a_build_that_cannot_load_fails_the_plugin_with_the_reason(
    sentinel_path: Path, tmp_path: Path, isa: str
) -> None:
    """It was reported active (and doctor ok) while every op call then raised."""
    found = _child(PLUGIN_STATUS, sentinel_path, tmp_path, SPORE_KERNELS_ISA=isa)
    assert found["status"] == "failed"
    assert f"unknown spore-kernels build {isa!r}: choose one of v4, v3, base" in found["reason"]
    assert _child(PLUGIN_STATUS, sentinel_path, tmp_path, SPORE_KERNELS_ISA="base") == {
        "status": "active",
        "reason": "",
    }


def test_spore_ops_names_kernels_as_the_owner(sentinel_path: Path, tmp_path: Path) -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SPORE_")}
    done = subprocess.run(
        [sys.executable, "-m", "spore", "ops", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=environ,
        check=True,
    )
    listed = {entry["op"].removeprefix("spore::"): entry for entry in json.loads(done.stdout)}
    for name in ALL_OPS:
        assert listed[name]["defined_by"] == "kernels", name
        assert [k["provider"] for k in listed[name]["kernels"]["cpu"]] == ["kernels"], name


def test_a_disabled_plugin_still_gives_working_ops_to_its_importer(
    sentinel_path: Path, tmp_path: Path
) -> None:
    """SPORE_DISABLE_PLUGINS=kernels: ``import spore_kernels`` (an explicit request) still defines
    the ops with their kernels; the registries, and so ``spore ops``, list only what enabled
    plugins registered, so the kernels plugin owns nothing there."""
    disabled = {"SPORE_DISABLE_PLUGINS": "kernels"}
    found = _child(IMPORT_ONLY, sentinel_path, tmp_path, **disabled)
    assert found["runs"] == PROVIDER
    assert found["close"]
    loaded = _child(LOADED, sentinel_path, tmp_path, **disabled)
    assert loaded["status"]["kernels"] == "disabled"
    assert loaded["owned"] == []
