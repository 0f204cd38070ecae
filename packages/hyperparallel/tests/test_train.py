"""Real ``spore train`` runs: gloo ranks in child processes, each with a hard timeout (or, where
a test needs only one rank's few steps, that rank in the test's own process).

Most tests compare against one shared reference run (2 ranks, FSDP2): a variant stops early
with ``run.stop_at`` so that it keeps the reference's learning-rate schedule.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from train_helpers import (
    Run,
    losses,
    run_train,
    small_args,
    start_train,
    train_in_process,
    train_run,
)

from hyperparallel import checkpoint, launch
from hyperparallel.config import load
from hyperparallel.data import ByteTokenizer
from spore import childproc
from spore.testing import clean_environ

README = Path(__file__).resolve().parents[1] / "README.md"

STEPS = 30
COMMON = (f"run.steps={STEPS}", "optim.lr=0.01", "checkpoint.every=0")
"""Settings every run compared with the reference shares (its schedule spans STEPS)."""


def _close(a: dict[int, float], b: dict[int, float], steps: range) -> None:
    for step in steps:
        assert abs(a[step] - b[step]) < 1e-4, (step, a[step], b[step])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The reference: FSDP2 over 2 ranks, 8 sequences each, checkpoint and export at the end;
    TMPDIR is a folder of its own (``_run_tmp``)."""
    tmp = _run_tmp(tmp_path_factory)
    tmp.mkdir()
    args = ("--nproc", "2", *small_args(*COMMON))
    return train_run(tmp_path_factory.mktemp("two_ranks"), *args, env={"TMPDIR": str(tmp)})


def _run_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "two_ranks_tmp"


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One process with the reference's global batch (16 sequences), stopped at step 6."""
    return train_run(
        tmp_path_factory.mktemp("one_rank"),
        *small_args(*COMMON, "data.batch_size=16", "run.stop_at=6", "checkpoint.export=false"),
    )


