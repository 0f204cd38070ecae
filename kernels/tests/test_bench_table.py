"""tools/bench_table.py: the README's figures table from ``spore bench kernels --json``."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_table.py"


@pytest.fixture(scope="module")
def bench_table():
    spec = importlib.util.spec_from_file_location("bench_table", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(tmp_path: Path, data: object) -> str:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_a_row_per_op_phase_and_dtype(bench_table, tmp_path) -> None:
    results = [
        {"name": "rms_norm-fwd-bf16-vs-eager", "ratio": 2.5, "candidate_s": 0.002},
        {"name": "rms_norm-fwd-bf16-vs-rms_norm", "ratio": 1.25},
        {"name": "rms_norm-fwd-bf16-vs-copy", "ratio": 0.5},
        {"name": "rms_norm-fwd-bf16-vs-compile", "error": "boom"},
    ]
    lines = bench_table.main([_write(tmp_path, {"results": results})]).splitlines()
    assert lines[2] == (
        "| rms_norm | fwd | bf16 | 2.50x | 1.25x (`rms_norm`) | error | 50% | 2.00 ms |"
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read"),
        ("not json", "is not `spore bench kernels --json` output (JSONDecodeError"),
        ({"cases": []}, "output (KeyError: 'results')"),
        ({"results": [{"name": "no-baseline"}]}, "output (ValueError"),
    ],
)
def test_other_files_are_one_line_errors(bench_table, tmp_path, content, message) -> None:
    path = str(tmp_path / "missing.json")
    if content is not None:
        path = tmp_path / "bench.json"
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(SystemExit, match=re.escape(message)):
        bench_table.main([str(path)])
