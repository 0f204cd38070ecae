"""The package README: its python examples run and show what they say, all but the one that
needs Protenix (``sci_protenix.boost`` of a Protenix model)."""

from __future__ import annotations

import re
import runpy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"

RunBlocks = Callable[..., tuple[str, dict[str, Any]]]


def python_blocks(heading: str) -> list[str]:
    """The python blocks of the README's section titled ``heading`` (``##`` or deeper), up to
    the next such heading."""
    pattern = rf"^#{{2,}} {re.escape(heading)}\n(.*?)(?=^#{{2,}} |\Z)"
    section = re.search(pattern, README.read_text(), re.S | re.M)
    if section is None:
        pytest.fail(f"{README} lacks the section {heading!r}")
    return re.findall(r"```python\n(.*?)```", section.group(1), re.S)


@pytest.fixture
def run_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> RunBlocks:
    """``run(*blocks) -> (printed, globals)``: the blocks as one script run as ``__main__`` in a
    fresh temporary working directory, as ``spore.testing``'s ``run_readme_example`` runs one."""

    def run(*blocks: str) -> tuple[str, dict[str, Any]]:
        script = tmp_path / "readme_example.py"
        script.write_text("\n".join(blocks))
        monkeypatch.chdir(tmp_path)
        capsys.readouterr()
        namespace = runpy.run_path(str(script), run_name="__main__")
        return capsys.readouterr().out, namespace

    return run


def test_usage_example_runs(run_readme_example) -> None:
    shown = run_readme_example(README)
    assert "chunked equals whole: True" in shown
    assert "recompute='block'" in shown
    assert "smooth LDDT loss: 0." in shown


def test_every_use_example_but_protenix_runs(run_blocks: RunBlocks) -> None:
    """The training / Protenix-keywords example runs after the first, which defines its
    ``stack``, ``s`` and ``z``."""
    blocks = python_blocks("Use")
    runnable = [block for block in blocks if "sci_protenix.boost(" not in block]
    assert len(runnable) == len(blocks) - 1 == 2
    _, ns = run_blocks(*runnable)
    assert ns["s"].grad is not None  # the training step ran
    assert ns["z"].grad is not None
    with torch.no_grad():
        _, expected = ns["stack"](ns["s"], ns["z"], None)  # eval, out of place
    torch.testing.assert_close(ns["z1"], expected, rtol=1e-4, atol=1e-4)


def test_memory_budget_example_runs(run_readme_example) -> None:
    shown = run_readme_example(README, "Memory budgets and plans")
    assert "recompute='block'" in shown
    predicted = re.search(r"^([0-9.]+) GiB predicted$", shown, re.M)
    assert predicted is not None
    assert 0 < float(predicted.group(1)) <= 8


LDDT_INPUTS = """
import torch
import sci_protenix

pred_coords, true_coords = 10 * torch.randn(2, 40, 3), 10 * torch.randn(40, 3)
is_dna_or_rna, has_coords = torch.rand(40) > 0.5, torch.rand(40) > 0.1
"""


def test_smooth_lddt_loss_example_runs_on_random_atoms(run_blocks: RunBlocks) -> None:
    (example,) = python_blocks("`smooth_lddt_loss`")
    _, ns = run_blocks(LDDT_INPUTS, example)
    whole = ns["sci_protenix"].smooth_lddt_loss(
        ns["pred_coords"],
        ns["true_coords"],
        is_nucleotide=ns["is_dna_or_rna"],
        coord_mask=ns["has_coords"],
    )
    assert ns["loss"].shape == ()
    torch.testing.assert_close(ns["loss"], whole)