def test_a_run_leaves_nothing_in_the_temporary_folder(
    two_ranks: Run, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The elastic agent's folder (once a torchelastic_* folder per run) is removed; Inductor's
    cache, meant to persist, is all that stays."""
    left = [p.name for p in _run_tmp(tmp_path_factory).iterdir()]
    assert [name for name in left if not name.startswith("torchinductor_")] == []


def test_two_ranks_learn_and_write_every_output(two_ranks: Run) -> None:
    curve, out = two_ranks.losses, two_ranks.output
    assert sorted(curve) == list(range(1, STEPS + 1))
    first = statistics.fmean(curve[s] for s in range(1, 6))
    last = statistics.fmean(curve[s] for s in range(STEPS - 4, STEPS + 1))
    assert last < 0.6 * first, f"loss did not fall clearly: {first:.3f} -> {last:.3f}"
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"steps: {STEPS}" in (out / "config.yaml").read_text()
    assert [p.name for p in checkpoint.complete(out)] == [f"step_{STEPS:08d}"]
    assert (out / "final" / "config.json").is_file()
    assert "2 rank(s), FSDP2" in two_ranks.done.stdout
    assert two_ranks.done.stdout.count("spore train: summary") == 1  # rank 0 only


def test_each_metrics_line_has_the_rate_its_step_used(two_ranks: Run) -> None:
    """Warm-up rises from 0 at step 0 over 5 steps (SMALL) to optim.lr: the first update uses
    0 and the sixth the peak. Each line showed the next step's rate before."""
    lines = (two_ranks.output / "metrics.jsonl").read_text().splitlines()
    rates = {r["step"]: r["lr"] for r in map(json.loads, lines)}
    assert rates[1] == 0.0
    assert [rates[s] for s in range(2, 7)] == pytest.approx([0.002, 0.004, 0.006, 0.008, 0.01])


def test_two_ranks_match_one_process_on_the_same_global_batch(two_ranks: Run, one_rank) -> None:
    """The oracle: FSDP2 over 2 ranks = 1 rank with the whole global batch.

    The small model's vocabulary (259 rows) and intermediate size (171) are odd, so FSDP2
    shards those parameters unevenly over the 2 ranks.
    """
    assert "1 rank, unsharded" in one_rank.done.stdout
    assert sorted(one_rank.losses) == list(range(1, 7))
    _close(one_rank.losses, two_ranks.losses, range(1, 7))


def test_two_ranks_resume_bitwise(two_ranks: Run, tmp_path) -> None:
    part = tmp_path / "part"
    args = ("checkpoint.every=3", "checkpoint.export=false")
    run_train("--nproc", "2", "--output", str(part), *small_args(*COMMON, *args, "run.stop_at=5"))
    assert [p.name for p in checkpoint.complete(part)] == ["step_00000003", "step_00000005"]
    assert max(losses(part)) == 5
    resumed = small_args(*COMMON, *args, "run.stop_at=10")
    run_train("--nproc", "2", "--output", str(part), "--resume", *resumed)
    got, want = losses(part), two_ranks.losses
    assert sorted(got) == list(range(1, 11))
    assert [got[s] for s in range(6, 11)] == [want[s] for s in range(6, 11)]  # bitwise


def test_a_resume_at_stop_at_trains_on_to_the_last_step() -> None:
    from hyperparallel.train import end_step

    assert end_step(0, 8, 4) == 4
    assert end_step(4, 8, 4) == 8  # the README's stop_at, then --resume with the same file
    assert end_step(4, 8, 6) == 6
    assert end_step(2, 8, 20) == 8
    assert end_step(5, 8, None) == 8


def test_one_rank_trains_unsharded_and_resumes_bitwise(one_rank: Run, tmp_path) -> None:
    part = tmp_path / "part"
    args = ("data.batch_size=16", "checkpoint.every=3", "checkpoint.export=false")
    run_train("--output", str(part), *small_args(*COMMON, *args, "run.stop_at=3"))
    run_train("--output", str(part), "--resume", *small_args(*COMMON, *args, "run.stop_at=6"))
    got, want = losses(part), one_rank.losses
    assert [got[s] for s in range(4, 7)] == [want[s] for s in range(4, 7)]  # bitwise


def test_a_resume_from_an_older_checkpoint_continues_its_own_branch(tmp_path) -> None:
    """Resumed from step 2 of a run that saved step 4, the next ``--resume`` takes the branch's
    step 3 (the step-4 lineage would leave step 4 out of the metrics)."""
    out = tmp_path / "run"
    args = (*COMMON, "checkpoint.every=2", "checkpoint.export=false")
    run_train("--output", str(out), *small_args(*args, "run.stop_at=4"))
    older = checkpoint.directory(out) / "step_00000002"
    # one with nothing to train cut the log to its step, wrote its config.yaml, and replaced
    # final/ with the older checkpoint's weights
    config = (out / "config.yaml").read_text()
    (out / "final").mkdir()
    (out / "final" / "export").write_text("step 4's")
    noop = run_train(
        "--output", str(out), "--resume", str(older),
        *small_args(*args, "run.steps=2", "checkpoint.export=true"),
    )  # fmt: skip
    assert "nothing to train" in noop.stderr
    assert sorted(losses(out)) == [1, 2, 3, 4]
    assert (out / "config.yaml").read_text() == config
    assert [p.name for p in (out / "final").iterdir()] == ["export"]
    branch = run_train(
        "--output", str(out), "--resume", str(older), *small_args(*args, "run.stop_at=3")
    )
    assert "resuming from step_00000002, older than step_00000004" in branch.stderr
    assert checkpoint.find(out).name == "step_00000003"
    meta = json.loads((checkpoint.find(out) / "meta.json").read_text())
    assert meta["parent"] == older.name  # what a damaged step 3 names to resume from
    run_train("--output", str(out), "--resume", *small_args(*args, "run.stop_at=6"))
    assert sorted(losses(out)) == list(range(1, 7))


def test_a_resume_that_trains_on_exports_again(tmp_path) -> None:
    """final/ holds the weights of the last step trained: a resume that trains on to
    run.steps replaces an earlier export (it kept the old one: a step was compared with a
    time)."""
    out = tmp_path / "run"
    args = ("optim.lr=0.01", "checkpoint.every=0", "checkpoint.export=true")
    run_train("--output", str(out), *small_args(*args, "run.steps=2"))
    weights = sorted((out / "final").glob("*.safetensors"))
    assert weights, list((out / "final").iterdir())
    before = [w.read_bytes() for w in weights]
    run_train("--output", str(out), "--resume", *small_args(*args, "run.steps=3"))
    assert [w.read_bytes() for w in weights] != before


def _tree_stats(folder: Path) -> dict[str, tuple[int, int]]:
    """The inode and modification time of ``folder`` and of each file in it, by name."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in [folder, *folder.iterdir()]}


def test_a_resume_that_trains_nothing_exports_the_checkpoint_final_does_not_hold(
    tmp_path,
) -> None:
    """A run stopped after its last save but before its export left final/ of an earlier
    step, which a resume that trains nothing kept: the user got older weights without a word.
    final/ names the checkpoint it holds: such a resume exports again where it names another or
    none, and leaves one naming the checkpoint resumed as it is."""
    out = tmp_path / "run"
    args = ("checkpoint.every=0", "schedule.warmup_steps=0", "optim.lr=0.01")
    record = out / "final" / checkpoint.EXPORT_RECORD
    train_in_process(out, *args, "run.steps=1")
    assert json.loads(record.read_text()) == {"checkpoint": "step_00000001", "step": 1, "save": 1}
    # step 2 saved, then stopped before its export: final/ still holds step 1
    train_in_process(out, *args, "run.steps=2", "checkpoint.export=false", resume="latest")
    newest = checkpoint.find(out)
    flat = tmp_path / "newest.pt"
    dcp_to_torch_save(newest, flat)
    saved = torch.load(flat, weights_only=True)["train"]["model"]

    train_in_process(out, *args, "run.steps=2", resume="latest")  # nothing to train
    assert json.loads(record.read_text()) == {"checkpoint": newest.name, "step": 2, "save": 2}
    exported = load_file(out / "final" / "model.safetensors")
    assert exported.keys() <= saved.keys()
    assert all(torch.equal(exported[name], saved[name]) for name in exported)
    kept = _tree_stats(out / "final")
    train_in_process(out, *args, "run.steps=2", resume="latest")  # final/ holds it: no export
    assert _tree_stats(out / "final") == kept

    record.unlink()  # an export of before, naming no checkpoint
    train_in_process(out, *args, "run.steps=2", resume="latest")
    assert json.loads(record.read_text())["checkpoint"] == newest.name

    # another output's checkpoint resumed into this one: final/ is not that run's to replace
    other = tmp_path / "other"
    train_in_process(other, *args, "run.steps=2", "checkpoint.export=false")
    kept = _tree_stats(out / "final")
    train_in_process(out, *args, "run.steps=2", resume=str(checkpoint.find(other)))
    assert _tree_stats(out / "final") == kept


def test_a_second_run_on_an_output_in_use_is_refused(tmp_path) -> None:
    """Two runs on one output removed each other's checkpoints in progress and mixed their
    logs; the second is refused while the first holds it, and runs once it is let go."""
    out = tmp_path / "run"
    args = small_args("run.steps=1", "checkpoint.export=false")
    with launch.hold_output(str(out)):
        done = run_train("--output", str(out), *args, check=False)
        # the Python API too (preflight, which the command runs first, is not asked here)
        cfg = load(None, ["run.steps=1", f"run.output={out}"])
        with pytest.raises(launch.OutputBusy, match=f"pid {os.getpid()} on "):
            launch.launch(cfg)
    assert done.returncode == 1
    assert f"run.output {out} is in use by another spore train (pid {os.getpid()} on " in (
        done.stderr
    )
    assert "Traceback" not in done.stderr
    assert not (out / "metrics.jsonl").exists()
    run_train("--output", str(out), *args)
    assert sorted(losses(out)) == [1]


@pytest.mark.parametrize(("repeat", "why"), [(900, "num_blocks="), (300, "other documents")])
def test_a_resume_on_other_data_fails_plainly(tmp_path, repeat: int, why: str) -> None:
    """Documents changed since the checkpoint, into more blocks or into as many: the rank
    refuses with one line, no traceback."""
    data_file = tmp_path / "data.txt"
    data_file.write_text("the cat sat on the mat. " * 300)
    out = tmp_path / "run"
    args = small_args("run.steps=2", "checkpoint.export=false", f"data.path={data_file}")
    run_train("--output", str(out), *args, "--set", "run.stop_at=1")
    data_file.write_text("the dog sat on the log. " * repeat)
    done = run_train("--output", str(out), "--resume", *args, check=False)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.count("error: --resume step_00000001: the sampler state was saved") == 1
    assert why in done.stderr


def test_a_resume_with_other_optimizer_settings_fails_plainly(tmp_path) -> None:
    """The checkpoint's optimizer state holds its settings: a resume asking for others would
    train with the saved ones while its config.yaml said otherwise."""
    out = tmp_path / "run"
    args = small_args("run.steps=2", "checkpoint.export=false")
    run_train("--output", str(out), *args, "--set", "run.stop_at=1")
    written = (out / "config.yaml").read_text()
    done = run_train(
        "--output", str(out), "--resume", *args, "--set", "optim.betas=[0.8,0.9]", check=False
    )  # fmt: skip
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.count("the checkpoint's optimizer settings differ") == 1
    assert "(betas (group 0): [0.9, 0.95] saved, [0.8, 0.9] asked; betas (group 1)" in done.stderr
    assert "(optim.lr may change, the others not)" in done.stderr
    assert (out / "config.yaml").read_text() == written  # not rewritten by the refused run
    assert sorted(losses(out)) == [1]


def test_a_resume_may_lower_the_rate(tmp_path) -> None:
    """The divergence message says to resume with a lower optim.lr, which the settings check
    refused; the schedule now goes on at the new peak rate, as a run started with it would."""
    out, fresh = tmp_path / "run", tmp_path / "fresh"
    args = small_args("run.steps=3", "checkpoint.export=false", "schedule.warmup_steps=0")
    run_train("--output", str(out), *args, "--set", "run.stop_at=1")
    done = run_train("--output", str(out), "--resume", *args, "--set", "optim.lr=1e-5")
    assert "note: --resume step_00000001: optim.lr is 1e-05 (the checkpoint's was 0.003)" in (
        done.stderr
    )
    run_train("--output", str(fresh), *args, "--set", "optim.lr=1e-5")

    def rates(where: Path) -> list[float]:
        lines = (where / "metrics.jsonl").read_text().splitlines()
        return [r["lr"] for r in map(json.loads, lines)]

    assert rates(out)[1:] == rates(fresh)[1:]
    assert rates(out)[0] > rates(fresh)[0]  # step 1 ran at the old rate
    assert "lr: 1.0e-05" in (out / "config.yaml").read_text()


def test_a_resume_with_other_gradient_accumulation_says_the_global_batch_changes(
    tmp_path, capsys
) -> None:
    """optim.grad_accum changed the global batch of a resumed run without a word (the ranks
    and data.batch_size are refused, being the data layout): it now goes on with a note."""
    out = tmp_path / "run"
    args = ("run.steps=3", "checkpoint.export=false")
    train_in_process(out, *args, "run.stop_at=1")
    capsys.readouterr()
    train_in_process(out, *args, "run.stop_at=2", resume="latest")
    assert "grad_accum" not in capsys.readouterr().err
    train_in_process(out, *args, "optim.grad_accum=2", resume="latest")
    assert (
        "note: --resume step_00000002: optim.grad_accum is 2 (the checkpoint's was 1): the "
        "global batch goes from 8 to 16 sequences per step (data.batch_size=8 x 1 rank(s) x "
        "optim.grad_accum; 512 -> 1024 tokens); optim.lr and the schedule are not rescaled"
    ) in capsys.readouterr().err
    assert sorted(losses(out)) == [1, 2, 3]


def test_a_resume_with_another_seed_fails_plainly(tmp_path) -> None:
    """The sampler's saved seed orders the rest of the data: a resume asking another ran on in
    the saved order while its config.yaml recorded the new seed."""
    out = tmp_path / "run"
    args = small_args("run.steps=2", "checkpoint.export=false")
    run_train("--output", str(out), *args, "--set", "run.stop_at=1")
    written = (out / "config.yaml").read_text()
    done = run_train("--output", str(out), "--resume", *args, "--set", "run.seed=1", check=False)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.count("data order was seeded with run.seed=0, this run asks run.seed=1") == 1
    assert (out / "config.yaml").read_text() == written
    assert sorted(losses(out)) == [1]


def test_a_diverging_run_stops_before_saving_a_non_finite_state(tmp_path) -> None:
    """It ran on with NaN losses, exited 0, pruned the last finite checkpoint for NaN ones,
    exported NaN weights and wrote bare NaN (not JSON) into metrics.jsonl."""
    out = tmp_path / "run"
    args = small_args(
        "run.steps=6", "optim.lr=1e30", "optim.grad_clip=0", "schedule.warmup_steps=0",
        "checkpoint.every=1", "checkpoint.keep=1", "checkpoint.export=true",
    )  # fmt: skip
    done = run_train("--output", str(out), *args, check=False)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.count("training diverged and stopped without saving this state") == 1
    records = [
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))
        for line in (out / "metrics.jsonl").read_text().splitlines()
    ]
    bad = records[-1]["step"]
    # the first step with NaN gradients (its loss, taken before the update, is finite) stops it
    assert records[-1]["grad_norm"] is None  # inf or NaN: strict JSON writes null
    assert all(r["loss"] is not None for r in records[:-1])
    assert all(r["grad_norm"] is not None for r in records[:-1])  # worked out without clipping
    (kept,) = checkpoint.complete(out)
    assert kept.name == f"step_{bad - 1:08d}"
    assert f"({kept.name} is the last checkpoint)" in done.stderr
    assert "lower optim.lr (or set optim.grad_clip)" in done.stderr
    assert not (out / "final").exists()
    flat = tmp_path / "kept.pt"
    dcp_to_torch_save(kept, flat)
    weights = torch.load(flat, weights_only=True)["train"]["model"]
    assert weights
    assert all(w.isfinite().all() for w in weights.values())


def test_a_resume_with_more_steps_follows_the_new_schedule_from_its_first_step(tmp_path) -> None:
    """Its first step took the saved rate of the old, shorter schedule (lower there: its cosine
    decays sooner), and the schedule's own rate only from the second."""
    args = ("checkpoint.every=2", "checkpoint.export=false", "schedule.warmup_steps=1")
    part, whole = tmp_path / "part", tmp_path / "whole"
    run_train("--output", str(part), *small_args(*args, "run.steps=4", "run.stop_at=2"))
    run_train("--output", str(part), "--resume", *small_args(*args, "run.steps=6"))
    run_train("--output", str(whole), *small_args(*args, "run.steps=6"))

    def records(out: Path) -> dict[int, dict]:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, lines)}

    got, want = records(part), records(whole)
    saved = torch.load(part / "checkpoints/step_00000006/trainer.pt", weights_only=False)
    assert saved["schedule"] == {"name": "cosine", "warmup_steps": 1, "min_lr_ratio": 0.1}
    assert sorted(got) == list(range(1, 7))
    assert [got[s]["lr"] for s in got] == [want[s]["lr"] for s in got]
    assert [got[s]["loss"] for s in got] == [want[s]["loss"] for s in got]  # bitwise


