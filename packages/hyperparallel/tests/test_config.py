"""Config errors are caught before any process starts, naming the key and its YAML line."""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from hyperparallel import config, launch, model, preflight
from hyperparallel.cli import train


def _write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_defaults_are_valid_and_round_trip_through_yaml(tmp_path) -> None:
    cfg = config.load()
    assert cfg.model.type is None  # llama, or model.pretrained's type
    assert cfg.optim.name == "adamw"
    again = config.load(_write(tmp_path, cfg.to_yaml()))
    assert again.to_dict() == cfg.to_dict()


def test_unknown_key_names_the_line_and_suggests(tmp_path) -> None:
    path = _write(tmp_path, "run:\n  steps: 10\noptim:\n  lr: 0.01\n  weight_decy: 0.1\n")
    with pytest.raises(config.ConfigError) as info:
        config.load(path)
    assert f"{path}:5: unknown key optim.weight_decy; did you mean 'weight_decay'?" in str(
        info.value
    )


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("run:\n  steps: 5\n1: 2\n", "run.yaml:3: key '1' is read by YAML as 1, not a name"),
        (
            "run:\n  steps: 5\nmodel:\n  config:\n    <<: {hidden_size: 64}\n",
            "run.yaml:5: a YAML merge key (<<) is not supported in a training config",
        ),
        ("run:\n  steps: 5\n  10: 2\n", "run.yaml:3: key '10' in run is read by YAML as 10,"),
        ("model:\n  config:\n    10: 2\n", "run.yaml:3: key '10' in model.config is read"),
        (
            "run: {steps: 5}\non: 2\n",
            """run.yaml:2: key 'on' is read by YAML as True, not a name;
        quote it ("on")""".replace("\n        ", " "),
        ),
    ],
)
def test_a_key_yaml_reads_as_a_number_is_named_with_its_line(tmp_path, text, problem) -> None:
    """It was "config: : Keys should be strings", or "run: expected a mapping of settings",
    or, for a boolean, a line of none."""
    with pytest.raises(config.ConfigError) as info:
        config.load(_write(tmp_path, text))
    assert problem in str(info.value)


def test_unknown_section_suggests(tmp_path) -> None:
    path = _write(tmp_path, "optimizer:\n  lr: 0.01\n")
    with pytest.raises(
        config.ConfigError, match=r"run.yaml:1: unknown section 'optimizer'; did you mean 'optim'"
    ):
        config.load(path)


def test_wrong_types_are_reported_together_with_their_lines(tmp_path) -> None:
    path = _write(
        tmp_path,
        "run:\n  steps: many\nparallel:\n  activation_checkpointing: 3\n  mixed_precision: fp8\n",
    )
    with pytest.raises(config.ConfigError) as info:
        config.load(path)
    message = str(info.value)
    assert "3 problems" in message
    assert f"{path}:2: run.steps: expected an integer, got 'many'" in message
    assert f"{path}:4: parallel.activation_checkpointing: expected true/false, got 3" in message
    assert f"{path}:5: parallel.mixed_precision: 'fp8' is not one of none, bf16" in message


def test_fp16_is_refused_for_want_of_loss_scaling() -> None:
    """FSDP2 in fp16 ran forward and backward in fp16 with no loss scaler: small gradients
    became zero without a word."""
    with pytest.raises(config.ConfigError) as info:
        config.load(None, ["parallel.mixed_precision=fp16"])
    message = str(info.value)
    assert "parallel.mixed_precision: fp16 needs loss scaling" in message
    assert "use bf16" in message


def test_impossible_combination_names_both_keys(tmp_path) -> None:
    path = _write(tmp_path, "parallel:\n  nproc: 4\n  replicate: 3\n")
    with pytest.raises(config.ConfigError) as info:
        config.load(path)
    assert f"{path}:3: parallel.replicate=3 does not divide parallel.nproc=4 ({path}:2)" in str(
        info.value
    )


def test_set_overrides_take_precedence_and_are_named_in_errors(tmp_path) -> None:
    path = _write(tmp_path, "optim:\n  lr: 0.01\n")
    cfg = config.load(path, ["optim.lr=0.5", "model.config.hidden_size=32"])
    assert cfg.optim.lr == 0.5
    assert cfg.model.config == {"hidden_size": 32}
    with pytest.raises(config.ConfigError, match=r"--set optim.lr=-1: optim.lr must be > 0"):
        config.load(path, ["optim.lr=-1"])
    with pytest.raises(config.ConfigError, match=r"expected key\.path=value"):
        config.load(path, ["optim.lr"])


def test_integers_are_accepted_as_floats_but_not_booleans() -> None:
    assert config.load(None, ["optim.lr=1"]).optim.lr == 1.0
    with pytest.raises(config.ConfigError, match=r"optim\.lr: expected a number, got True"):
        config.load(None, ["optim.lr=true"])


def test_exponent_floats_are_numbers(tmp_path) -> None:
    # PyYAML reads YAML 1.1, where 1e-3 is a string; the help's own example writes it so
    assert config.load(None, ["optim.lr=1e-3"]).optim.lr == 1e-3
    assert config.load(_write(tmp_path, "optim:\n  lr: 3E-4\n")).optim.lr == 3e-4
    assert config.load(None, ["optim.lr=+2e0"]).optim.lr == 2.0
    assert config.load(None, ["run.name=1e3x"]).run.name == "1e3x"
    for text, value in (("1.5e2", 150.0), ("2.0e3", 2000.0), (".5e3", 500.0), ("1.e1", 10.0)):
        assert config.load(None, [f"optim.lr={text}"]).optim.lr == value
    written = config.load(_write(tmp_path, "model:\n  config:\n    rope_theta: 1.0e6\n"))
    assert written.model.config == {"rope_theta": 1e6}


def test_leading_zero_integers_are_decimal(tmp_path) -> None:
    # YAML 1.1 (PyYAML) reads 0300 as octal 192 and 1:30 as 90; YAML 1.2, and the user, 300
    cfg = config.load(_write(tmp_path, "run:\n  steps: 0300\n  seed: 0042\n"))
    assert (cfg.run.steps, cfg.run.seed) == (300, 42)
    assert config.load(None, ["checkpoint.every=050"]).checkpoint.every == 50
    assert config.load(None, ["model.config.num_hidden_layers=02"]).model.config == {
        "num_hidden_layers": 2
    }
    for text, value in (("0o17", 15), ("0x10", 16), ("0b101", 5), ("1_000", 1000), ("-007", -7)):
        assert config.load(None, [f"model.config.x={text}"]).model.config == {"x": value}
    with pytest.raises(config.ConfigError, match=r"run\.steps: expected an integer, got '1:30'"):
        config.load(None, ["run.steps=1:30"])
    # and YAML 1.1 reads 1:30.5 as the float 90.5: text here too, which a float setting refuses
    assert config.load(None, ["model.config.x=1:30.5"]).model.config == {"x": "1:30.5"}
    with pytest.raises(config.ConfigError, match=r"optim\.lr: .*'1:30\.5'"):
        config.load(None, ["optim.lr=1:30.5"])
    for text, value in (("-.5", -0.5), (".5e3", 500.0), ("1_000.5", 1000.5), ("1e-3", 1e-3)):
        assert config.load(None, [f"model.config.x={text}"]).model.config == {"x": value}


def test_yaml_syntax_errors_name_the_line(tmp_path) -> None:
    path = _write(tmp_path, "run:\n  steps: 10\n  name: [unclosed\n")
    with pytest.raises(config.ConfigError, match=r"run.yaml:\d+: not valid YAML"):
        config.load(path)


