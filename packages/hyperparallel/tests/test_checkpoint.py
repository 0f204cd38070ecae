"""Checkpoint saves and loads leave the training process's threads as they found them.

DCP's object collectives run on gloo's worker threads; a large enough plan makes ATen open an
OpenMP parallel region there, and that thread keeps a second libgomp team, which throttles the
busy-wait of the training thread's team for the rest of the run (see
``hyperparallel.checkpoint._collectives``). Asserted here on the threads themselves, in this
process, over a real one-rank gloo group.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from transformers import LlamaConfig, LlamaForCausalLM

from hyperparallel import checkpoint

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads this process's threads from /proc"
)


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _settled(expected: set[str], within: float = 5.0) -> set[str]:
    """This process's threads once they equal ``expected``, or as they are after ``within`` s.

    libgomp's team threads are detached: they leave ``/proc/self/task`` a moment after the
    thread that owned the team has been joined, so a just-ended team may still be listed.
    """
    deadline = time.monotonic() + within
    while (now := _threads()) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return now


@pytest.fixture
def one_rank(tmp_path) -> Iterator[None]:
    """A one-rank gloo process group, and two intra-op threads (so that a team can form)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'store'}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def _trained_state() -> checkpoint.TrainState:
    """The default model's shape, one AdamW step taken (so the optimizer has state)."""
    config = LlamaConfig(
        vocab_size=259,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, config.vocab_size, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return checkpoint.TrainState(model, optimizer)


def test_save_and_load_leave_no_thread_behind(one_rank, tmp_path) -> None:
    state = _trained_state()
    before = _threads()
    saved = checkpoint.save(tmp_path / "run", 1, state, {"step": 1}, keep=1)
    assert _settled(before) == before, "checkpoint.save left threads running (an OpenMP team?)"
    assert checkpoint.load(saved, state) == {"step": 1}
    assert _settled(before) == before, "checkpoint.load left threads running (an OpenMP team?)"
    assert torch.get_num_threads() == 2

    # The cause, shown on this same state: DCP over the training group leaves a thread behind.
    # If this stops holding, torch no longer copies on gloo's thread and _collectives can go.
    dcp.save({"train": state}, checkpoint_id=str(tmp_path / "plain"))
    assert len(_threads() - before) >= 1, "DCP over the training group left no thread"


def _small_state() -> checkpoint.TrainState:
    model = torch.nn.Linear(4, 3)
    return checkpoint.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_branch_from_an_older_checkpoint_is_what_resume_finds_and_keep_keeps(
    one_rank, tmp_path
) -> None:
    """Resumed from step 1 of steps 1-3, the new step 2 is the newest, not the old step 3."""
    out, state = tmp_path / "run", _small_state()
    for step in (1, 2, 3):
        checkpoint.save(out, step, state, {"step": step, "branch": "first"}, keep=3)
    assert checkpoint.find(out).name == "step_00000003"
    saved = checkpoint.save(out, 2, state, {"step": 2, "branch": "second"}, keep=2)
    assert [p.name for p in checkpoint.complete(out)] == ["step_00000003", "step_00000002"]
    assert checkpoint.find(out) == saved
    assert checkpoint.load(checkpoint.find(out), state) == {"step": 2, "branch": "second"}
    assert checkpoint.newer_than(out, checkpoint.directory(out) / "step_00000003") == [saved]
    checkpoint.save(out, 3, state, {"step": 3, "branch": "second"}, keep=1)
    assert [p.name for p in checkpoint.complete(out)] == ["step_00000003"]
    assert checkpoint.load(checkpoint.find(out), state)["branch"] == "second"
    assert not list(checkpoint.directory(out).glob(".*")), "no temporary directory is left"


def test_a_damaged_checkpoint_names_the_one_it_descends_from_not_an_abandoned_one(
    one_rank, tmp_path
) -> None:
    """Resumed from step 2 of steps 2 and 4 with checkpoint.every=5, a damaged step 5 named
    step 4, the abandoned branch's, as the older checkpoint to resume from (the highest lower
    step); meta.json now names the checkpoint each save descends from."""
    out, state = tmp_path / "run", _small_state()
    two = checkpoint.save(out, 2, state, {"step": 2}, keep=3)
    checkpoint.save(out, 4, state, {"step": 4}, keep=3, parent=two)
    five = checkpoint.save(out, 5, state, {"step": 5}, keep=3, parent=two)
    assert checkpoint.instead(five) == f"resume from an older checkpoint with --resume {two}"
    meta = json.loads((five / "meta.json").read_text())
    assert meta["parent"] == "step_00000002"
    assert json.loads((two / "meta.json").read_text())["parent"] is None  # a new run's first
    assert meta["ancestors"] == [{"name": "step_00000002", "save": 1}]
    del meta["parent"], meta["ancestors"]  # saved before meta.json named them: the newest of a
    (five / "meta.json").write_text(json.dumps(meta))  # lower step
    assert checkpoint.instead(five).endswith("--resume " + str(out / "checkpoints/step_00000004"))
    ancestors = {"ancestors": [{"name": two.name, "save": 1}]}
    checkpoint.save(out, 2, state, {"step": 2}, keep=4)  # a later run's step 2: not its parent
    for only in ({"parent": two.name}, ancestors):  # saved before meta.json listed ancestors
        (five / "meta.json").write_text(json.dumps({**meta, **only}))
        assert checkpoint.instead(five) == "start the run again without --resume"
    elsewhere = checkpoint.save(tmp_path / "other", 6, state, {"step": 6}, keep=1, parent=five)
    assert json.loads((elsewhere / "meta.json").read_text())["parent"] is None


def _ancestor_names(saved: Path) -> list[str]:
    return [a["name"] for a in json.loads((saved / "meta.json").read_text())["ancestors"]]


def test_a_damaged_checkpoint_names_an_ancestor_when_its_parent_is_gone(one_rank, tmp_path) -> None:
    """Saves 1, 2, 3, then a branch resumed from step 1 replacing step 2: a damaged step 3 said
    to start again (its parent, step 2, was gone) though step 1, its grandparent, was complete.
    meta.json now lists the ancestors, newest first, at most checkpoint.keep of them."""
    out, state = tmp_path / "run", _small_state()
    one = checkpoint.save(out, 1, state, {"step": 1}, keep=2)
    two = checkpoint.save(out, 2, state, {"step": 2}, keep=3, parent=one)
    three = checkpoint.save(out, 3, state, {"step": 3}, keep=3, parent=two)
    checkpoint.save(out, 2, state, {"step": 2, "branch": "second"}, keep=3, parent=one)
    assert checkpoint.instead(three) == f"resume from an older checkpoint with --resume {one}"
    meta = json.loads((three / "meta.json").read_text())
    assert meta["ancestors"] == [{"name": two.name, "save": 2}, {"name": one.name, "save": 1}]
    assert _ancestor_names(checkpoint.save(out, 4, state, {"step": 4}, keep=5, parent=three)) == [
        three.name,
        two.name,
        one.name,
    ]
    (three / "meta.json").write_text(json.dumps({"step": 3, "save": 3, "parent": two.name}))
    assert _ancestor_names(checkpoint.save(out, 4, state, {"step": 4}, keep=5, parent=three)) == [
        three.name  # its parent's meta.json, saved before they were listed, lists none
    ]
    assert _ancestor_names(checkpoint.save(out, 5, state, {"step": 5}, keep=1, parent=three)) == [
        three.name
    ]


def test_resume_finds_a_runs_own_checkpoints_not_those_of_a_run_above_it(
    one_rank, tmp_path
) -> None:
    """An output nested in another run's output has no checkpoint of its own: resuming it must
    not continue the outer run."""
    outer, state = tmp_path / "outer", _small_state()
    saved = checkpoint.save(outer, 12, state, {"step": 12}, keep=1)
    (outer / "inner").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint in .*inner"):
        checkpoint.find(outer / "inner")
    assert checkpoint.find(outer) == saved
    assert checkpoint.find(checkpoint.directory(outer)) == saved  # the checkpoints folder too
    assert checkpoint.find(saved) == saved


def test_resuming_a_path_that_does_not_exist_says_so(tmp_path) -> None:
    """It said there was no complete checkpoint in it, as if the folder were there."""
    with pytest.raises(FileNotFoundError, match=r"nope does not exist; train without --resume"):
        checkpoint.find(tmp_path / "nope")


def test_the_damaged_checkpoints_find_passed_over_are_named_however_the_output_is_given(
    tmp_path, monkeypatch
) -> None:
    """``--resume PATH`` of an output passed over a damaged newer checkpoint without the note
    ``--resume`` (the run's own output) prints."""
    out = tmp_path / "run"
    older, damaged = (checkpoint.directory(out) / f"step_{s:08d}" for s in (2, 4))
    damaged.mkdir(parents=True)  # no meta.json
    older.mkdir()
    (older / "meta.json").write_text('{"step": 2, "save": 1, "world_size": 1}')
    for target in (out, str(out), checkpoint.directory(out)):
        assert checkpoint.find(target) == older
        assert checkpoint.skipped(target, older) == [damaged]
    assert checkpoint.skipped(older, older) == []  # the checkpoint itself: nothing passed over
    monkeypatch.chdir(checkpoint.directory(out))  # a path relative to the checkpoints folder
    assert checkpoint.find(older.name) == older  # absolute: its output is .parent.parent
    assert checkpoint.skipped(older.name, older) == []


@pytest.mark.parametrize(
    "meta",
    ["{}", '{"save": 3}', '{"step": "2"}', "[2]", '{"step": true}', '{"step": 2, "save": false}'],
)
def test_a_meta_json_naming_no_step_is_damaged(tmp_path, meta: str) -> None:
    """A meta.json of ``{}`` counted as a complete checkpoint, the first save (0, the number of
    those saved before saves were numbered): passed over without a note, removed first."""
    out = tmp_path / "run"
    older, damaged = (checkpoint.directory(out) / f"step_{s:08d}" for s in (1, 2))
    older.mkdir(parents=True)
    damaged.mkdir()
    (older / "meta.json").write_text('{"step": 1, "world_size": 1}')  # saved before numbering
    (damaged / "meta.json").write_text(meta)
    assert checkpoint.complete(out) == [older]
    assert checkpoint.unreadable(out) == [damaged]


def test_a_save_killed_while_replacing_a_step_loses_nothing(one_rank, tmp_path) -> None:
    """Killed between moving the old step_N aside and renaming the new one into place: the
    old one is put back by the next resume (or save), not deleted as stale, also by a resume
    naming it."""
    out, state = tmp_path / "run", _small_state()
    saved = checkpoint.save(out, 2, state, {"step": 2}, keep=2)
    os.replace(saved, saved.parent / ".old-step_00000002")  # where the kill left it
    assert checkpoint.complete(out) == []
    assert checkpoint.find(out) == saved
    assert checkpoint.load(saved, state) == {"step": 2}
    os.replace(saved, saved.parent / ".old-step_00000002")
    assert checkpoint.find(saved) == saved  # --resume naming it: "does not exist"
    (saved / "meta.json").write_text("{not json")  # unreadable: not complete, no exception
    assert checkpoint.complete(out) == []
    assert checkpoint.extras(saved) == {"step": 2}
    assert checkpoint.data_layout({"step": 2}) is None  # this trainer.pt holds no sampler state


_WRITES = frozenset({"os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree"})
_interrupt: dict[str, Any] = {"at": None, "seen": 0, "hooked": False}


def _interrupt_at_a_write(event: str, args: tuple[Any, ...]) -> None:
    """An audit hook: raise KeyboardInterrupt (as Ctrl-C's handler does, in the main thread)
    just before the ``_interrupt["at"]``-th change to the file system since it was set."""
    if _interrupt["at"] is None or threading.current_thread() is not threading.main_thread():
        return
    writes = event == "open" and isinstance(args[2], int) and args[2] & (os.O_WRONLY | os.O_RDWR)
    if event in _WRITES or writes:
        _interrupt["seen"] += 1
        if _interrupt["seen"] == _interrupt["at"]:
            raise KeyboardInterrupt


def _stopped_at(at: int, call: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """``call(*args, **kwargs)`` interrupted before its ``at``-th change to the file system;
    whether it ran to the end instead (it makes fewer)."""
    if not _interrupt["hooked"]:  # an audit hook stays for the session: idle when not set
        sys.addaudithook(_interrupt_at_a_write)
        _interrupt["hooked"] = True
    _interrupt.update(at=at, seen=0)
    try:
        call(*args, **kwargs)
    except (KeyboardInterrupt, CheckpointException):  # DCP gathers it into its own
        return False
    finally:
        _interrupt["at"] = None
    return True


@pytest.mark.parametrize("replace", [False, True], ids=["prune", "replace"])
def test_ctrl_c_anywhere_in_a_save_loses_no_checkpoint_and_leaves_none_half_there(
    one_rank, tmp_path, replace: bool
) -> None:
    """Ctrl-C before each change a save makes to the file system in turn. While it deleted the
    oldest checkpoint beyond checkpoint.keep, it left a step_N whose meta.json was still there
    and some of its files gone: complete to --resume PATH, keep and the error naming an older
    checkpoint, and failing to load. A save that replaces a step (a branch resumed from step 1
    saving step 2 again) keeps its old checkpoint until the new one is in place."""
    state, before = _small_state(), tmp_path / "before"
    first = checkpoint.save(before, 1, state, {"step": 1}, keep=2)
    if replace:
        checkpoint.save(before, 2, state, {"step": 2}, keep=2, parent=first)
    at, finished = 0, False
    while not finished:
        at += 1
        out = tmp_path / f"stopped_{at}"
        shutil.copytree(before, out)
        parent = out / "checkpoints" / first.name if replace else None
        keep = 2 if replace else 1
        finished = _stopped_at(
            at, checkpoint.save, out, 2, state, {"step": 2}, keep=keep, parent=parent
        )
        steps = [checkpoint.load(p, state)["step"] for p in checkpoint.complete(out)]
        assert steps in ([1], [1, 2], [2]), f"stopped at change {at}: {steps}"
        if replace:  # step_2's old checkpoint (moved aside) or its new one
            assert checkpoint.find(out) == out / "checkpoints" / "step_00000002"
            assert [checkpoint.load(p, state)["step"] for p in checkpoint.complete(out)] == [1, 2]
        checkpoint.save(out, 3, state, {"step": 3}, keep=2)  # the next save clears up
        assert not list(checkpoint.directory(out).glob(".*")), f"stopped at change {at}"
    assert at > 10  # stopped at each change of the save, and then not


def _filled(fill: float) -> LlamaForCausalLM:
    """A tiny llama whose ``lm_head`` weights (tied to the embedding) all hold ``fill``."""
    sizes = {"hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=259, num_hidden_layers=1, **sizes))
    with torch.no_grad():
        model.lm_head.weight.fill_(fill)
    return model


def _a_checkpoint(tmp_path: Path) -> Path:
    """A checkpoint (of another model) for an export to name as the one it was made from."""
    return checkpoint.save(tmp_path / "source", 1, _small_state(), {"step": 1}, keep=1)


def _exported_fill(final: Path) -> float:
    from transformers import AutoModelForCausalLM

    return float(AutoModelForCausalLM.from_pretrained(final).lm_head.weight.detach()[0, 0])


def test_ctrl_c_anywhere_in_an_export_leaves_no_older_weights(one_rank, tmp_path) -> None:
    """Ctrl-C before each change an export of newer weights makes to the file system in turn.
    The export put a previous final/ it had moved aside back, and had left the previous one in
    place until the new one was written: either way a final/ of older weights, which a resume
    that trains nothing keeps instead of exporting again. Now final/ is the new export or none,
    and the next export (or checkpoint save) deletes what the stopped one left."""
    before, made = tmp_path / "before", _a_checkpoint(tmp_path)
    checkpoint.export(_filled(1.0), before, made)
    at, finished = 0, False
    while not finished:
        at += 1
        out = tmp_path / f"stopped_{at}"
        shutil.copytree(before, out)
        finished = _stopped_at(at, checkpoint.export, _filled(2.0), out, made)
        if (out / "final").exists():  # the older one only if stopped before its first rename
            assert _exported_fill(out / "final") == (1.0 if at <= 2 else 2.0), f"change {at}"
        saved = tmp_path / f"saved_{at}"
        shutil.copytree(out, saved)
        checkpoint.save(saved, 1, _small_state(), {"step": 1}, keep=1)
        left = {p.name for p in saved.iterdir()} - {"checkpoints"}
        assert left == {"final"} & {p.name for p in out.iterdir()}, f"stopped at change {at}"
        checkpoint.export(_filled(3.0), out, made)
        assert sorted(p.name for p in out.iterdir()) == ["final"], f"stopped at change {at}"
        assert _exported_fill(out / "final") == 3.0
    assert at > 5  # stopped at each change of the export, and then not


def test_an_export_replaces_a_final_link_not_what_it_points_to(one_rank, tmp_path) -> None:
    """A final/ that was a link to a folder: the second export failed deleting it (rmtree
    refuses a link)."""
    elsewhere, made = tmp_path / "elsewhere", _a_checkpoint(tmp_path)
    checkpoint.export(_filled(1.0), elsewhere, made)
    out = tmp_path / "run"
    out.mkdir()
    (out / "final").symlink_to(elsewhere / "final", target_is_directory=True)
    checkpoint.export(_filled(2.0), out, made)
    assert not (out / "final").is_symlink()
    assert _exported_fill(out / "final") == 2.0
    assert _exported_fill(elsewhere / "final") == 1.0
    assert sorted(p.name for p in out.iterdir()) == ["final"]


def test_a_load_silences_only_dcps_root_records(caplog: pytest.LogCaptureFixture) -> None:
    """DCP logs each file it cannot read on the root logger with its traceback; the load's
    filter dropped every root record, the program's own (or another thread's) too."""
    in_dcp = os.path.join(os.path.dirname(dcp.__file__), "state_dict_loader.py")
    root = logging.getLogger()
    with checkpoint._root_records_off():
        root.handle(root.makeRecord("root", logging.ERROR, in_dcp, 1, "dcp's", (), None))
        root.warning("the program's")
    root.handle(root.makeRecord("root", logging.ERROR, in_dcp, 1, "after", (), None))
    assert caplog.messages == ["the program's", "after"]


def test_a_missing_rng_file_is_damage_and_the_only_checkpoint_says_start_again(
    one_rank, tmp_path
) -> None:
    """A missing rng_rank*.pt was skipped, and the resume drew other random numbers (dropout)
    with no word; with no older checkpoint, the hint read "... with start the run again"."""
    out, state = tmp_path / "run", _small_state()
    saved = checkpoint.save(out, 1, state, {"step": 1}, keep=1)
    (saved / "rng_rank00000.pt").unlink()
    with pytest.raises(checkpoint.Unreadable, match=r"rng_rank00000\.pt") as info:
        checkpoint.load(saved, state)
    assert "; start the run again without --resume, or delete step_00000001" in str(info.value)


def test_a_load_into_other_settings_is_not_called_damage(one_rank, tmp_path) -> None:
    """Whole files that do not fit this run's model (untied embeddings here, which preflight
    refuses before any rank starts) were reported as damage, with the advice to delete the
    checkpoint; a shard cut short still is damage."""
    out, state = tmp_path / "run", _trained_state()
    saved = checkpoint.save(out, 1, state, {"step": 1}, keep=1)
    model = LlamaForCausalLM(
        LlamaConfig(**{**state.model.config.to_dict(), "tie_word_embeddings": False})
    )
    untied = checkpoint.TrainState(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(checkpoint.Unreadable) as info:
        checkpoint.load(saved, untied)
    message = str(info.value)
    assert "lm_head.weight" in message
    assert "its files are all there, so this run's model or optimizer settings likely" in message
    assert "delete" not in message
    (shard,) = saved.glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(checkpoint.Unreadable, match="damaged or incomplete") as info:
        checkpoint.load(saved, untied)
    assert str(info.value).endswith("or delete step_00000001")


def test_ctrl_c_during_a_load_is_an_interrupt_not_damage(one_rank, tmp_path, monkeypatch) -> None:
    """DCP gathers a rank's KeyboardInterrupt into its CheckpointException, which the load
    reported as a damaged checkpoint to delete."""
    out, state = tmp_path / "run", _small_state()
    saved = checkpoint.save(out, 1, state, {"step": 1}, keep=1)

    def interrupted(*args, **kwargs):
        raise CheckpointException("load", {0: (KeyboardInterrupt(), None)})

    monkeypatch.setattr(dcp, "load", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.load(saved, state)