_FLAT_PLUGIN = '''"""A Spore plugin whose module adds a schedule reading warmup_steps alone."""
from hyperparallel import registries


@registries.schedules.register("flat", reads={"warmup_steps"})
def flat(optimizer, schedule, steps):
    return registries.constant(optimizer, schedule, steps)
'''


def test_a_plugins_schedule_is_compared_on_resume_by_the_settings_it_reads(tmp_path) -> None:
    """A schedule a plugin registered could not say what it reads: a resume compared every
    schedule setting, and refused another min_lr_ratio, which flat does not read."""
    plugin = tmp_path / "plugin"
    info = plugin / "spore_flat_schedule-0.1.0.dist-info"
    info.mkdir(parents=True)
    (plugin / "spore_flat_schedule.py").write_text(_FLAT_PLUGIN)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: spore-flat-schedule\nVersion: 0.1.0\n"
        "Requires-Dist: spore-core>=0.1\n"
    )
    (info / "entry_points.txt").write_text("[spore.plugins]\nflat = spore_flat_schedule\n")
    path = [str(plugin), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {"PYTHONPATH": os.pathsep.join(path)}
    out = tmp_path / "run"
    args = small_args("schedule.name=flat", "run.steps=3", "checkpoint.export=false")
    run_train("--output", str(out), *args, "--set", "run.stop_at=2", env=env)
    other_ratio = ("--set", "schedule.min_lr_ratio=0.5")
    run_train("--output", str(out), "--resume", *args, *other_ratio, env=env)
    assert sorted(losses(out)) == [1, 2, 3]
    other_warm_up = ("--set", "schedule.warmup_steps=2")
    done = run_train("--output", str(out), "--resume", *args, *other_warm_up, env=env, check=False)
    assert done.returncode == 1
    assert "(schedule.warmup_steps: 5 saved, 2 asked); resuming under these" in done.stderr


def _truncate_shard(step: Path) -> None:
    (shard,) = step.glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:1000])


