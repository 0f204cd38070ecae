"""The package README: its config reference is current and its annotated example is valid."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from hyperparallel import config

README = Path(__file__).resolve().parents[1] / "README.md"


def test_config_reference_is_current() -> None:
    text = README.read_text()
    found = re.search(
        r"<!-- config-reference:start -->\n(.*?)\n<!-- config-reference:end -->", text, re.S
    )
    assert found, "README.md lacks the config-reference markers"
    assert found.group(1).strip() == config.reference().strip(), (
        "stale: paste the output of `python -m hyperparallel.config` between the markers"
    )


def test_annotated_example_is_a_valid_config(tmp_path) -> None:
    block = re.search(r"```yaml\n(# run\.yaml.*?)```", README.read_text(), re.S)
    assert block, "README.md lacks the annotated run.yaml example"
    path = tmp_path / "run.yaml"
    path.write_text(block.group(1))
    cfg = config.load(path)
    assert cfg.parallel.replicate == 2
    assert cfg.model.type == "qwen2"
    assert yaml.safe_load(block.group(1))["optim"]["grad_accum"] == 2