def test_a_key_given_twice_is_an_error_naming_both_lines(tmp_path) -> None:
    """YAML keeps only the last: the second optim section dropped lr and grad_accum silently."""
    text = "optim:\n  lr: 1.0e-4\n  grad_accum: 4\ndata:\n  seq_len: 64\n  seq_len: 32\n"
    path = _write(tmp_path, text + "optim:\n  grad_clip: 0.5\n")
    with pytest.raises(config.ConfigError) as info:
        config.load(path)
    assert f"{path}:6: data.seq_len is given again (first at {path}:5)" in str(info.value)
    assert f"{path}:7: optim is given again (first at {path}:1)" in str(info.value)
    assert "(2 problems)" in str(info.value)


def test_unknown_registry_names_suggest(tmp_path) -> None:
    path = _write(tmp_path, "optim:\n  name: adamm\nschedule:\n  name: cosin\n")
    with pytest.raises(config.ConfigError) as info:
        config.load(path)
    assert f"{path}:2: optim.name: unknown 'adamm'; did you mean 'adamw'?" in str(info.value)
    assert f"{path}:4: schedule.name: unknown 'cosin'; did you mean 'cosine'?" in str(info.value)


def test_preflight_checks_model_data_and_resume(tmp_path) -> None:
    path = _write(
        tmp_path,
        "model:\n  config:\n    hiden_size: 8\ndata:\n  path: nowhere/*.txt\n",
    )
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(str(path), [f"run.output={tmp_path / 'out'}"], resume="latest")
    message = str(info.value)
    assert "llama has no setting hiden_size (did you mean 'hidden_size'?)" in message
    assert f"{path}:5: data.path: no file matches 'nowhere/*.txt'" in message
    assert f"--resume: {tmp_path / 'out'} does not exist; train without --resume first" in message
    with pytest.raises(config.ConfigError, match="transformers has no model type 'lama'"):
        preflight.resolve(None, ["model.type=lama"])


def _checkpoint(output, step: int) -> None:
    """A checkpoint preflight takes as complete: meta.json and a one-rank trainer.pt."""
    done = output / "checkpoints" / f"step_{step:08d}"
    done.mkdir(parents=True)
    (done / "meta.json").write_text(f'{{"step": {step}, "save": 1}}')
    torch.save({"sampler": {"world": 1, "batch_size": 16}}, done / "trainer.pt")


def test_a_resume_never_writes_over_another_run(tmp_path) -> None:
    """--resume of run a's checkpoint with --output b, which holds b's own checkpoints, would
    overwrite b's saves, metrics and export: refused, as for a new run."""
    a, b = tmp_path / "a", tmp_path / "b"
    _checkpoint(a, 3)
    _checkpoint(b, 4)
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(None, [f"run.output={b}"], resume=str(a / "checkpoints/step_00000003"))
    assert (
        f"--set run.output={b}: run.output {b} already holds checkpoints of another run "
        f"(newest step_00000004), and --resume continues step_00000003 of {a}"
    ) in str(info.value)
    assert preflight.resolve(None, [f"run.output={b}"], resume="latest")  # its own: fine
    assert preflight.resolve(None, [f"run.output={tmp_path / 'c'}"], resume=str(a))  # empty


def test_a_log_the_resume_continues_that_cannot_be_read_fails_before_any_process_starts(
    tmp_path,
) -> None:
    """--resume a/checkpoints/step_N --output b starts b's log from a's: one that could not be
    read (a PermissionError) was a traceback from rank 0; a directory was passed over, and
    a's steps left out of b's log without a word."""
    a, b = tmp_path / "a", tmp_path / "b"
    _checkpoint(a, 2)
    (a / "metrics.jsonl").mkdir()
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(None, [f"run.output={b}"], resume=str(a / "checkpoints/step_00000002"))
    assert (
        f"--resume: {a / 'metrics.jsonl'} cannot be read (a directory, not a file): a resume "
        f"starts this "
        f"run's metrics.jsonl from it, up to the checkpoint's step; make it a readable file, or "
        f"move it away to continue {b / 'metrics.jsonl'} instead where there is one (its steps "
        f"up to the checkpoint's), else log only the steps after the checkpoint"
    ) in str(info.value)  # said only the steps after the checkpoint would be logged: not so
    from hyperparallel.train import unreadable_log

    own = unreadable_log(a / "metrics.jsonl", "Permission denied", a)
    assert own.endswith("or move it away to log only the steps after the checkpoint")  # its own
    (a / "metrics.jsonl").rmdir()
    assert preflight.resolve(None, [f"run.output={b}"], resume=str(a / "checkpoints/step_00000002"))


def _refused(pipe: Path, overrides: list[str], resume: str | None = None) -> str:
    """The ConfigError message of ``preflight.resolve(None, overrides, resume)``; fails the test
    where it opens the named pipe ``pipe`` and waits for a writer (ended after 30 s by opening
    it for writing here)."""
    done: dict[str, BaseException] = {}

    def call() -> None:
        try:
            preflight.resolve(None, overrides, resume)
        except BaseException as exc:  # handed to the test's thread
            done["exc"] = exc

    thread = threading.Thread(target=call)
    thread.start()
    thread.join(30)
    if thread.is_alive():
        os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))  # the waiting open returns
        thread.join()
        pytest.fail(f"preflight opened {pipe} and waited for a writer")
    assert isinstance(done.get("exc"), config.ConfigError), done
    return str(done["exc"])


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_named_pipe_named_metrics_jsonl_is_refused_without_opening_it(tmp_path) -> None:
    """A named pipe (or a socket) named metrics.jsonl in the output passed preflight, and the
    run replaced it; in the output a resume continues the log of, preflight opened it and
    waited for a writer, for ever."""
    new, a, b = tmp_path / "new", tmp_path / "a", tmp_path / "b"
    new.mkdir()
    os.mkfifo(new / "metrics.jsonl")
    message = _refused(new / "metrics.jsonl", [f"run.output={new}"])
    assert (
        f"spore train writes metrics.jsonl there as a file, and it is a named pipe (FIFO); move "
        f"{new / 'metrics.jsonl'} away, or choose another --output"
    ) in message
    _checkpoint(new, 2)  # its own log, resumed: refused the same way
    assert "and it is a named pipe (FIFO)" in _refused(
        new / "metrics.jsonl", [f"run.output={new}"], "latest"
    )
    _checkpoint(a, 2)
    os.mkfifo(a / "metrics.jsonl")
    message = _refused(
        a / "metrics.jsonl", [f"run.output={b}"], str(a / "checkpoints/step_00000002")
    )
    assert (
        f"--resume: {a / 'metrics.jsonl'} cannot be read (a named pipe (FIFO), not a file)"
        in message
    )
    with tempfile.TemporaryDirectory() as short, socket.socket(socket.AF_UNIX) as unix:
        unix.bind(f"{short}/metrics.jsonl")  # a socket's path is at most 107 bytes
        message = _refused(Path(short, "metrics.jsonl"), [f"run.output={short}"])
    assert "writes metrics.jsonl there as a file, and it is a socket;" in message


def test_a_damaged_line_in_the_log_a_resume_continues_fails_before_any_process_starts(
    tmp_path,
) -> None:
    """It was reported by rank 0, once the ranks had started and loaded the checkpoint."""
    out = tmp_path / "run"
    _checkpoint(out, 2)
    log = out / "metrics.jsonl"
    log.write_text('{"step": 1, "loss": 2.5}\n{{"step": 2, "loss": 2.4}\n')
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(None, [f"run.output={out}"], resume="latest")
    assert f"--resume: {log}:2: not a metrics record (" in str(info.value)
    assert "fix or delete that line (metrics.jsonl is the run's log" in str(info.value)
    log.write_bytes(b'{"step": 1, "loss": 2.5}\n\xff\xfe garbage\n')
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(None, [f"run.output={out}"], resume="latest")
    assert f"--resume: {log}:2: not UTF-8 text (byte 0xff): fix or delete" in str(info.value)
    log.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "lo')  # cut short: rank 0 drops it
    assert preflight.resolve(None, [f"run.output={out}"], resume="latest")