def _drop_world_size(step: Path) -> None:
    meta = json.loads((step / "meta.json").read_text())
    del meta["world_size"]
    (step / "meta.json").write_text(json.dumps(meta))


def _drop_dcp_metadata(step: Path) -> None:  # DCP logged its tracebacks on the root logger
    (step / ".metadata").unlink()


def test_a_damaged_checkpoint_is_named_with_the_older_one_to_resume_from(tmp_path) -> None:
    """A cut-short shard or a meta.json without its world size gave DCP's or a KeyError's
    traceback, and the hint after it named the damaged checkpoint to resume from."""
    ref = tmp_path / "ref"
    args = small_args("checkpoint.every=1", "checkpoint.export=false", "run.steps=3")
    run_train("--output", str(ref), *args, "--set", "run.stop_at=2")
    for damage in (_truncate_shard, _drop_world_size, _drop_dcp_metadata):
        out = tmp_path / damage.__name__
        shutil.copytree(ref, out)
        newest = checkpoint.find(out)
        damage(newest)
        done = run_train("--output", str(out), "--resume", *args, check=False)
        assert done.returncode == 1
        assert "Traceback" not in done.stderr
        assert f"error: checkpoint {newest} cannot be loaded (" in done.stderr
        older = checkpoint.directory(out) / "step_00000001"
        assert f"resume from an older checkpoint with --resume {older}," in done.stderr
        assert f"This run saved no checkpoint; the newest is still {newest}." in done.stderr
        assert "(continue with --resume)" not in done.stderr
        assert sorted(losses(out)) == [1, 2]
    # a meta.json cut short: the checkpoint is not complete, and the resume says it skipped it,
    # --resume PATH of the output too (it said nothing)
    for name, resume in (("meta_cut", ()), ("meta_cut_path", ("{out}",))):
        out = tmp_path / name
        shutil.copytree(ref, out)
        newest = checkpoint.find(out)
        (newest / "meta.json").write_text("{")
        target = [item.format(out=out) for item in resume]
        done = run_train("--output", str(out), "--resume", *target, *args)
        assert f"note: skipped {newest.name} (meta.json missing or unreadable" in done.stderr
        assert "resuming from step_00000001" in done.stderr
        assert sorted(losses(out)) == [1, 2, 3]


