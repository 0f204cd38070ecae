"""hyperparallel and dvm installed together: ``spore train`` with ``model.compile: dvm`` runs
its decoder layers through dvm's compiled graphs, forward and backward, with eager's losses
(tests(hyperparallel) has no dvm, so its test of this backend is skipped there)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

SMALL = [
    "model.config.hidden_size=64",
    "model.config.intermediate_size=171",
    "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4",
    "model.config.num_key_value_heads=2",
    "data.seq_len=64",
    "data.batch_size=8",
    "run.steps=4",
    "checkpoint.every=0",
    "checkpoint.export=false",
    "parallel.threads=1",
]


def _losses(output: Path, monkeypatch: pytest.MonkeyPatch, *settings: str) -> list[float]:
    """The per-step losses of one rank of ``spore train`` run in this process (a one-rank gloo
    group) into ``output`` with ``settings``."""
    from hyperparallel import config, train

    cfg = config.load(overrides=[*SMALL, *settings, f"run.output={json.dumps(str(output))}"])
    with socket.socket() as sock:  # a free port for the group's store
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    for key, value in {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    threads = torch.get_num_threads()
    try:
        train._run(cfg.to_dict(), None)
    finally:
        torch.set_num_threads(threads)
    lines = (output / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


def test_spore_train_with_dvm_layers_gives_eager_losses(tmp_path, monkeypatch) -> None:
    import dvm.backend

    compiled_graphs = []
    compile_graph = dvm.backend.compile_graph

    def recording(gm, example_inputs, **kwargs):
        compiled = compile_graph(gm, example_inputs, **kwargs)
        compiled_graphs.append(compiled)
        return compiled

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    eager = _losses(tmp_path / "eager", monkeypatch)
    monkeypatch.setattr(dvm.backend, "compile_graph", recording)
    try:
        with_dvm = _losses(tmp_path / "dvm", monkeypatch, "model.compile=dvm")
    finally:
        torch._dynamo.reset()
    assert len(eager) == 4
    assert with_dvm == pytest.approx(eager, rel=1e-5, abs=0)
    assert len(compiled_graphs) >= 2  # the layers' forward and backward graphs
    assert sum(g.vm_calls for g in compiled_graphs) > 0  # regions ran on dvm's VM
