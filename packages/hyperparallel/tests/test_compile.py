"""``model.compile``: each decoder layer compiled with a torch.compile backend trains as the
eager model does, and checkpoints and the export are the same with and without it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from safetensors.torch import load_file
from train_helpers import SMALL, losses, train_in_process

from hyperparallel import checkpoint, config, model, parallel
from hyperparallel.data import ByteTokenizer

STEPS = ["run.steps=4", "checkpoint.every=2"]

_calls: list[int] = []


@torch._dynamo.register_backend(name="hyperparallel_test_counting")
def _counting(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
    """Runs the captured graph as it is, counting its calls: the layers went through dynamo."""

    def run(*args: torch.Tensor):
        _calls.append(1)
        return gm.forward(*args)

    return run


@torch._dynamo.register_backend(name="hyperparallel_test_failing")
def _failing(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
    """Loads, as any registered backend does, and fails every compile."""
    raise RuntimeError("hyperparallel_test_failing compiles nothing")


@pytest.fixture(scope="module")
def eager(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four eager steps, saved at steps 2 and 4, exported."""
    out = tmp_path_factory.mktemp("eager")
    train_in_process(out, *STEPS)
    return out


def _saved_keys(output: Path) -> list[str]:
    """The keys of the newest checkpoint in ``output`` (model and optimizer state)."""
    return sorted(checkpoint.dcp_entries(checkpoint.find(output)))


@pytest.mark.parametrize(
    "backend",
    [
        "hyperparallel_test_counting",
        "aot_eager",
        pytest.param(
            "dvm",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("dvm") is None,
                reason="the dvm plugin is not installed here (tests(hyperparallel) installs "
                "spore-core and hyperparallel only; its C++ build takes minutes)",
            ),
        ),
    ],
)
def test_compiled_layers_train_as_eager(eager: Path, tmp_path: Path, backend: str) -> None:
    before = len(_calls)
    train_in_process(tmp_path, *STEPS, "checkpoint.export=false", f"model.compile={backend}")
    assert losses(tmp_path) == pytest.approx(losses(eager), rel=1e-5, abs=0)
    if backend == "hyperparallel_test_counting":
        assert len(_calls) - before >= 4 * 2  # every step, both layers
    assert _saved_keys(tmp_path) == _saved_keys(eager)


def test_compiled_layers_under_fsdp2_train_as_eager(tmp_path: Path) -> None:
    sharded = ["run.steps=2", "parallel.mixed_precision=bf16", "checkpoint.export=false"]
    train_in_process(tmp_path / "eager", *sharded)  # bf16 on one rank: fully_shard per layer
    before = len(_calls)
    train_in_process(tmp_path / "compiled", *sharded, "model.compile=hyperparallel_test_counting")
    assert len(_calls) - before >= 2 * 2
    assert losses(tmp_path / "compiled") == pytest.approx(losses(tmp_path / "eager"), rel=1e-5)
    assert _saved_keys(tmp_path / "compiled") == _saved_keys(tmp_path / "eager")


def test_compiled_layers_keep_their_parameter_names(tmp_path: Path) -> None:
    cfg = config.load(overrides=[*SMALL, "model.compile=aot_eager"])
    built = model.build(cfg.model, ByteTokenizer().vocab_size, cfg.run.seed)
    names = list(built.state_dict())
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        parallel.shard(built, parallel.mesh("cpu", 1, 1), cfg.parallel, cfg.model.compile)
    finally:
        dist.destroy_process_group()
    assert list(built.state_dict()) == names  # no _orig_mod. inside


def test_checkpoints_resume_across_the_compile_setting(eager: Path, tmp_path: Path) -> None:
    compiled = ["model.compile=aot_eager"]
    # saved compiled, resumed eager
    first = tmp_path / "compiled-then-eager"
    train_in_process(first, *STEPS, *compiled, "run.stop_at=2")
    train_in_process(first, *STEPS, resume="latest")
    # saved eager, resumed compiled: its export is written by the compiled model
    second = tmp_path / "eager-then-compiled"
    train_in_process(
        second, *STEPS, *compiled, resume=str(checkpoint.directory(eager) / "step_00000002")
    )
    for out in (first, second):
        assert losses(out) == pytest.approx(losses(eager), rel=1e-5, abs=0)
        assert _saved_keys(out) == _saved_keys(eager)
        exported = load_file(out / "final" / "model.safetensors")
        assert sorted(exported) == sorted(load_file(eager / "final" / "model.safetensors"))
        assert not [k for k in exported if "_orig_mod" in k]


def test_an_unknown_backend_is_a_config_error_with_a_suggestion(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  type: llama\n  compile: inductr\n")
    with pytest.raises(config.ConfigError) as info:
        config.load(path)
    assert f"{path}:3: model.compile: no torch.compile backend is named 'inductr'" in str(
        info.value
    )
    assert "did you mean 'inductor'?" in str(info.value)


def test_a_plugin_backend_that_is_not_installed_names_the_plugin() -> None:
    problem = config.backend_problem("dvm", known=["inductor", "aot_eager"])
    assert problem is not None
    assert "Spore plugin dvm, which is not installed" in problem
    assert "./packages/dvm" in problem


def test_a_backend_that_fails_to_compile_names_model_compile_and_the_way_out(
    tmp_path: Path,
) -> None:
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        train_in_process(tmp_path, "run.steps=1", "model.compile=hyperparallel_test_failing")
    assert "hyperparallel_test_failing compiles nothing" in str(info.value)  # the backend's own
    assert info.value.__notes__ == [
        "model.compile=hyperparallel_test_failing: the backend loaded (checked before the "
        "start) but failed to compile a decoder layer at the first step; choose another "
        "backend (e.g. inductor) or model.compile: null (eager)"
    ]