def test_a_resume_of_a_finished_run_says_there_is_nothing_to_train(tmp_path) -> None:
    out = tmp_path / "run"
    args = small_args("run.steps=2", "checkpoint.export=false", "run.stop_at=1")
    run_train("--output", str(out), *args)
    run_train("--output", str(out), "--resume", *args)  # past stop_at: on to run.steps
    done = run_train("--output", str(out), "--resume", *args, env={"COLUMNS": "1000"})  # no wrap
    assert "resuming at step 2: run.steps=2 is reached, nothing to train" in done.stderr
    assert "- (no step trained)" in done.stdout  # it printed "nan (first 10) -> nan"
    assert "nan" not in done.stdout
    assert str(checkpoint.find(out)) in done.stdout  # the checkpoint row said "-"
    assert "training on to run.steps" not in done.stderr
    assert sorted(losses(out)) == [1, 2]


def test_a_resume_into_a_new_output_that_trains_nothing_names_no_file_it_did_not_write(
    tmp_path,
) -> None:
    """The summary named metrics.jsonl and loss.png in the new output, which held neither."""
    first, second = tmp_path / "first", tmp_path / "second"
    args = small_args("run.steps=1", "checkpoint.export=false")
    run_train("--output", str(first), *args)
    done = run_train(
        "--output", str(second), "--resume", str(checkpoint.find(first)), *args,
        env={"COLUMNS": "1000"},
    )  # fmt: skip
    assert "run.steps=1 is reached, nothing to train" in done.stderr
    rows = dict(re.findall(r"(metrics|loss curve)\s*│\s*(\S+)\s*│", done.stdout))
    assert rows == {"metrics": "-", "loss curve": "-"}, done.stdout
    assert not (second / "metrics.jsonl").exists()


def test_the_loss_line_of_a_short_run_compares_its_two_halves(one_rank: Run) -> None:
    """Six steps were "first 6 -> last 6", one mean twice: as if nothing had been learned."""
    curve = [one_rank.losses[s] for s in sorted(one_rank.losses)]
    head, tail = statistics.fmean(curve[:3]), statistics.fmean(curve[3:])
    assert f"{head:.4f} (first 3) -> {tail:.4f} (last 3)" in one_rank.done.stdout


def test_activation_checkpointing_and_kept_parameters_change_nothing(
    two_ranks: Run, tmp_path
) -> None:
    """Over FSDP2 (2 ranks), recomputing each layer and keeping its gathered parameters for
    backward give bitwise the reference's losses: the same computation on the same values."""
    extra = ("parallel.activation_checkpointing=true", "parallel.reshard_after_forward=false")
    args = small_args(*COMMON, *extra, "run.stop_at=5", "checkpoint.export=false")
    run = train_run(tmp_path / "run", "--nproc", "2", *args)
    assert [run.losses[s] for s in range(1, 6)] == [two_ranks.losses[s] for s in range(1, 6)]


def test_gradient_accumulation_matches_one_large_batch(two_ranks: Run, tmp_path) -> None:
    """2 micro-batches of 4 = the reference's 1 batch of 8 per rank."""
    extra = ("data.batch_size=4", "optim.grad_accum=2", "run.stop_at=5", "checkpoint.export=false")
    run = train_run(tmp_path / "run", "--nproc", "2", *small_args(*COMMON, *extra))
    _close(run.losses, two_ranks.losses, range(1, 6))


def test_tied_embeddings_of_a_bert_shard_with_the_root(tmp_path) -> None:
    """BERT lists its embeddings among its blocks, and their word embeddings are tied to the
    LM head (the root's): sharding them alone failed every FSDP2 run ("shared with a parameter
    already managed by another FSDP group"). Two ranks now match one process."""
    bert = [
        f"model.config.{k}={v}"
        for k, v in (
            ("hidden_size", 32),
            ("num_hidden_layers", 2),
            ("num_attention_heads", 2),
            ("hidden_dropout_prob", 0.0),  # each rank draws its own masks
            ("attention_probs_dropout_prob", 0.0),
        )
    ]
    args = (
        "model.type=bert", *bert, "data.seq_len=32", "run.steps=2", "optim.lr=0.01",
        "parallel.threads=1", "checkpoint.export=false",
    )  # fmt: skip
    two, one = tmp_path / "two", tmp_path / "one"
    run_train("--output", str(two), "--nproc", "2", *_sets(*args, "data.batch_size=4"))
    run_train("--output", str(one), *_sets(*args, "data.batch_size=8"))
    _close(losses(two), losses(one), range(1, 3))


