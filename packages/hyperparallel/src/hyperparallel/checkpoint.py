"""Checkpoints with torch.distributed.checkpoint, written so a crash never costs the last one.

Layout under ``<output>/checkpoints``: ``step_00000100/`` is complete (DCP shards of model and
optimizer, ``trainer.pt`` with step, scheduler, data position and seq_len, per-rank RNG
states, and ``meta.json``); every rank writes into ``.tmp-step_00000100/`` first and rank 0
renames it into place after all ranks finished, so a directory named ``step_*`` is always
whole. ``meta.json`` numbers the saves: "newest" and "oldest" are in the order they were
written, not by step, so a run resumed from an older checkpoint continues from its own saves,
never from the abandoned ones with larger steps; it also names the checkpoint of its output
that the save descends from (the one the run resumed, or its previous save). Stale temporary
directories (a killed save) are removed by the next save; the oldest complete ones beyond
``keep`` are deleted after a successful save, each renamed ``.del-step_N`` first, so that an
interrupted deletion never leaves a ``step_N`` with part of its files. Saves and loads
coordinate over a gloo group of their own, destroyed afterwards (see :func:`_collectives`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from hyperparallel.data import ByteTokenizer

STEP_DIR = re.compile(r"^step_(\d{8})$")


class TrainState(Stateful):
    """Model and optimizer as DCP sees them (sharded, resharded on load)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )


def directory(output: str | Path) -> Path:
    return Path(output) / "checkpoints"