def test_a_renamed_checkpoint_is_told_the_name_a_checkpoint_folder_has(tmp_path) -> None:
    """A checkpoint folder renamed (step_00000004 -> mycopy) was refused as no checkpoint,
    without saying what a checkpoint folder is named."""
    _checkpoint(tmp_path / "a", 4)
    copy = tmp_path / "mycopy"
    (tmp_path / "a" / "checkpoints" / "step_00000004").rename(copy)
    args = [f"run.output={tmp_path / 'b'}"]
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(None, args, resume=str(copy))
    assert (
        "point --resume at a checkpoint folder: one named step_ and its step in 8 digits "
        "(step_00000400), holding meta.json; mycopy holds step 4's meta.json: rename it "
        "step_00000004"
    ) in str(info.value)
    copy.rename(tmp_path / "step_00000004")
    assert preflight.resolve(None, args, resume=str(tmp_path / "step_00000004"))


def test_a_garbage_trainer_pt_names_the_older_checkpoint_to_resume_from(tmp_path) -> None:
    out = tmp_path / "out"
    _checkpoint(out, 2)
    _checkpoint(out, 4)
    (out / "checkpoints" / "step_00000004" / "trainer.pt").write_text("garbage")
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(None, [f"run.output={out}"], resume="latest")
    assert (
        f"--resume: {out}/checkpoints/step_00000004 has no readable trainer.pt (data position, "
        f"schedule): it is damaged; resume from an older checkpoint with --resume "
        f"{out}/checkpoints/step_00000002, or delete step_00000004"
    ) in str(info.value)


def test_a_new_run_never_writes_over_damaged_checkpoints(tmp_path) -> None:
    """Checkpoints whose meta.json was damaged counted as none: a new run went ahead and its
    saves replaced them."""
    out = tmp_path / "out"
    _checkpoint(out, 2)
    (out / "checkpoints" / "step_00000002" / "meta.json").write_text("{not json")
    with pytest.raises(config.ConfigError, match=r"\(step_00000002: damaged\); choose another"):
        preflight.resolve(None, [f"run.output={out}"])


def test_a_config_in_the_output_is_replaced_only_if_a_run_wrote_it(tmp_path) -> None:
    """A run writes its resolved config to run.output/config.yaml: a hand-written config kept
    there (comments, a short form) was replaced by it."""
    out = tmp_path / "exp"
    out.mkdir()
    mine = out / "config.yaml"
    mine.write_text(f"# lab notes: keep lr at 3e-3\nrun:\n  output: {out}\n")
    with pytest.raises(config.ConfigError, match=r"config.yaml, where spore train writes"):
        preflight.resolve(str(mine), ["optim.lr=0.01"])
    mine.write_text(config.load(None, [f"run.output={out}"]).to_yaml())  # as a run writes it
    assert preflight.resolve(str(mine), ["optim.lr=0.01"]).optim.lr == 0.01
    assert preflight.resolve(str(mine), [], outputs=False)


def test_a_resume_with_other_model_shapes_fails_before_any_process_starts(tmp_path) -> None:
    """DCP's metadata holds the saved parameters' shapes: a model.config that changes them
    (the load would fail in every rank) is refused in preflight."""
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "out"
    _checkpoint(out, 2)
    small = ["model.config.hidden_size=64", "model.config.num_hidden_layers=1"]
    saved = model.build(preflight.resolve(None, small, outputs=False).model, 259, seed=0)
    dcp.save(
        {"train": {"model": saved.state_dict()}},
        checkpoint_id=str(out / "checkpoints/step_00000002"),
    )
    args = [f"run.output={out}"]
    assert preflight.resolve(None, [*args, *small], resume="latest")
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(None, [*args, small[1], "model.config.hidden_size=128"], resume="latest")
    assert (
        "--set model.config.num_hidden_layers=1, --set model.config.hidden_size=128: --resume: "
        "step_00000002 holds a model of other shapes (model.embed_tokens.weight (259, 64) -> "
        "(259, 128), "
    ) in str(info.value)
    with pytest.raises(config.ConfigError) as info:  # a layer more: parameters it lacks
        preflight.resolve(None, [*args, small[0], "model.config.num_hidden_layers=2"], "latest")
    assert "model.layers.1.self_attn.q_proj.weight absent -> (64, 64)" in str(info.value)


def test_a_resume_that_ties_or_unties_the_embeddings_fails_before_any_process_starts(
    tmp_path,
) -> None:
    """Tied and untied embeddings have the same state-dict shapes, but the optimizer trains one
    parameter fewer when tied: the load failed in every rank, as a damaged checkpoint to
    delete. DCP's metadata names the parameters the optimizer saved state for."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    small = ["model.config.hidden_size=64", "model.config.num_hidden_layers=1"]
    for tied, flip in ((True, "lm_head.weight trained here"), (False, "lm_head.weight saved")):
        out = tmp_path / str(tied)
        _checkpoint(out, 2)
        setting = f"model.config.tie_word_embeddings={str(tied).lower()}"
        built = model.build(preflight.resolve(None, [*small, setting], outputs=False).model, 259, 0)
        model_sd, optim_sd = get_state_dict(built, torch.optim.AdamW(built.parameters()))
        step = str(out / "checkpoints/step_00000002")
        dcp.save({"train": {"model": model_sd, "optim": optim_sd}}, checkpoint_id=step)
        args = [f"run.output={out}", *small]
        assert preflight.resolve(None, [*args, setting], resume="latest")
        other = f"model.config.tie_word_embeddings={str(not tied).lower()}"
        with pytest.raises(config.ConfigError) as info:
            preflight.resolve(None, [*args, other], resume="latest")
        assert (
            f"--resume: step_00000002 holds optimizer state for other parameters ({flip}"
        ) in str(info.value)
        assert "resume with the model and optim settings it was saved with" in str(info.value)


def test_a_resume_under_an_optimizer_of_some_parameters_only_is_not_refused(
    tmp_path, monkeypatch
) -> None:
    """The check took every parameter that requires grad as trained: a registered optimizer
    over some of them (frozen embeddings) had each resume refused, its settings unchanged."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from hyperparallel import registries

    def no_embeddings(built, optim):
        kept = [p for n, p in built.named_parameters() if "embed_tokens" not in n]
        return torch.optim.AdamW(kept, lr=optim.lr)

    monkeypatch.setitem(registries.optimizers._items, "noembed", no_embeddings)
    small = ["model.config.hidden_size=64", "model.config.num_hidden_layers=1"]
    args = [f"run.output={tmp_path / 'out'}", *small, "optim.name=noembed"]
    _checkpoint(tmp_path / "out", 2)
    built = model.build(preflight.resolve(None, small, outputs=False).model, 259, 0)
    model_sd, optim_sd = get_state_dict(built, no_embeddings(built, config.OptimSection()))
    step = str(tmp_path / "out/checkpoints/step_00000002")
    dcp.save({"train": {"model": model_sd, "optim": optim_sd}}, checkpoint_id=step)
    assert preflight.resolve(None, args, resume="latest")
    with pytest.raises(config.ConfigError, match=r"model.embed_tokens.weight trained here"):
        preflight.resolve(None, [*args[:-1], "optim.name=adamw"], resume="latest")