@pytest.mark.parametrize(
    ("kind", "shape"),
    [
        ("mamba", {"hidden_size": 32, "num_hidden_layers": 2, "state_size": 4}),
        (
            "mbart",
            {"d_model": 32, "decoder_layers": 2, "decoder_attention_heads": 2,
             "decoder_ffn_dim": 64, "dropout": 0.0, "attention_dropout": 0.0},
        ),
    ],
)  # fmt: skip
def test_blocks_listed_inside_other_blocks_shard_with_them(tmp_path, kind, shape) -> None:
    """Mamba lists its mixer and the block holding it among its blocks, mBART its attention
    and layers: sharding the inner one after the outer failed every FSDP2 run ("Cannot
    concatenate overlapping meshes"). Two ranks now match one process."""
    args = (
        f"model.type={kind}", *(f"model.config.{k}={v}" for k, v in shape.items()),
        "data.seq_len=32", "run.steps=2", "optim.lr=0.01", "parallel.threads=1",
        "checkpoint.export=false",
    )  # fmt: skip
    two, one = tmp_path / "two", tmp_path / "one"
    run_train("--output", str(two), "--nproc", "2", *_sets(*args, "data.batch_size=4"))
    run_train("--output", str(one), *_sets(*args, "data.batch_size=8"))
    _close(losses(two), losses(one), range(1, 3))


def _sets(*items: str) -> list[str]:
    return [part for item in items for part in ("--set", item)]


def test_hsdp_runs_and_matches_fsdp(two_ranks: Run, tmp_path) -> None:
    """HSDP 2 x 2 over 4 ranks with 4 sequences each: the reference's global batch."""
    extra = ("parallel.replicate=2", "data.batch_size=4", "run.stop_at=4")
    args = small_args(*COMMON, *extra, "checkpoint.export=false")
    run = train_run(tmp_path / "run", "--nproc", "4", *args)
    assert "HSDP 2 x 2" in run.done.stdout
    _close(run.losses, two_ranks.losses, range(1, 5))


def test_bf16_mixed_precision_trains_close_to_fp32(two_ranks: Run, tmp_path) -> None:
    extra = ("parallel.mixed_precision=bf16", "run.stop_at=12", "checkpoint.export=false")
    got = train_run(tmp_path / "run", "--nproc", "2", *small_args(*COMMON, *extra)).losses
    want = two_ranks.losses
    assert [got[s] for s in range(1, 13)] != [want[s] for s in range(1, 13)]  # bf16 really ran
    assert abs(got[12] - want[12]) < 0.1 * want[12]
    assert got[12] < 0.7 * got[1]


