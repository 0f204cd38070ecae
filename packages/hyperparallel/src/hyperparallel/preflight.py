"""Everything checked before a process starts: the config, the model section (transformers
can build it), the optimizer and schedule (they accept their settings), the data paths, the
checkpoint to resume from and the output directory."""

from __future__ import annotations

import os
from collections.abc import Sequence
from glob import glob
from pathlib import Path

import torch

from hyperparallel import checkpoint, launch, model, registries
from hyperparallel.config import Config, ConfigError, load
from hyperparallel.data import ByteTokenizer


def resolve(
    path: str | None,
    overrides: Sequence[str],
    resume: str | None = None,
    *,
    outputs: bool = True,
) -> Config:
    """The validated config, its ``model.config`` settled to the settings the model is built
    with (:func:`hyperparallel.model.settings`); :class:`ConfigError` lists every problem with
    its origin.

    ``outputs=False`` leaves the file system alone: neither the ``resume`` target nor what
    ``run.output`` already holds is checked (``--print-config``).
    """
    world = int(os.environ["WORLD_SIZE"]) if launch.under_torchrun() else None
    cfg = load(path, overrides, world)
    problems: list[str] = []

    def at(key: str) -> str:
        return cfg.origins.get(key, "default")

    try:
        architecture = model.hf_config(cfg.model, ByteTokenizer().vocab_size)
    except model.ModelConfigError as exc:
        key = str(exc).split(":", 1)[0]
        problems.append(f"{at(key)}: {exc}")
    else:
        limit = model.max_length(architecture)
        if limit is not None and cfg.data.seq_len > limit:
            problems.append(
                f"{at('data.seq_len')}: data.seq_len={cfg.data.seq_len} exceeds the model's "
                f"max_position_embeddings={limit}"
            )
        settled = cfg.model.model_copy(update={"config": model.settings(cfg.model)})
        cfg = cfg.model_copy(update={"model": settled})
    problems += _optimizer_problems(cfg)
    patterns = [cfg.data.path] if isinstance(cfg.data.path, str) else cfg.data.path or []
    for pattern in patterns:
        if not glob(str(Path(pattern).expanduser())):
            problems.append(f"{at('data.path')}: data.path: no file matches {pattern!r}")
    if outputs:
        problems += _output_problems(cfg, resume, world or cfg.parallel.nproc)
    if problems:
        raise ConfigError(problems)
    return cfg


def _optimizer_problems(cfg: Config) -> list[str]:
    """The optimizer and schedule accept their settings (``optim.options`` included): both are
    built once over a two-parameter module, as every rank would build them."""
    probe = torch.nn.Linear(2, 2)
    try:
        optimizer = registries.optimizers.get(cfg.optim.name)(probe, cfg.optim)
        registries.schedules.get(cfg.schedule.name)(optimizer, cfg.schedule, cfg.run.steps)
    except (TypeError, ValueError) as exc:
        given = [where for key, where in cfg.origins.items() if key.startswith("optim.options")]
        at = given[0] if given else cfg.origins.get("optim.name", "default")
        return [f"{at}: optim {cfg.optim.name!r} / schedule {cfg.schedule.name!r}: {exc}"]
    return []


def _output_problems(cfg: Config, resume: str | None, world: int) -> list[str]:
    """The checkpoint to resume from exists and was saved with this run's data layout; a new
    run finds no earlier run's checkpoints."""
    if resume is not None:
        try:
            path = checkpoint.find(cfg.run.output if resume == "latest" else resume)
        except FileNotFoundError as exc:
            return [f"--resume: {exc}"]
        saved = checkpoint.data_layout(path)
        if saved != (world, cfg.data.batch_size):
            return [
                f"--resume: {path.name} was saved by {saved[0]} rank(s) of "
                f"data.batch_size={saved[1]}, this run has {world} of {cfg.data.batch_size}; "
                f"the data order continues only on the same layout (--nproc {saved[0]} "
                f"--set data.batch_size={saved[1]})"
            ]
        return []
    if earlier := checkpoint.complete(cfg.run.output):
        at = cfg.origins.get("run.output", "default")
        return [
            f"{at}: run.output {cfg.run.output} already holds checkpoints of an earlier run "
            f"(newest {earlier[-1].name}); continue it with --resume, or choose another "
            f"--output (nothing there is overwritten)"
        ]
    return []