def test_a_home_relative_output_is_expanded(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = preflight.resolve(None, ["run.output=~/runs/x"], outputs=False)
    assert cfg.run.output == str(tmp_path / "runs" / "x")


def test_a_device_or_backend_this_machine_lacks_is_a_config_error(tmp_path) -> None:
    """Where the run would start; --print-config (outputs=False) prints it for another host."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the settings below are valid here")
    assert preflight.resolve(None, ["parallel.device=cuda"], outputs=False)
    out = f"run.output={tmp_path / 'out'}"
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(None, ["parallel.device=cuda", out])
    assert "--set parallel.device=cuda: parallel.device=cuda, but torch finds no CUDA device" in (
        str(info.value)
    )
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(None, ["parallel.backend=nccl", out])
    assert "--set parallel.backend=nccl: parallel.backend=nccl runs on CUDA" in str(info.value)


def test_a_misspelt_model_setting_names_where_it_was_set() -> None:
    args = ["model.config.hidden_size=64", "model.config.hiden_act=x"]
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(None, args, outputs=False)
    assert str(info.value).count("\n  --set model.config.hiden_act=x: model.config: llama") == 1
    both = ["model.config.num_hidden_layers=2", "model.config.hidden_act=bogus"]
    with pytest.raises(config.ConfigError) as info:  # a problem of them together names them all
        preflight.resolve(None, both, outputs=False)
    assert f"--set {both[0]}, --set {both[1]}: model: transformers cannot build" in str(info.value)


def test_values_transformers_refuses_and_infinite_numbers_are_config_errors() -> None:
    """One line each, not a traceback from inside transformers or a rank."""
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(None, ["model.config.num_attention_heads=3"], outputs=False)
    assert (
        "--set model.config.num_attention_heads=3: model.config.num_attention_heads: "
        "transformers refused the model config" in str(info.value)
    )
    assert "not a multiple of the number of attention heads" in str(info.value)
    for key in ("optim.lr", "parallel.init_timeout"):
        with pytest.raises(config.ConfigError, match=rf"{key} must be a finite number, got inf"):
            config.load(None, [f"{key}=.inf"])
    with pytest.raises(config.ConfigError, match=r"parallel\.init_timeout"):
        config.load(None, ["parallel.init_timeout=1e12"])
    for seed in ("99999999999999999999999", "-1"):  # the first failed in rank 0 ("Overflow")
        with pytest.raises(
            config.ConfigError, match=r"run\.seed must be >= 0, < 9223372036854775808"
        ):
            config.load(None, [f"run.seed={seed}"])


def test_data_globs_match_recursively_as_the_loader_reads_them(tmp_path) -> None:
    deep = tmp_path / "corpus" / "a" / "b"
    deep.mkdir(parents=True)
    (deep / "doc.txt").write_text("a document " * 40)
    pattern = f"{tmp_path}/corpus/**/*.txt"
    assert preflight.resolve(None, [f"data.path={pattern}"], outputs=False).data.path == pattern


@pytest.mark.parametrize("kind", ["llama", "bert", "roberta"])
def test_every_model_type_is_built_causal(kind: str) -> None:
    """An encoder-style type as a causal LM: a position must not see the tokens after it."""
    section = config.load(None, [f"model.type={kind}"]).model
    built = model.build(section, 259, seed=0).eval()
    tokens = torch.randint(3, 250, (1, 16), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[0, 10] = (tokens[0, 10] + 1) % 250 + 3
    with torch.no_grad():
        before, after = built(tokens).logits, built(changed).logits
    torch.testing.assert_close(after[:, :10], before[:, :10], rtol=0, atol=0)
    assert not torch.equal(after[:, 10:], before[:, 10:])


def test_a_bad_config_fails_fast_with_one_message_and_starts_nothing(tmp_path, run_spore) -> None:
    path = _write(tmp_path, "parallel:\n  nproc: 2\n  replicate: 3\n")
    output = tmp_path / "out"
    started = time.monotonic()
    done = run_spore("train", str(path), "--output", str(output), timeout=120)
    assert done.returncode == 1
    assert "parallel.replicate=3 does not divide parallel.nproc=2" in done.stderr
    assert "Traceback" not in done.stderr
    assert not output.exists()
    assert time.monotonic() - started < 60


def test_print_config_is_the_resolved_yaml(tmp_path, monkeypatch) -> None:
    """Whatever run.output holds (here an earlier run's checkpoint), and without creating it."""
    monkeypatch.chdir(tmp_path)
    earlier = tmp_path / "runs" / "default" / "checkpoints" / "step_00000010"
    earlier.mkdir(parents=True)
    (earlier / "meta.json").write_text('{"step": 10}')
    args = ["--print-config", "--set", "run.steps=7", "--nproc", "2"]
    result = CliRunner().invoke(train, args)
    assert result.exit_code == 0, result.output
    assert "steps: 7" in result.output
    assert "nproc: 2" in result.output
    assert "output: runs/default" in result.output
    result = CliRunner().invoke(train, [*args, "--output", str(tmp_path / "new")])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "new").exists()


def test_set_values_are_yaml_and_a_comma_list_is_shown_as_one(tmp_path) -> None:
    """--help says how to write a list and null; a comma-joined data.path names the list."""
    result = CliRunner().invoke(train, ["--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "VALUE is read as YAML" in result.output
    assert "--set 'data.path=[a/*.txt, b.jsonl]' (a list)" in result.output
    assert "--set run.stop_at=null" in result.output
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    for path in (a, b):
        path.write_text("text")
    with pytest.raises(
        config.ConfigError, match=re.escape(f"(several globs are a list: [{a}, {b}])")
    ):
        preflight.resolve(None, [f"data.path={a},{b}"], outputs=False)
    assert preflight.resolve(None, [f"data.path=[{a}, {b}]"], outputs=False).data.path == [
        str(a),
        str(b),
    ]


def test_settings_that_run_but_likely_not_as_meant_are_noted() -> None:
    """run.stop_at past run.steps, schedule.warmup_steps past run.steps: each noted once, with
    where it was set; the defaults give none."""
    assert config.notes(config.load()) == []
    cfg = config.load(None, ["run.steps=10", "run.stop_at=12"])
    stop, warm = config.notes(cfg)
    assert stop.startswith("--set run.stop_at=12: run.stop_at=12 is past run.steps=10")
    assert warm.startswith("default: schedule.warmup_steps=20 is more than run.steps=10")
    assert config.notes(config.load(None, ["run.steps=20", "run.stop_at=20"])) == []
    result = CliRunner().invoke(train, ["--print-config", "--set", "run.steps=10"])
    assert result.exit_code == 0, result.output
    assert result.stderr.count("note: default: schedule.warmup_steps=20 is more than") == 1
    assert "note:" not in result.stdout  # the YAML stays clean for `> run.yaml`


def test_reference_documents_every_key() -> None:
    text = config.reference()
    for name, cls in config.SECTIONS.items():
        assert f"### `{name}`" in text
        for field in cls.model_fields:
            assert f"| `{field}` |" in text
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert text in readme, "README's config reference: paste `python -m hyperparallel.config`"


def test_model_settings_merge_over_defaults_and_null_drops_a_key() -> None:
    cfg = config.load(None, ["model.config.tie_word_embeddings=null"])
    applied = model.settings(cfg.model)
    assert "tie_word_embeddings" not in applied
    assert applied["hidden_size"] == 128
    assert model.hf_config(cfg.model, 259).tie_word_embeddings is LlamaConfig().tie_word_embeddings


def test_an_output_with_checkpoints_needs_resume_or_another_output(tmp_path) -> None:
    done = tmp_path / "out" / "checkpoints" / "step_00000010"
    done.mkdir(parents=True)
    (done / "meta.json").write_text('{"step": 10}')
    torch.save({"sampler": {"world": 1, "batch_size": 16}}, done / "trainer.pt")
    with pytest.raises(config.ConfigError, match="already holds checkpoints of an earlier run"):
        preflight.resolve(None, [f"run.output={tmp_path / 'out'}"])
    assert preflight.resolve(None, [f"run.output={tmp_path / 'out'}"], resume="latest")
    assert done.is_dir()


def test_a_resume_on_another_data_layout_fails_before_any_process_starts(tmp_path) -> None:
    done = tmp_path / "out" / "checkpoints" / "step_00000010"
    done.mkdir(parents=True)
    (done / "meta.json").write_text('{"step": 10}')
    torch.save({"sampler": {"world": 2, "batch_size": 8}}, done / "trainer.pt")
    args = [f"run.output={tmp_path / 'out'}", "data.batch_size=8"]
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(None, args, resume="latest")
    assert (
        "--resume: step_00000010 was saved by 2 rank(s) of data.batch_size=8, this run has 1 of "
        "8; the data order continues only on the same layout (--nproc 2 --set data.batch_size=8)"
    ) in str(info.value)
    assert preflight.resolve(None, [*args, "parallel.nproc=2"], resume="latest")
    (done / "trainer.pt").unlink()
    with pytest.raises(config.ConfigError, match=r"has no readable trainer\.pt"):
        preflight.resolve(None, [*args, "parallel.nproc=2"], resume="latest")
    # the blocks the data is cut into: a checkpoint that names its seq_len is held to it
    layout = {"world": 2, "batch_size": 8}
    torch.save({"sampler": layout, "data": {"seq_len": 64}}, done / "trainer.pt")
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(None, [*args, "parallel.nproc=2"], resume="latest")
    assert (
        "--resume: step_00000010 was saved with data.seq_len=64, this run has 128; the data "
        "order continues only on the same blocks (--set data.seq_len=64)"
    ) in str(info.value)
    assert preflight.resolve(None, [*args, "parallel.nproc=2", "data.seq_len=64"], resume="latest")


def test_a_resume_under_other_schedule_settings_fails_before_any_process_starts(tmp_path) -> None:
    """The resumed scheduler went on under the new schedule.* settings: the learning rate
    switched schedules mid-run, without a word. run.steps may change (the schedule spans the
    new steps), and a checkpoint whose trainer.pt does not name its schedule is not checked."""
    out = tmp_path / "out"
    _checkpoint(out, 2)
    args = [f"run.output={out}"]
    assert preflight.resolve(None, [*args, "schedule.name=linear"], resume="latest")  # older
    done = out / "checkpoints" / "step_00000002"
    saved = {"name": "cosine", "warmup_steps": 20, "min_lr_ratio": 0.1}
    torch.save({"sampler": {"world": 1, "batch_size": 16}, "schedule": saved}, done / "trainer.pt")
    assert preflight.resolve(None, [*args, "run.steps=1000"], resume="latest")
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(
            None, [*args, "schedule.name=linear", "schedule.warmup_steps=5"], resume="latest"
        )
    assert (
        "--set schedule.name=linear, --set schedule.warmup_steps=5: --resume: step_00000002 was "
        "saved under other schedule settings (schedule.name: 'cosine' saved, 'linear' asked; "
        "schedule.warmup_steps: 20 saved, 5 asked); resuming under these would switch the "
        "learning-rate schedule mid-run: resume with the saved ones (--set schedule.name=cosine "
        "--set schedule.warmup_steps=20; its run's config.yaml)"
    ) in str(info.value)
    with pytest.raises(config.ConfigError, match=r"min_lr_ratio: 0\.1 saved, 0\.5 asked"):
        preflight.resolve(None, [*args, "schedule.min_lr_ratio=0.5"], resume="latest")


def test_a_resume_compares_only_the_schedule_settings_the_saved_schedule_reads(
    tmp_path, monkeypatch
) -> None:
    """constant reads no min_lr_ratio: a resume with another was refused, its rates the same.
    A schedule registered elsewhere has every setting compared (what it reads is unknown)."""
    from hyperparallel import registries

    out = tmp_path / "out"
    _checkpoint(out, 2)
    done = out / "checkpoints" / "step_00000002"
    saved = {"name": "constant", "warmup_steps": 20, "min_lr_ratio": 0.1}
    torch.save({"sampler": {"world": 1, "batch_size": 16}, "schedule": saved}, done / "trainer.pt")
    args = [f"run.output={out}", "schedule.name=constant"]
    assert preflight.resolve(None, [*args, "schedule.min_lr_ratio=0.5"], resume="latest")
    with pytest.raises(config.ConfigError, match=r"\(schedule\.warmup_steps: 20 saved, 5 asked\)"):
        preflight.resolve(None, [*args, "schedule.warmup_steps=5"], resume="latest")
    with pytest.raises(config.ConfigError) as info:  # only what constant reads is compared
        preflight.resolve(None, [f"run.output={out}", "schedule.min_lr_ratio=0.5"], resume="latest")
    assert "(schedule.name: 'constant' saved, 'cosine' asked); " in str(info.value)
    monkeypatch.setitem(registries.schedules._items, "flat", registries.constant)
    torch.save(
        {"sampler": {"world": 1, "batch_size": 16}, "schedule": {**saved, "name": "flat"}},
        done / "trainer.pt",
    )
    args = [f"run.output={out}", "schedule.name=flat"]
    with pytest.raises(config.ConfigError, match=r"\(schedule\.min_lr_ratio: 0\.1 saved, 0\.5"):
        preflight.resolve(None, [*args, "schedule.min_lr_ratio=0.5"], resume="latest")


def test_ranges_and_lengths_are_checked_with_every_other_problem(tmp_path) -> None:
    path = _write(
        tmp_path,
        "schedule:\n  min_lr_ratio: 1.5\noptim:\n  betas: [0.9]\nparallel:\n  threads: 0\nrun: 3\n",
    )
    with pytest.raises(config.ConfigError) as info:
        config.load(path, ["checkpoint.every=-1"])
    message = str(info.value)
    assert "5 problems" in message
    assert f"{path}:2: schedule.min_lr_ratio must be in [0, 1], got 1.5" in message
    assert (
        f"{path}:4: optim.betas: needs two numbers in [0, 1), e.g. [0.9, 0.95], got [0.9]"
        in message
    )
    assert f"{path}:6: parallel.threads must be > 0, got 0" in message
    assert f"{path}:7: run: expected a mapping of settings, got 3" in message
    assert "--set checkpoint.every=-1: checkpoint.every must be >= 0, got -1" in message


def test_sections_are_typed_models_and_read_only() -> None:
    cfg = config.load(None, ["optim.lr=1"])
    assert isinstance(cfg.optim, config.OptimSection)
    assert isinstance(cfg.optim.lr, float)
    assert cfg.section(config.ParallelSection) is cfg.parallel
    with pytest.raises(ValueError, match="frozen"):
        cfg.optim.lr = 0.5


class _SwapSection(config.Section):
    """Swap saved activations to host memory."""

    enabled: bool = config.Field(False, description="swap saved activations")
    min_bytes: int = config.Field(1024, gt=0, description="smallest tensor swapped")


def test_a_registered_section_is_validated_documented_and_typed(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(config, "SECTIONS", dict(config.SECTIONS))
    config.register_section("swap", _SwapSection)
    path = _write(tmp_path, "swap:\n  enabled: true\n")
    cfg = config.load(path, ["swap.min_bytes=64"])
    swap = cfg.section(_SwapSection)
    assert (swap.enabled, swap.min_bytes) == (True, 64)
    assert cfg.to_dict()["swap"] == {"enabled": True, "min_bytes": 64}
    assert config.load(None).section(_SwapSection) == _SwapSection()
    bad = _write(tmp_path, "swap:\n  enabld: true\n  min_bytes: 0\n")
    with pytest.raises(config.ConfigError) as info:
        config.load(bad)
    assert f"{bad}:2: unknown key swap.enabld; did you mean 'enabled'?" in str(info.value)
    assert f"{bad}:3: swap.min_bytes must be > 0, got 0" in str(info.value)
    text = config.reference()
    assert "### `swap`\n\nSwap saved activations to host memory." in text
    assert "| `min_bytes` | an integer (> 0) | `1024` | smallest tensor swapped |" in text


def test_register_section_refuses_what_it_cannot_use(monkeypatch) -> None:
    monkeypatch.setattr(config, "SECTIONS", dict(config.SECTIONS))
    with pytest.raises(ValueError, match="'optim' is already registered"):
        config.register_section("optim", _SwapSection)
    with pytest.raises(TypeError, match=r"must be a hyperparallel\.config\.Section subclass"):
        config.register_section("plain", dict)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot name a config section"):
        config.register_section("model_dump", _SwapSection)


@pytest.mark.parametrize("kind", ["gpt2", "gpt_neox", "opt", "qwen2"])
def test_other_architectures_take_the_defaults_they_have(kind) -> None:
    """Llama's num_key_value_heads is no setting of GPT-2: a default it lacks is left out."""
    cfg = preflight.resolve(None, [f"model.type={kind}"], outputs=False)
    built = model.build(cfg.model, 259, seed=0)
    assert built.config.hidden_size == 128
    assert built.config.num_hidden_layers == 4
    applied = model.settings(cfg.model)
    assert ("num_key_value_heads" in applied) == (kind == "qwen2")
    assert all(hasattr(built.config, k) for k in applied)
    ids = torch.randint(0, 259, (2, 16))
    built(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(config.ConfigError, match="gpt2 has no setting num_key_value_heads"):
        preflight.resolve(None, ["model.type=gpt2", "model.config.num_key_value_heads=2"])


def test_a_setting_under_the_architectures_own_name_wins_over_the_defaults() -> None:
    """GPT-2 names hidden_size n_embd: n_embd=64 builds 64, not the small default's 128."""
    cfg = preflight.resolve(
        None,
        ["model.type=gpt2", "model.config.n_embd=64", "model.config.n_layer=2"],
        outputs=False,
    )
    built = model.hf_config(cfg.model, 259)
    assert (built.n_embd, built.n_layer, built.n_head) == (64, 2, 4)
    unset = config.load(None, ["model.type=gpt2", "model.config.n_layer=null"])
    assert model.hf_config(unset.model, 259).n_layer == GPT2Config().n_layer
    with pytest.raises(
        config.ConfigError,
        match=r"--set model.config.n_layer=2, --set model.config.num_hidden_layers=3: "
        r"model.config: n_layer and num_hidden_layers are one setting of gpt2; give only one",
    ):
        preflight.resolve(
            None,
            ["model.type=gpt2", "model.config.n_layer=2", "model.config.num_hidden_layers=3"],
            outputs=False,
        )


def test_the_printed_config_serves_another_architecture_and_a_rebuilt_worker(tmp_path) -> None:
    """--print-config shows model.config as written: reused with model.type=gpt2 it builds; a
    worker rebuilding the config from its dict applies null (the architecture's default)."""
    cfg = preflight.resolve(None, ["model.config.tie_word_embeddings=null"], outputs=False)
    assert cfg.model.config == {"tie_word_embeddings": None}
    path = tmp_path / "config.yaml"
    path.write_text(cfg.to_yaml())
    assert preflight.resolve(str(path), ["model.type=gpt2"], outputs=False).model.type == "gpt2"
    worker = config.build(cfg.to_dict())
    built = model.hf_config(worker.model, 259)
    assert built.tie_word_embeddings is LlamaConfig().tie_word_embeddings
    assert built.hidden_size == 128  # the small defaults still apply


def test_a_pretrained_model_keeps_its_shape_and_its_own_length(tmp_path) -> None:
    """No small default over a saved model; data.seq_len is checked against its positions."""
    saved = tmp_path / "saved"
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    heads = {"num_attention_heads": 2, "num_key_value_heads": 1}
    small = LlamaConfig(vocab_size=259, max_position_embeddings=1024, **shape, **heads)
    AutoModelForCausalLM.from_config(small).save_pretrained(saved)
    args = [f"model.pretrained={saved}", "data.seq_len=600", "model.config.attention_dropout=0.1"]
    cfg = preflight.resolve(None, args, outputs=False)
    assert cfg.model.config == {"attention_dropout": 0.1}
    built = model.build(cfg.model, 259, seed=0)
    assert built.config.hidden_size == 32
    assert built.config.attention_dropout == 0.1
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(None, [f"model.pretrained={saved}", "data.seq_len=2048"], outputs=False)
    assert "data.seq_len=2048 exceeds the model's max_position_embeddings=1024" in str(info.value)
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(None, [f"model.pretrained={saved}", "model.config.hidden_size=64"])
    assert "--set model.config.hidden_size=64: model.config: over model.pretrained, 12 " in str(
        info.value
    )
    assert "would change shape and not load (" in str(info.value)
    assert "self_attn.k_proj.weight (16, 32) -> (16, 64)" in str(info.value)


def _saved_llama(where: Path) -> Path:
    """A one-layer Llama saved with ``save_pretrained`` in ``where``."""
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    heads = {"num_attention_heads": 2, "num_key_value_heads": 1}
    AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=259, **shape, **heads)).save_pretrained(
        where
    )
    return where


def test_a_pretrained_folder_without_weights_is_refused_before_any_process_starts(
    tmp_path,
) -> None:
    """A folder with config.json alone passed preflight; every rank then failed to load it."""
    saved = _saved_llama(tmp_path / "saved")
    (saved / "model.safetensors").unlink()
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(None, [f"model.pretrained={saved}"], outputs=False)
    (problem,) = info.value.problems
    assert problem == (
        f"--set model.pretrained={saved}: model.pretrained: {saved} has a config.json but no "
        f"weights (looked for model.safetensors, model.safetensors.index.json, "
        f"pytorch_model.bin, pytorch_model.bin.index.json); point model.pretrained at the "
        f"save_pretrained directory that holds them, or drop model.pretrained to train a new "
        f"model from model.type and model.config"
    )


def test_a_pretrained_folder_missing_a_shard_is_refused(tmp_path) -> None:
    saved = _saved_llama(tmp_path / "saved")
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (saved / "model.safetensors").rename(saved / "model-00001-of-00002.safetensors")
    (saved / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(None, [f"model.pretrained={saved}"], outputs=False)
    assert (
        f"model.pretrained: {saved}: model.safetensors.index.json names "
        f"model-00002-of-00002.safetensors, which is not there; copy the missing shard(s)"
    ) in str(info.value)
    (saved / "model.safetensors.index.json").write_text("{")
    with pytest.raises(
        config.ConfigError, match=r"model\.safetensors\.index\.json is not a readable"
    ):
        preflight.resolve(None, [f"model.pretrained={saved}"], outputs=False)


def test_a_cut_weights_file_or_config_is_refused_before_any_process_starts(tmp_path) -> None:
    """A cut model.safetensors passed preflight; every rank then printed safetensors' 30-line
    traceback. A cut config.json (or one of a type transformers lacks) printed transformers'."""
    saved = _saved_llama(tmp_path / "saved")
    weights = saved / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(None, [f"model.pretrained={saved}"], outputs=False)
    (problem,) = info.value.problems
    assert problem.startswith(f"--set model.pretrained={saved}: model.pretrained: {weights} is ")
    assert "damaged or incomplete (" in problem
    assert problem.endswith("; copy it again (an interrupted download or copy leaves it short)")
    saved = _saved_llama(tmp_path / "whole")
    for text in ('{"model_type": "llama",', '{"model_type": "no_such_lm"}'):
        (saved / "config.json").write_text(text)
        with pytest.raises(config.ConfigError) as info:
            preflight.resolve(None, [f"model.pretrained={saved}"], outputs=False)
        (problem,) = info.value.problems
        assert f"model.pretrained: transformers cannot read {saved / 'config.json'} (" in problem
        assert "\n" not in problem


def test_a_config_transformers_refuses_is_one_line() -> None:
    """XLNet's config raised NotImplementedError at Spore's small default length: a traceback."""
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(None, ["model.type=xlnet"], outputs=False)
    (problem,) = info.value.problems
    assert problem.startswith(
        "--set model.type=xlnet: model.type: transformers refused the model config "
        "(NotImplementedError: "
    )


def test_a_new_models_special_tokens_lie_in_the_byte_vocabulary() -> None:
    """phi3's default pad id (32000) is outside the 259 byte tokens: its embedding refused to
    build ("Padding_idx must be within num_embeddings"), and GPT-2's bos/eos ids (50256) too."""
    for kind in ("phi3", "gpt2"):
        cfg = preflight.resolve(None, [f"model.type={kind}"], outputs=False)
        built = model.hf_config(cfg.model, 259)
        ids = [built.pad_token_id, built.bos_token_id, built.eos_token_id]
        assert all(i is None or 0 <= i < 259 for i in ids), (kind, ids)
        model.on_meta(built)
    phi3 = preflight.resolve(None, ["model.type=phi3"]).model
    assert model.hf_config(phi3, 259).pad_token_id == 258
    mine = preflight.resolve(None, ["model.type=phi3", "model.config.pad_token_id=7"])
    assert model.hf_config(mine.model, 259).pad_token_id == 7  # yours kept
    llama = model.hf_config(config.load().model, 259)
    assert (llama.pad_token_id, llama.bos_token_id) == (None, 1)  # in the vocabulary: kept


@pytest.mark.parametrize(
    ("kind", "why"),
    [("t5", "an encoder-decoder"), ("vit", "not a text decoder")],
)
def test_a_model_type_without_a_causal_lm_is_refused_in_one_line(kind: str, why: str) -> None:
    """The error repeated transformers' list of some 200 causal-LM config classes."""
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(None, [f"model.type={kind}"], outputs=False)
    (problem,) = info.value.problems
    assert problem == (
        f"--set model.type={kind}: model.type: {kind} is {why}: transformers has no causal-LM "
        f"class for it (AutoModelForCausalLM), and spore train trains causal LMs only; choose "
        f"a decoder type, e.g. llama, qwen2, mistral, gpt2 (the full list: "
        f"transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)"
    )


def test_a_model_type_that_disagrees_with_the_pretrained_one_is_refused(tmp_path) -> None:
    """model.type was ignored beside model.pretrained: type gpt2 over a saved Llama trained the
    Llama while config.yaml said gpt2. It now defaults to null: the saved type, or llama."""
    saved = _saved_llama(tmp_path / "saved")
    assert config.load().model.type is None
    assert model.hf_config(config.load().model, 259).model_type == "llama"
    path = _write(tmp_path, f"model:\n  type: gpt2\n  pretrained: {saved}\n")
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(str(path), [], outputs=False)
    (problem,) = info.value.problems
    assert problem == (
        f"{path}:2: model.type: gpt2, but model.pretrained {saved} holds a llama model "
        f"(its config.json); set model.type to llama or null (with model.pretrained the saved "
        f"config's type is used), or drop model.pretrained to train a new gpt2"
    )
    for agreeing in (
        [f"model.pretrained={saved}"],
        [f"model.pretrained={saved}", "model.type=llama"],
    ):
        assert preflight.resolve(None, agreeing, outputs=False).model.pretrained == str(saved)


def test_optimizer_settings_torch_refuses_fail_before_any_process_starts(tmp_path) -> None:
    with pytest.raises(config.ConfigError) as info:
        config.load(None, ["optim.betas=[1.5, 0.9]", "optim.eps=-1"])
    message = str(info.value)
    assert "optim.betas: needs two numbers in [0, 1), e.g. [0.9, 0.95], got [1.5, 0.9]" in message
    assert "optim.eps must be >= 0, got -1" in message
    path = _write(tmp_path, "optim:\n  options:\n    amsgrad: true\n    fused_typo: true\n")
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(str(path), [], outputs=False)
    assert f"{path}:3, {path}:4: optim 'adamw': AdamW.__init__() got an unexpected keyword " in str(
        info.value
    )
    assert "fused_typo" in str(info.value)
    with pytest.raises(config.ConfigError, match=r"optim 'adamw': .*fused"):  # a RuntimeError
        preflight.resolve(
            None, ["optim.options.fused=true", "optim.options.foreach=true"], outputs=False
        )
    assert preflight.resolve(None, ["optim.options.amsgrad=true"], outputs=False).optim.options


def test_a_number_given_for_a_name_is_that_name_as_written(tmp_path) -> None:
    path = _write(tmp_path, "run:\n  name: 010\ndata:\n  text_key: 1e3\n")
    cfg = config.load(path, ["run.output=12:30"])
    assert (cfg.run.name, cfg.run.output, cfg.data.text_key) == ("010", "12:30", "1e3")
    assert config.load(None, ["run.name=2024"]).run.name == "2024"
    dated = config.load(_write(tmp_path, "run:\n  name: 2024-01-01\n"), ["run.output=2024-01-02"])
    assert (dated.run.name, dated.run.output) == ("2024-01-01", "2024-01-02")  # were errors
    with pytest.raises(config.ConfigError, match=r"run\.steps: expected an integer, got '10'"):
        config.load(None, ["run.steps='10'"])
    with pytest.raises(config.ConfigError, match=r"run\.name: expected a string, got True"):
        config.load(None, ["run.name=true"])


def test_every_problem_is_reported_at_once(tmp_path) -> None:
    """A type error elsewhere does not hide the model and data problems (checked on the
    sections that are valid on their own)."""
    path = _write(
        tmp_path,
        "run:\n  steps: abc\nmodel:\n  config:\n    hiden_size: 3\ndata:\n  path: no/*.txt\n",
    )
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(str(path), [], outputs=False)
    assert info.value.problems == [
        f"{path}:2: run.steps: expected an integer, got 'abc'",
        f"{path}:5: model.config: llama has no setting hiden_size (did you mean 'hidden_size'?)",
        f"{path}:7: data.path: no file matches 'no/*.txt'; check the path or glob",
    ]


@pytest.mark.parametrize(
    ("setting", "why"),
    [
        ("model.config.hidden_act=bogus", "KeyError: 'bogus'"),
        ("model.config.pad_token_id=1000", "Padding_idx must be within num_embeddings"),
    ],
)
def test_preflight_builds_the_model_not_only_its_config(setting, why) -> None:
    """transformers takes each of these as a config and fails building the model: preflight
    builds it on the meta device and reports it (it used to fail in every rank)."""
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(None, [setting], outputs=False)
    (problem,) = info.value.problems
    assert problem.startswith(f"--set {setting}: model: transformers cannot build ")
    assert why in problem


@pytest.mark.parametrize("groups", [3, 0])
def test_key_value_heads_must_divide_the_attention_heads(groups: int) -> None:
    """transformers builds such a model, then its first forward fails in every rank."""
    setting = f"model.config.num_key_value_heads={groups}"
    with pytest.raises(config.ConfigError) as info:
        preflight.resolve(None, ["model.config.num_attention_heads=4", setting], outputs=False)
    (problem,) = info.value.problems
    assert f"{setting} does not divide num_attention_heads=4" in problem
    assert preflight.resolve(None, [setting.replace(f"={groups}", "=2")], outputs=False)


@pytest.mark.parametrize(
    ("setting", "problem"),
    [
        ('run.output=""', "run.output: needs a directory name; use '.' for the current directory"),
        ("data.path=[]", "data.path: needs one or more non-empty globs, or null for the embedded"),
        ('data.path=[a.txt, " "]', "data.path: needs one or more non-empty globs"),
    ],
)
def test_an_empty_output_or_data_glob_is_a_config_error(setting: str, problem: str) -> None:
    """An empty run.output wrote into the current directory; an empty data.path list passed
    preflight and failed in every rank for want of tokens."""
    with pytest.raises(config.ConfigError, match=re.escape(problem)):
        config.load(None, [setting])


def test_output_option_is_the_directory_name_as_typed(tmp_path, monkeypatch) -> None:
    """``--output`` was read as YAML: ``runs/a: b`` became a mapping, ``[x]`` a list."""
    monkeypatch.chdir(tmp_path)
    for name in ("runs/a: b", "[x]", "runs/été #2"):
        result = CliRunner().invoke(train, ["--print-config", "--output", name])
        assert result.exit_code == 0, result.output
        assert yaml.safe_load(result.output)["run"]["output"] == name
        assert name in result.output  # printed as written, not escaped
    result = CliRunner().invoke(train, ["--print-config", "--output", ""])
    assert result.exit_code != 0
    assert '--output "": run.output: needs a directory name' in result.output  # not --set


def test_option_problems_name_the_option(tmp_path) -> None:
    """``--output`` and ``--nproc`` were reported as ``--set run.output=...`` and so on."""
    (tmp_path / "file").write_text("")
    bad = tmp_path / "file" / "run"
    result = CliRunner().invoke(train, ["--output", str(bad)])
    assert result.exit_code != 0
    assert f'--output "{bad}": run.output {bad}: ' in result.output
    result = CliRunner().invoke(train, ["--nproc", "3", "--set", "parallel.replicate=2"])
    assert result.exit_code != 0
    assert "parallel.replicate=2 does not divide parallel.nproc=3 (--nproc 3)" in result.output


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_bytes(b"run:\n  name: caf\xe9\n")
    with pytest.raises(config.ConfigError, match=r"run.yaml: not UTF-8 text \(byte 16\)"):
        config.load(path)


def test_a_hash_in_a_set_value_is_part_of_it() -> None:
    """YAML read ``#`` as a comment: ``--set data.path=#shard.jsonl`` became null (the run
    trained on the embedded corpus) and ``run.name=exp #3`` became ``exp``."""
    cfg = config.load(None, ["data.path=#shard.jsonl", "run.name=exp #3"])
    assert (cfg.data.path, cfg.run.name) == ("#shard.jsonl", "exp #3")
    with pytest.raises(config.ConfigError, match=r"optim.lr: expected a number, got '1e-3 # x'"):
        config.load(None, ["optim.lr=1e-3 # x"])


def test_an_output_that_is_a_file_is_a_config_error(tmp_path) -> None:
    """From YAML or --set (click checks --output itself) it passed preflight, and rank 0 died
    with a FileExistsError traceback."""
    (tmp_path / "notes").write_text("mine")
    for output in ("notes", "notes/run"):
        with pytest.raises(config.ConfigError, match=r"notes is a file, not a directory"):
            preflight.resolve(None, [f"run.output={tmp_path / output}"])
    assert (tmp_path / "notes").read_text() == "mine"


@pytest.mark.parametrize(
    ("name", "folder"),
    [("checkpoints", False), ("metrics.jsonl", True), (".spore-train.lock", True)],
)
def test_what_a_run_writes_of_the_wrong_kind_is_a_config_error(tmp_path, name, folder) -> None:
    """A file named checkpoints passed preflight, and rank 0 died at the first save after
    training up to it; a directory named metrics.jsonl at the first step."""
    (tmp_path / name).mkdir() if folder else (tmp_path / name).write_text("mine")
    kind = "a file" if folder else "a directory"
    with pytest.raises(config.ConfigError, match=f"writes {re.escape(name)} there as {kind}"):
        preflight.resolve(None, [f"run.output={tmp_path}"])


def test_only_what_a_run_will_write_is_checked_and_a_dangling_link_is_of_no_kind(tmp_path) -> None:
    (tmp_path / "final").write_text("mine")  # a run that exports nothing never writes final/
    with pytest.raises(config.ConfigError, match="writes final there as a directory"):
        preflight.resolve(None, [f"run.output={tmp_path}", "checkpoint.export=true"])
    assert preflight.resolve(None, [f"run.output={tmp_path}", "checkpoint.export=false"])
    (tmp_path / "checkpoints").symlink_to(tmp_path / "gone")  # mkdir would fail on it
    with pytest.raises(config.ConfigError, match="writes checkpoints there as a directory"):
        preflight.resolve(None, [f"run.output={tmp_path}", "checkpoint.export=false"])


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_output_that_cannot_be_written_is_a_config_error() -> None:
    """It passed preflight, and rank 0 died with a FileNotFoundError traceback at mkdir.
    (/proc refuses new entries even to root, which a read-only directory does not.)"""
    with pytest.raises(
        config.ConfigError, match=r"run.output /proc/spore_run: cannot write in /proc"
    ):
        preflight.resolve(None, ["run.output=/proc/spore_run"])


def test_an_unknown_section_given_by_set_names_the_option() -> None:
    with pytest.raises(config.ConfigError, match=r"--set nosuch\.key=1: unknown section 'nosuch'"):
        config.load(None, ["nosuch.key=1"])


def test_data_files_the_ranks_would_refuse_are_config_errors(tmp_path) -> None:
    """A directory or a file of another type matched by data.path passed preflight (only
    a match was checked) and failed in every rank."""
    (tmp_path / "docs.txt").mkdir()
    (tmp_path / "a.JSONL").write_text('{"text": "x"}\n')
    for pattern, problem in (
        ("docs.txt", "is a directory; pass a glob"),
        ("*.JSONL", "unsupported file type '.JSONL'; supported: .txt, .jsonl"),
    ):
        with pytest.raises(config.ConfigError, match=re.escape(problem)):
            preflight.resolve(None, [f"data.path={tmp_path / pattern}"], outputs=False)


def test_a_config_taken_by_resume_is_a_usage_error(tmp_path, monkeypatch) -> None:
    """``spore train --resume run.yaml``: click gives run.yaml to --resume (its value is
    optional), and the default config ran against "no complete checkpoint in run.yaml"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text("run:\n  steps: 3\n")
    result = CliRunner().invoke(train, ["--resume", "run.yaml"])
    assert result.exit_code == 2
    assert "put the config first: spore train run.yaml --resume" in result.output


def test_a_lock_file_that_cannot_be_opened_is_a_config_error(tmp_path, monkeypatch) -> None:
    """Another user's lock file that this one may not open failed preflight with a
    PermissionError traceback (root, which runs the tests, may open any: open is refused here)."""
    (tmp_path / launch.LOCK_FILE).write_text("")
    real = os.open

    def refuse(path, flags, *args):
        if Path(path).name == launch.LOCK_FILE:
            raise PermissionError(13, "Permission denied")
        return real(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(config.ConfigError, match=r"cannot be opened \(Permission denied\)"):
        preflight.resolve(None, [f"run.output={tmp_path}"])
    monkeypatch.setattr(os, "open", real)  # readable, but not writable by this user
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path).name != launch.LOCK_FILE)
    with pytest.raises(config.ConfigError, match=r"cannot be written by this user"):
        preflight.resolve(None, [f"run.output={tmp_path}"])