def test_export_is_a_pretrained_directory_that_trains_on(two_ranks: Run, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    final = two_ranks.output / "final"
    model = AutoModelForCausalLM.from_pretrained(final, local_files_only=True)
    assert model.config.vocab_size == 259
    assert model.config.intermediate_size == 171
    # the byte tokenizer's specials, not llama's (eos 2 is a byte: generate() stopped on it)
    specials = (ByteTokenizer.bos_id, ByteTokenizer.eos_id, ByteTokenizer.pad_id)
    assert (model.config.bos_token_id, model.config.eos_token_id) == specials[:2]
    assert model.config.pad_token_id == specials[2]
    assert model.generation_config.eos_token_id == ByteTokenizer.eos_id
    # training turns the KV cache off; an export that kept it off generated without one
    assert model.config.use_cache is True
    assert model.generation_config.use_cache is True
    example = re.search(r"<!-- export-example -->\n```python\n(.*?)```", README.read_text(), re.S)
    assert example, "README.md lacks the export example"
    namespace: dict = {}
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(example.group(1).replace("runs/default/final", str(final)), namespace)
    generated = namespace["out"][0, namespace["ids"].shape[1] :]
    assert 0 < len(generated) <= 40
    assert int(generated.max()) < ByteTokenizer.vocab_size
    assert printed.getvalue() == ByteTokenizer().decode(generated) + "\n"
    extra = ("run.steps=2", "schedule.warmup_steps=0", f"model.pretrained={final}")
    again = train_run(tmp_path / "again", *small_args(*extra))
    start = two_ranks.losses
    assert again.losses[1] < start[1] * 0.7, "the exported weights did not carry the training"
    assert abs(again.losses[1] - start[STEPS]) < 0.5


def test_joins_a_torchrun_job(two_ranks: Run, tmp_path) -> None:
    """Started by torchrun, each process is one rank of that job (multi-node runs work alike);
    2 ranks of 8 sequences as HSDP 2 x 1 train as the reference does."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torch installs the torchrun script next to the interpreter"
    out = tmp_path / "run"
    args = small_args(*COMMON, "run.stop_at=3", "checkpoint.export=false", "parallel.replicate=2")
    command = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "hyperparallel"]
    done = childproc.run(
        [*command, "--output", str(out), *args], timeout=300, env=clean_environ(), check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(losses(out)) == [1, 2, 3]
    assert "HSDP 2 x 1" in done.stdout
    _close(losses(out), two_ranks.losses, range(1, 4))


def test_a_rank_whose_peer_never_joins_exits_with_status_1(tmp_path) -> None:
    """One rank of a 2-rank torchrun-style job alone: the init times out and the rank fails
    (with mccl, whose exit handler ends a process whose rendezvous still runs, it exited 0)."""
    with socket.socket() as sock:  # a port no peer listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = clean_environ(
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}
        | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    args = small_args("parallel.init_timeout=5", "run.steps=2")
    command = [sys.executable, "-m", "hyperparallel", "--output", str(tmp_path / "out"), *args]
    done = childproc.run(command, timeout=120, env=env, check=False)
    assert done.returncode == 1, done.stderr[-3000:]
    # with mccl installed the background init times out; without it, torch's own rendezvous
    assert any(error in done.stderr for error in ("InitTimeoutError", "DistStoreError"))


def test_a_kill_while_writing_a_checkpoint_leaves_the_previous_one_resumable(tmp_path) -> None:
    args = small_args("run.steps=40", "checkpoint.every=1", "checkpoint.keep=2")
    caught = None
    for attempt in range(5):
        out = tmp_path / f"run{attempt}"  # a fresh output each attempt
        proc = start_train(out, *args)
        deadline = time.monotonic() + 180
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    pending = list((out / "checkpoints").glob(".tmp-step_*/*.distcp"))
                except FileNotFoundError:  # the folder was renamed as it was listed
                    continue
                if pending and checkpoint.complete(out):
                    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks
                    caught = pending[0].parent.name
                    break
                time.sleep(0.001)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        if caught and (out / "checkpoints" / caught).exists():
            break  # killed while that checkpoint was being written
        caught = None
    assert caught, "never caught a checkpoint mid-write in 5 attempts"
    survivors = checkpoint.complete(out)
    assert survivors, "the previous complete checkpoint is gone"
    newest = json.loads((survivors[-1] / "meta.json").read_text())["step"]
    assert newest < int(caught.split("_")[1])
    stop = min(40, newest + 2)
    resumed = [*args, "--set", f"run.stop_at={stop}"]
    run_train("--nproc", "2", "--output", str(out), "--resume", *resumed)
    assert max(losses(out)) == stop
    assert not list((out / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_stops_every_rank_and_names_the_checkpoint_to_resume(tmp_path, sig) -> None:
    """Ctrl-C (SIGINT to the whole process group) or SIGTERM to the launcher alone."""
    out = tmp_path / "run"
    args = small_args("run.steps=100000", "checkpoint.every=2", "checkpoint.export=false")
    proc = start_train(out, *args, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while not checkpoint.complete(out) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert checkpoint.complete(out), "no checkpoint within 180 s"
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 128 + sig
    assert "Traceback" not in err
    newest = checkpoint.complete(out)[-1]
    assert f"interrupted by {sig.name}; the ranks were stopped" in err
    assert f"Newest complete checkpoint: {newest} (continue with --resume)" in err


def _ranks_of(launcher: int) -> list[int]:
    """The pids of the rank processes ``launcher`` started (multiprocessing's spawned children;
    not its resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):  # gone, or not a process
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == launcher and b"spawn_main" in command:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie has ended: an orphan's new parent may never reap it)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc; PR_SET_PDEATHSIG is Linux's")
def test_ranks_end_with_a_killed_launcher_and_the_output_is_free(tmp_path) -> None:
    """The launcher holds the output's lock; SIGKILL (OOM killer, kill -9, a scheduler) lets
    it go at once. Killed while its ranks start (before torch's spawn asks for a signal on the
    parent's death), the ranks outlived it for parallel.init_timeout (300 s)."""
    out = tmp_path / "run"
    args = small_args("run.steps=100000", "checkpoint.export=false")
    proc = start_train(out, *args)
    try:
        deadline = time.monotonic() + 120
        while len(ranks := _ranks_of(proc.pid)) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, "spore train ended before starting its ranks"
            time.sleep(0.01)
        assert len(ranks) == 2, "the ranks did not start within 120 s"
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60  # a rank notices once it has imported torch
        while any(map(_alive, ranks)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, ranks)), "the ranks outlived their launcher"
        with launch.hold_output(str(out)):  # what the next run takes first (or OutputBusy)
            pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the ranks keep the launcher's group
        proc.wait(timeout=30)


RANK = """
import signal, sys, time
from hyperparallel.launch import end_with_launcher
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a rank stopping after a first Ctrl-C
end_with_launcher(int(sys.argv[1]))
print("ready", flush=True)
time.sleep(120)
"""
"""A rank's stand-in: ends with its launcher (argv[1]), then sleeps."""

LAUNCHER = """
import os, subprocess, sys
command = [sys.executable, "-c", sys.argv[1], str(os.getpid())]
rank = subprocess.Popen(command, stdout=subprocess.PIPE)
assert rank.stdout.readline() == b"ready\\n"
print(rank.pid, flush=True)
rank.wait()
"""
"""A launcher's stand-in: starts RANK (argv[1]), prints its pid once it is tied, waits."""


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_rank_ignoring_sigint_ends_with_its_killed_launcher() -> None:
    """torch's spawn asks for SIGINT on the launcher's death, which a rank may ignore."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, RANK],
        stdout=subprocess.PIPE,
        env=clean_environ(),
        start_new_session=True,
    )
    try:
        assert select.select([proc.stdout], [], [], 60)[0], "no rank within 60 s"
        line = proc.stdout.readline()
        assert line.strip().isdigit(), f"the launcher's stand-in failed: {line!r}"
        rank = int(line)
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 5
        while _alive(rank) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(rank), "the rank outlived its launcher"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_a_rank_killed_by_a_signal_is_named(tmp_path) -> None:
    """A rank the OOM killer (SIGKILL) ended left nothing above "see the error above"."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    missing = str(tmp_path / "no-error-file.json")
    failures = {
        1: ProcessFailure(local_rank=1, pid=11, exitcode=-signal.SIGKILL, error_file=missing),
        0: ProcessFailure(local_rank=0, pid=10, exitcode=-signal.SIGTERM, error_file=missing),
        2: ProcessFailure(local_rank=2, pid=12, exitcode=1, error_file=missing),  # a traceback
    }
    assert launch._failure_lines(failures) == [
        "error: rank 0 was killed by SIGTERM",
        "error: rank 1 was killed by SIGKILL (the kernel's out-of-memory killer sends it)",
    ]