def _save_number(path: Path) -> int | None:
    """The save's number in its output (0 for checkpoints written before saves were numbered;
    None when ``meta.json`` is unreadable, names no step as every save's does, or went away
    while it was read)."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(meta, dict) and type(meta.get("step")) is int):  # JSON true: a bool
        return None
    number = meta.get("save", 0)
    return number if type(number) is int else None


def _numbered(output: str | Path) -> list[tuple[int | None, Path]]:
    """Each ``step_N`` folder under ``output`` with its save number (None: unreadable)."""
    root = directory(output)
    if not root.is_dir():
        return []
    return [(_save_number(p), p) for p in root.iterdir() if STEP_DIR.match(p.name)]


def complete(output: str | Path) -> list[Path]:
    """Complete checkpoints (``meta.json`` readable), oldest written first."""
    found = [(n, p) for n, p in _numbered(output) if n is not None]
    return [p for _, p in sorted(found, key=lambda item: (item[0], item[1].name))]


def unreadable(output: str | Path) -> list[Path]:
    """The ``step_N`` folders under ``output`` that :func:`complete` skips: their ``meta.json``
    is missing or unreadable (a save renames its folder into place only after writing it, so
    such a folder was damaged since)."""
    return sorted((p for n, p in _numbered(output) if n is None), key=lambda p: p.name)


def _recover(root: Path) -> None:
    """Put back a checkpoint a save was replacing when the process died (it had moved the old
    ``step_N`` to ``.old-step_N`` and not yet renamed the new one into place). A ``root``
    that does not exist holds nothing to recover."""
    for moved in root.glob(".old-step_*"):
        final = root / moved.name.removeprefix(".old-")
        if not final.exists() and _save_number(moved) is not None:
            with contextlib.suppress(FileNotFoundError):  # another rank's preflight moved it
                os.replace(moved, final)


def newer_than(output: str | Path, path: Path) -> list[Path]:
    """The complete checkpoints under ``output`` written after ``path``, oldest first."""
    done = complete(output)
    resolved = [p.resolve() for p in done]
    if path.resolve() not in resolved:
        return []
    return done[resolved.index(path.resolve()) + 1 :]


def find(path: str | Path) -> Path:
    """The checkpoint to resume from: ``path`` itself, or the newest complete one of the run
    ``path`` (an output, or its ``checkpoints`` folder), never of a run in a folder above it;
    absolute, so that its output is ``.parent.parent`` whatever the working directory."""
    given = Path(path).expanduser().absolute()
    if STEP_DIR.match(given.name):  # a save replacing it may have moved it aside
        _recover(given.parent)
    if not given.exists():
        raise FileNotFoundError(
            f"{given} does not exist; train without --resume first, or point --resume at a "
            "run's output folder (the --output it trained into) or at one of its checkpoints "
            "(checkpoints/step_00000400)"
        )
    if STEP_DIR.match(given.name) and (given / "meta.json").is_file():
        return given
    outputs = (given, given.parent) if given.name == directory("").name else (given,)
    for output in outputs:
        _recover(directory(output))
        found = complete(output)
        if found:
            return found[-1]
    raise FileNotFoundError(
        f"no complete checkpoint in {given} (looked for {directory(given)}/step_*/meta.json); "
        f"train without --resume first, or point --resume at a checkpoint folder: one named "
        f"step_ and its step in 8 digits (step_00000400), holding meta.json{_renamed(given)}"
    )


def _renamed(given: Path) -> str:
    """For a checkpoint folder under another name (its ``meta.json`` names its step), the name
    to give it back; else empty."""
    try:
        step = json.loads((given / "meta.json").read_text())["step"]
        return f"; {given.name} holds step {step}'s meta.json: rename it step_{step:08d}"
    except (OSError, ValueError, LookupError, TypeError):  # no checkpoint's meta.json
        return ""


def skipped(target: str | Path, path: Path) -> list[Path]:
    """The damaged ``step_N`` folders (see :func:`unreadable`) that :func:`find` passed over
    for ``target`` to resume from ``path``: none when ``target`` is that checkpoint itself,
    else those of the output it searched."""
    if Path(target).expanduser().absolute() == path.absolute():
        return []
    return unreadable(path.parent.parent)


@contextlib.contextmanager
def _collectives() -> Iterator[dist.ProcessGroup]:
    """A gloo group for one save or load (every rank enters), destroyed on exit with its threads.

    Not the training group, because of how torch and libgomp meet: DCP gathers its pickled plans
    with ``all_gather_object`` (tens of KB once optimizer state is in them, on one rank too), and
    gloo copies the gathered bytes with ATen on its worker thread; a copy above ATen's grain size
    (32768 elements) opens an OpenMP parallel region there, and that thread keeps its own libgomp
    team for as long as it lives. Once libgomp manages more threads than the process has CPUs,
    every team, the training thread's included, busy-waits 1000 spins instead of 300000 before
    sleeping on a futex (libgomp's ``do_spin``, ``config/linux/wait.h``), so each of a step's
    many short parallel regions pays a futex wake-up: ``spore train`` ran 1.4-1.6x slower after
    its first checkpoint. The team ends with the group's thread, so libgomp is left as it was.
    """
    group = dist.new_group(backend="gloo")
    try:
        yield group
    finally:
        dist.destroy_process_group(group)


def _rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save(
    output: str | Path,
    step: int,
    state: TrainState,
    extra: dict[str, Any],
    *,
    keep: int,
    parent: Path | None = None,
) -> Path:
    """Write checkpoint ``step`` collectively (every rank calls this); returns its directory.
    ``parent``: the checkpoint the saved state descends from (resumed, or saved before)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root = directory(output)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-{final.name}"
    with _collectives() as group:
        if rank == 0:
            _recover(root)
            for stale in [*root.glob(".tmp-step_*"), *root.glob(".old-step_*")]:
                _discard(stale)
            for stale in root.glob(".del-*"):
                _remove(stale)
            _clear_export_leftovers(output)
            tmp.mkdir(parents=True)
        dist.barrier(group=group)
        dcp.save({"train": state}, checkpoint_id=str(tmp), process_group=group)
        torch.save({"rng": _rng_state()}, tmp / f"rng_rank{rank:05d}.pt")
        if rank == 0:
            torch.save(extra, tmp / "trainer.pt")
        dist.barrier(group=group)
        if rank == 0:
            earlier = complete(output)
            number = (_save_number(earlier[-1]) or 0) + 1 if earlier else 1
            named = parent.name if parent and parent.parent.resolve() == root.resolve() else None
            meta = {
                "step": step,
                "save": number,
                "parent": named,  # one of another output is not named
                "ancestors": _lineage(root / named, keep) if named else [],
                "world_size": world,
                "time": time.time(),
            }
            (tmp / "meta.json").write_text(json.dumps(meta))
            replaced = root / f".old-{final.name}"
            if final.exists():
                os.replace(final, replaced)
            os.replace(tmp, final)
            _discard(replaced)
            for old in complete(output)[:-keep]:
                _discard(old)
        dist.barrier(group=group)
    return final


def _discard(path: Path) -> None:
    """Delete the folder ``path`` (if there) under another name, ``.del-`` and its own without
    a leading dot: a deletion interrupted midway (Ctrl-C) leaves no ``step_N`` that looks
    complete with files gone, and no ``.old-step_N`` that :func:`_recover` would put back. The
    next save deletes what is left. A link is removed, not what it points to."""
    doomed = path.with_name(f".del-{path.name.lstrip('.')}")
    _remove(doomed)
    try:
        os.replace(path, doomed)
    except FileNotFoundError:
        return
    _remove(doomed)


def _remove(path: Path) -> None:
    """Delete ``path`` if there: a link or file unlinked, a folder with all it holds."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _root_records_off() -> Iterator[None]:
    """No record DCP's own modules log on the root logger while it runs: ``dcp.load`` logs
    each file it cannot read there with its traceback, before raising the error :func:`load`
    reports in one line (a logger's filter sees only its own records, not those its children
    pass up). Other code's root-logger records pass."""
    root = logging.getLogger()
    root.addFilter(_not_dcp)
    try:
        yield
    finally:
        root.removeFilter(_not_dcp)


_DCP_DIR = os.path.join(os.path.dirname(dcp.__file__), "")


def _not_dcp(record: logging.LogRecord) -> bool:
    return not record.pathname.startswith(_DCP_DIR)


class Unreadable(Exception):
    """A checkpoint's files cannot be loaded (damaged, cut short or partly deleted); the
    message names the checkpoint, the first failure and the older checkpoints to resume from."""


def load(path: Path, state: TrainState) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG from ``path``; returns the trainer extras.
    :class:`Unreadable` when a file of it cannot be read, or its state does not fit ``state``."""
    rank = dist.get_rank()
    in_dcp = False
    try:
        world = int(json.loads((path / "meta.json").read_text())["world_size"])
        in_dcp = True
        with _collectives() as group, _root_records_off():
            dcp.load({"train": state}, checkpoint_id=str(path), process_group=group)
        in_dcp = False
        rng_file = path / f"rng_rank{rank:05d}.pt"
        if world == dist.get_world_size():  # a missing one would resume other random draws
            rng = torch.load(rng_file, weights_only=True)["rng"]
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        return torch.load(path / "trainer.pt", weights_only=False)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        if _interrupted(exc):
            raise KeyboardInterrupt from exc
        failure = f"checkpoint {path} cannot be loaded ({_first_failure(exc)})"
        if in_dcp and _files_whole(path):
            raise Unreadable(
                f"{failure}: its files are all there, so this run's model or optimizer settings "
                f"likely differ from those it was saved with; resume with those (its run's "
                f"config.yaml). If they are the same, its files are damaged: {instead(path)}"
            ) from exc
        raise Unreadable(
            f"{failure}: its files are damaged or incomplete (a full disk, a copy cut short); "
            f"{instead_or_delete(path)}"
        ) from exc


def instead(path: Path) -> str:
    """What to do in place of resuming the damaged checkpoint ``path``: resume the older one of
    its output it descends from, or start again."""
    older = _descends_from(path)
    if older is not None:
        return f"resume from an older checkpoint with --resume {older}"
    return "start the run again without --resume"


def instead_or_delete(path: Path) -> str:
    """What to do about the damaged checkpoint ``path``: :func:`instead`, or delete it."""
    return f"{instead(path)}, or delete {path.name}"


def _lineage(parent: Path, keep: int) -> list[dict[str, Any]]:
    """The ``ancestors`` a save descending from ``parent`` records: ``parent`` and the
    ancestors its ``meta.json`` lists (none where it lists none), newest first, each by name
    and save number (a later save may take its name), at most ``keep`` (``keep`` removes the
    oldest saves first: no older one is left)."""
    try:
        meta = json.loads((parent / "meta.json").read_text())
        older = [{"name": a["name"], "save": a["save"]} for a in meta.get("ancestors", [])]
    except (OSError, ValueError, LookupError, TypeError, AttributeError):
        older = []
    return [{"name": parent.name, "save": _save_number(parent)}, *older][:keep]


def _descends_from(path: Path) -> Path | None:
    """The newest complete checkpoint of ``path``'s output that ``path`` descends from: of the
    ``ancestors`` its ``meta.json`` lists, the first still there under its name and save number
    (``keep`` removes old saves, a later save may replace one); for a checkpoint saved before
    ``meta.json`` listed them, the ``parent`` it names unless removed or replaced by a later
    save; for one saved before it named that, the newest of a lower step."""
    done = complete(path.parent.parent)
    try:
        meta = json.loads((path / "meta.json").read_text())
        if "ancestors" in meta:
            saved = {(p.name, _save_number(p)): p for p in done}
            keys = [(a["name"], a["save"]) for a in meta["ancestors"]]
            return next((saved[key] for key in keys if key in saved), None)
        parent = meta["parent"]
    except (OSError, ValueError, LookupError, TypeError, AttributeError):  # no parent named
        older = [p for p in done if p.name < path.name]
        return older[-1] if older else None
    number = _save_number(path) or 0
    return next((p for p in done if p.name == parent and (_save_number(p) or 0) < number), None)


def _files_whole(path: Path) -> bool:
    """Whether every byte range DCP's metadata lists in ``path`` is there (no file missing or
    cut short)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        ends: dict[str, int] = {}
        for info in FileSystemReader(str(path)).read_metadata().storage_data.values():
            ends[info.relative_path] = max(
                ends.get(info.relative_path, 0), info.offset + info.length
            )
        return all((path / name).stat().st_size >= end for name, end in ends.items())
    except Exception:  # unreadable metadata, a missing file
        return False


