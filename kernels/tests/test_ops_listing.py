"""Every op is listed with its CPU kernel active; inputs on two devices are a clear error."""

from __future__ import annotations

import json
import subprocess
import sys

OPS = ["add_rms_norm", "gelu", "layer_norm", "mean_var", "rms_norm", "rope", "silu_mul", "swiglu"]


def test_spore_ops_lists_every_op_with_its_cpu_kernel() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "spore", "ops", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    listed = {entry["op"].removeprefix("spore::"): entry for entry in json.loads(done.stdout)}
    for name in OPS + [f"{op}_backward" for op in OPS]:
        assert name in listed, f"spore ops does not list {name}"
        assert listed[name]["defined_by"] == "kernels"
        cpu = listed[name]["kernels"].get("cpu", [])
        assert [k["provider"] for k in cpu] == ["kernels"], (name, cpu)


def test_tensors_on_different_devices_are_a_clear_error() -> None:
    import pytest
    import torch

    import spore

    spore.get_registry("ops")
    x, cs = torch.randn(4, 8), torch.randn(4, 8)
    meta_row, meta_x = torch.randn(8, device="meta"), torch.randn(4, 8, device="meta")
    calls = {
        "rms_norm": lambda: torch.ops.spore.rms_norm(x, meta_row, 1e-6),
        "add_rms_norm": lambda: torch.ops.spore.add_rms_norm(x, meta_x, torch.ones(8), 1e-6),
        "layer_norm": lambda: torch.ops.spore.layer_norm(x, meta_row, None, 1e-6),
        "rope": lambda: torch.ops.spore.rope(x, cs.to("meta"), cs, "half"),
        "silu_mul": lambda: torch.ops.spore.silu_mul(x, meta_x),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=rf"{name}: .* is on cpu but .* is on meta"):
            call()