def test_each_distinct_traceback_is_printed_once_under_its_ranks(tmp_path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    def failed(rank: int, message: str) -> ProcessFailure:
        error_file = tmp_path / f"error-{rank}.json"
        error_file.write_text(json.dumps({"message": message, "timestamp": 1}))
        return ProcessFailure(
            local_rank=rank, pid=10 + rank, exitcode=1, error_file=str(error_file)
        )

    same = f"{launch.TRACEBACK}\n  ...\nValueError: same on both\n"
    other = f"{launch.TRACEBACK}\n  ...\nKeyError: 'only rank 2'\n"
    failures = {2: failed(2, other), 1: failed(1, same), 0: failed(0, same)}
    assert launch._failure_lines(failures) == [
        f"rank(s) 0, 1 raised:\n{same.rstrip()}",
        f"rank(s) 2 raised:\n{other.rstrip()}",
    ]


def test_a_traceback_handed_over_by_a_rank_torch_does_not_report_is_printed(tmp_path) -> None:
    """torch's ChildFailedError holds only the first rank to fail; another rank that raised
    (before torch stopped it) wrote its traceback to its error file and printed nothing."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    attempt = tmp_path / "spore-train-1234_abcd" / "attempt_0"
    messages = {r: f"{launch.TRACEBACK}\n  ...\nValueError: only rank {r}\n" for r in (0, 1)}
    for rank, message in messages.items():
        (attempt / str(rank)).mkdir(parents=True)
        (attempt / str(rank) / "error.json").write_text(json.dumps({"message": message}))
    (attempt / "2").mkdir()  # a rank that handed nothing over (stopped by torch)
    first = {
        0: ProcessFailure(
            local_rank=0, pid=10, exitcode=1, error_file=str(attempt / "0" / "error.json")
        )
    }
    failures = launch._with_handed_over(first, tmp_path)
    assert sorted(failures) == [0, 1]
    assert failures[0] is first[0]
    assert launch._failure_lines(failures) == [
        f"rank(s) {r} raised:\n{messages[r].rstrip()}" for r in (0, 1)
    ]


def test_failures_in_a_rank_are_reported_once_and_plainly(tmp_path) -> None:
    data_file = tmp_path / "data.jsonl"
    data_file.write_text('{"text": "fine"}\nnot json\n')
    bad_data = run_train(
        "--nproc",
        "2",
        "--output",
        str(tmp_path / "a"),
        "--set",
        f"data.path={data_file}",
        check=False,
    )
    assert bad_data.returncode == 1
    assert bad_data.stderr.count(f"error: {data_file}:2: invalid JSON") == 1  # both ranks hit it
    assert "Traceback" not in bad_data.stderr
    assert "training failed on rank(s) " in bad_data.stderr
    # the resume hint, naming the output: a resume from elsewhere has a checkpoint there
    assert f"No checkpoint in {tmp_path / 'a'} was complete yet." in bad_data.stderr
    # settings transformers builds a model of, whose forward then fails (preflight builds the
    # model but runs nothing): an unexpected error in the rank, shown with its traceback
    unexpected = run_train(
        "--nproc",
        "2",
        "--output",
        str(tmp_path / "b"),
        "--set",
        "model.config.head_dim=3",  # odd: the rotary tables have 4 columns
        check=False,
    )
    assert unexpected.returncode == 1
    assert unexpected.stderr.count("Traceback") == 1  # both ranks raise it: printed once
    assert re.search(r"^rank\(s\) [01](, 1)? raised:\nTraceback", unexpected.stderr, re.M)
    assert "RuntimeError: The size of tensor a (3) must match" in unexpected.stderr


def test_a_grad_clip_of_zero_leaves_the_gradients_as_they_are() -> None:
    """optim.grad_clip=0 ("disables") in the benchmark's plain loop, which called
    clip_grad_norm_(params, 0): every gradient became zero. Both loops clip with this."""
    from hyperparallel import plain_loop
    from hyperparallel.train import clipped_grad_norm

    assert plain_loop.clipped_grad_norm is clipped_grad_norm

    net = torch.nn.Linear(3, 2)
    net(torch.ones(1, 3)).sum().backward()
    before = [p.grad.clone() for p in net.parameters()]

    def norm(grads):
        return float(torch.cat([g.flatten() for g in grads]).norm())

    assert clipped_grad_norm(net, 0.0) == pytest.approx(norm(before))
    for p, g in zip(net.parameters(), before, strict=True):
        torch.testing.assert_close(p.grad, g)
    assert clipped_grad_norm(net, 0.1) == pytest.approx(norm(before))  # the norm before
    assert norm(p.grad for p in net.parameters()) == pytest.approx(0.1, rel=1e-4)