def _interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` is DCP's :class:`CheckpointException` for a rank's ``KeyboardInterrupt``
    (Ctrl-C during a load: no damage)."""
    failures = exc.failures.values() if isinstance(exc, CheckpointException) else ()
    return any(isinstance(failure, KeyboardInterrupt) for failure, _ in failures)


def _first_failure(exc: BaseException) -> str:
    """One line for ``exc``: for DCP's :class:`CheckpointException`, which gathers each rank's
    exception with its traceback, the first rank's exception."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = exc.failures[min(exc.failures)][0]  # (exception, traceback)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def extras(path: Path) -> dict[str, Any] | None:
    """The checkpoint's ``trainer.pt``, the extras :func:`save` was given (step, scheduler,
    data position, schedule); None when missing or unreadable."""
    try:
        saved = torch.load(path / "trainer.pt", weights_only=False)
    except Exception:  # missing, truncated, or not written by spore train
        return None
    return saved if isinstance(saved, dict) else None


def data_layout(extra: dict[str, Any]) -> dict[str, int] | None:
    """What the data position in a checkpoint's :func:`extras` is valid for: ``world`` (ranks)
    and ``batch_size`` (per rank), and ``seq_len`` where it names it (older checkpoints do
    not); None when they do not say."""
    try:
        layout = {k: int(extra["sampler"][k]) for k in ("world", "batch_size")}
        if "seq_len" in extra.get("data", {}):
            layout["seq_len"] = int(extra["data"]["seq_len"])
        return layout
    except Exception:  # not written by spore train
        return None


def saved_schedule(extra: dict[str, Any]) -> dict[str, Any] | None:
    """The schedule section a checkpoint's :func:`extras` were saved under (``schedule.*`` by
    key); None when they do not name it (older checkpoints)."""
    schedule = extra.get("schedule")
    return schedule if isinstance(schedule, dict) else None


def dcp_entries(path: Path) -> dict[str, Any]:
    """DCP's metadata of the checkpoint's entries by key (empty when unreadable)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception:  # missing or truncated .metadata: the load reports it
        return {}


def model_shapes(entries: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The saved model's tensor shapes by name, from a checkpoint's :func:`dcp_entries`."""
    prefix = "train.model."
    return {
        k.removeprefix(prefix): tuple(v.size)
        for k, v in entries.items()
        if k.startswith(prefix) and hasattr(v, "size")
    }


def optimized(entries: dict[str, Any]) -> set[str]:
    """The saved model's parameters that the saved optimizer holds state for, by name, from a
    checkpoint's :func:`dcp_entries` (a tied weight under its first name; empty when it holds
    none)."""
    names = {k.removeprefix("train.model.") for k in entries if k.startswith("train.model.")}
    found: set[str] = set()
    for key in entries:
        if key.startswith("train.optim.state."):  # train.optim.state.<name>.<state, e.g. exp_avg>
            name = key.removeprefix("train.optim.state.")
            while name and name not in names:
                name = name.rpartition(".")[0]
            found.add(name)
    return found - {""}


EXPORT_RECORD = "spore-export.json"
"""The file in ``final/`` naming the checkpoint whose weights it holds (see :func:`export`)."""


def export(model: torch.nn.Module, output: str | Path, made_from: Path) -> Path | None:
    """Gather full weights and write ``<output>/final`` with ``save_pretrained`` (rank 0), its
    config and generation config naming the byte tokenizer's special tokens (the model was
    trained on them: an architecture's own ids, llama's eos 2, are a byte here), and
    :data:`EXPORT_RECORD` naming ``made_from``, the checkpoint holding ``model``'s weights (its
    name, step and save number). Written to ``.tmp-final`` and renamed into place; the previous
    export is deleted first (its weights are older than ``model``'s), so an export stopped
    midway leaves no ``final/``, which the next run's export makes, never one of older
    weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    if dist.get_rank() != 0:
        return None
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    target = Path(output) / "final"
    _discard(target)
    _clear_export_leftovers(output)
    config = copy.deepcopy(model.config)
    config.bos_token_id, config.eos_token_id = ByteTokenizer.bos_id, ByteTokenizer.eos_id
    config.pad_token_id = ByteTokenizer.pad_id  # not in training: it fixes the row's gradient
    config.use_cache = getattr(type(config)(), "use_cache", True)  # training turned it off
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(full)
    tmp = Path(output) / ".tmp-final"
    plain.save_pretrained(tmp)
    (tmp / EXPORT_RECORD).write_text(json.dumps(_identity(made_from)))
    os.replace(tmp, target)
    return target


def holds_export_of(output: str | Path, path: Path) -> bool:
    """Whether ``<output>/final`` holds the weights of checkpoint ``path``: its
    :data:`EXPORT_RECORD` names ``path`` (name, step and save number). False for an export
    that names none (written before exports named their checkpoint) or where either is
    unreadable."""
    try:
        record = json.loads((Path(output) / "final" / EXPORT_RECORD).read_text())
    except (OSError, ValueError):
        return False
    identity = _identity(path)
    return identity["save"] is not None and record == identity


def _identity(path: Path) -> dict[str, Any]:
    """What :data:`EXPORT_RECORD` says of checkpoint ``path``: its name, step and save number
    (None where its ``meta.json`` is unreadable)."""
    try:
        step = json.loads((path / "meta.json").read_text())["step"]
    except (OSError, ValueError, LookupError, TypeError):
        step = None
    return {"checkpoint": path.name, "step": step, "save": _save_number(path)}


def _clear_export_leftovers(output: str | Path) -> None:
    """Delete what an export stopped midway left in ``output``: ``.tmp-final`` and
    ``.del-final``; never ``final/``."""
    _remove(Path(output) / ".del-final")
    _discard(Path(output) / ".tmp-final")  # and its .del- name
