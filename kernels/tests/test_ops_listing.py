"""Every op of the issue is defined, with its backward op, and has its CPU kernel active."""

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
