"""Real ``spore train`` runs: gloo ranks in child processes, each with a hard timeout."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import time

import pytest
from train_helpers import losses, run_train, small_args, spore_command

from hyperparallel import checkpoint


def test_two_ranks_learn_and_write_every_output(tmp_path) -> None:
    out = tmp_path / "run"
    done = run_train(
        "--nproc", "2", "--output", str(out), *small_args("run.steps=60", "optim.lr=0.01")
    )
    curve = losses(out)
    assert sorted(curve) == list(range(1, 61))
    first, last = (
        statistics.fmean(curve[s] for s in range(1, 6)),
        statistics.fmean(curve[s] for s in range(56, 61)),
    )
    assert last < 0.6 * first, f"loss did not fall clearly: {first:.3f} -> {last:.3f}"
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "steps: 60" in (out / "config.yaml").read_text()
    assert [p.name for p in checkpoint.complete(out)] == ["step_00000060"]
    assert (out / "final" / "config.json").is_file()
    assert "spore train: summary" in done.stdout
    assert "2 rank(s), FSDP2" in done.stdout
    assert done.stdout.count("spore train: summary") == 1  # rank 0 only


def test_two_ranks_match_one_process_on_the_same_global_batch(tmp_path) -> None:
    """The oracle: FSDP2 over 2 ranks = 1 rank with the whole global batch.

    The small model's vocabulary (259 rows) and intermediate size (171) are odd, so FSDP2
    shards those parameters unevenly over the 2 ranks.
    """
    one, two = tmp_path / "one", tmp_path / "two"
    common = ("run.steps=6", "checkpoint.export=false", "checkpoint.every=0")
    run_train("--nproc", "1", "--output", str(one), *small_args(*common, "data.batch_size=8"))
    run_train("--nproc", "2", "--output", str(two), *small_args(*common, "data.batch_size=4"))
    a, b = losses(one), losses(two)
    assert a.keys() == b.keys()
    for step in a:
        assert abs(a[step] - b[step]) < 1e-4, (step, a[step], b[step])


def test_resume_continues_bitwise(tmp_path) -> None:
    full, part = tmp_path / "full", tmp_path / "part"
    common = ("run.steps=10", "checkpoint.every=3", "checkpoint.export=false")
    run_train("--nproc", "2", "--output", str(full), *small_args(*common))
    run_train("--nproc", "2", "--output", str(part), *small_args(*common, "run.stop_at=5"))
    assert [p.name for p in checkpoint.complete(part)] == ["step_00000003", "step_00000005"]
    assert max(losses(part)) == 5
    run_train("--nproc", "2", "--output", str(part), "--resume", *small_args(*common))
    a, b = losses(full), losses(part)
    assert sorted(b) == list(range(1, 11))
    assert [b[s] for s in range(6, 11)] == [a[s] for s in range(6, 11)]  # bitwise


def test_one_rank_trains_unsharded_and_resumes_bitwise(tmp_path) -> None:
    full, part = tmp_path / "full", tmp_path / "part"
    common = ("run.steps=6", "checkpoint.every=3", "checkpoint.export=false")
    done = run_train("--output", str(full), *small_args(*common))
    assert "1 rank, unsharded" in done.stdout
    run_train("--output", str(part), *small_args(*common, "run.stop_at=3"))
    run_train("--output", str(part), "--resume", *small_args(*common))
    a, b = losses(full), losses(part)
    assert [b[s] for s in range(4, 7)] == [a[s] for s in range(4, 7)]  # bitwise


def test_a_kill_while_writing_a_checkpoint_leaves_the_previous_one_resumable(tmp_path) -> None:
    args = small_args("run.steps=40", "checkpoint.every=1", "checkpoint.keep=2")
    caught = None
    for attempt in range(5):
        out = tmp_path / f"run{attempt}"  # a fresh output each attempt
        proc = subprocess.Popen(
            spore_command("--nproc", "2", "--output", str(out), *args),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 180
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                pending = list((out / "checkpoints").glob(".tmp-step_*/*.distcp"))
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
    newest = survivors[-1]
    assert json.loads((newest / "meta.json").read_text())["step"] < int(caught.split("_")[1])
    run_train("--nproc", "2", "--output", str(out), "--resume", *args)
    assert max(losses(out)) == 40
    assert not list((out / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_stops_every_rank_and_names_the_checkpoint_to_resume(tmp_path, sig) -> None:
    """Ctrl-C (SIGINT to the whole process group) or SIGTERM to the launcher alone."""
    out = tmp_path / "run"
    args = small_args("run.steps=100000", "checkpoint.every=2", "checkpoint.export=false")
    proc = subprocess.Popen(
        spore_command("--nproc", "2", "--output", str(out), *args),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
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


def test_hsdp_runs_and_matches_fsdp(tmp_path) -> None:
    hsdp, fsdp = tmp_path / "hsdp", tmp_path / "fsdp"
    common = ("run.steps=4", "checkpoint.export=false", "checkpoint.every=0", "data.batch_size=2")
    done = run_train(
        "--nproc", "4", "--output", str(hsdp), *small_args(*common, "parallel.replicate=2")
    )
    assert "HSDP 2 x 2" in done.stdout
    run_train("--nproc", "4", "--output", str(fsdp), *small_args(*common))
    a, b = losses(hsdp), losses(fsdp)
    for step in a:
        assert abs(a[step] - b[step]) < 1e-4, (step, a[step], b[step])


def test_export_is_a_pretrained_directory_that_trains_on(tmp_path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    run_train("--output", str(first), *small_args("run.steps=40", "optim.lr=0.01"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(first / "final", local_files_only=True)
    assert model.config.vocab_size == 259
    assert model.config.intermediate_size == 171
    start = losses(first)
    run_train(
        "--output",
        str(second),
        *small_args(
            "run.steps=2", "schedule.warmup_steps=0", f"model.pretrained={first / 'final'}"
        ),
    )
    again = losses(second)
    assert again[1] < start[1] * 0.7, "the exported weights did not carry the training"
    assert abs(again[1] - start[40]) < 0.5


def test_plugin_contract(spore_plugin_contract) -> None:
    info = spore_plugin_contract("hyperparallel")
    assert "train" in info.registered["commands"]


def test_joins_a_torchrun_job(tmp_path) -> None:
    """Started by torchrun, each process is one rank of that job (multi-node runs work alike)."""
    import shutil
    import sys
    from pathlib import Path

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torch installs the torchrun script next to the interpreter"
    out = tmp_path / "run"
    args = small_args("run.steps=3", "checkpoint.export=false", "parallel.replicate=2")
    done = subprocess.run(
        [
            torchrun,
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "hyperparallel",
            "--output",
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(losses(out)) == [1, 2, 3]
    assert "HSDP 2 x 1" in done.stdout


def test_activation_checkpointing_resharding_and_accumulation_match_the_plain_run(
    tmp_path,
) -> None:
    """Over FSDP2 (2 ranks): recomputing each layer, or keeping its gathered parameters for
    backward, changes nothing; 2 micro-batches of 2 = 1 batch of 4 per rank."""
    runs = {
        "plain": (),
        "ac": ("parallel.activation_checkpointing=true",),
        "kept": ("parallel.reshard_after_forward=false",),
        "accum": ("data.batch_size=2", "optim.grad_accum=2"),
    }
    common = ("run.steps=5", "checkpoint.export=false", "checkpoint.every=0", "data.batch_size=4")
    for name, extra in runs.items():
        out = tmp_path / name
        run_train("--nproc", "2", "--output", str(out), *small_args(*common, *extra))
    got = {name: losses(tmp_path / name) for name in runs}
    assert got["ac"] == got["plain"]  # bitwise: the recomputed forward is the same computation
    assert got["kept"] == got["plain"]  # bitwise: the same parameters, gathered once
    for step, loss in got["plain"].items():
        assert abs(got["accum"][step] - loss) < 1e-4, (step, loss, got["accum"][step])


def test_bf16_mixed_precision_trains_close_to_fp32(tmp_path) -> None:
    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    common = ("run.steps=20", "checkpoint.export=false", "checkpoint.every=0", "optim.lr=0.01")
    run_train("--nproc", "2", "--output", str(fp32), *small_args(*common))
    run_train(
        "--nproc",
        "2",
        "--output",
        str(bf16),
        *small_args(*common, "parallel.mixed_precision=bf16"),
    )
    a, b = losses(fp32), losses(bf16)
    assert a != b  # bf16 compute really ran
    assert abs(a[20] - b[20]) < 0.1 * a[20]
    assert b[20] < 0.7 * b[1]


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
    unexpected = run_train(
        "--output", str(tmp_path / "b"), "--set", "optim.options.foo=1", check=False
    )
    assert unexpected.returncode == 1
    assert unexpected.stderr.count("Traceback") == 1  # the rank's own, not the launcher's copy
    assert "unexpected keyword argument 'foo'" in unexpected.stderr
