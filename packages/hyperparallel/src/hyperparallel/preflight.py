"""Everything checked before a process starts: the config, the model section (transformers
can build it), the data paths, and the checkpoint to resume from."""

from __future__ import annotations

import os
from collections.abc import Sequence
from glob import glob
from pathlib import Path

from hyperparallel import checkpoint, launch, model
from hyperparallel.config import Config, ConfigError, load
from hyperparallel.data import ByteTokenizer


def resolve(path: str | None, overrides: Sequence[str], resume: str | None = None) -> Config:
    """The validated config; :class:`ConfigError` lists every problem with its origin."""
    world = int(os.environ["WORLD_SIZE"]) if launch.under_torchrun() else None
    cfg = load(path, overrides, world)
    problems: list[str] = []

    def at(key: str) -> str:
        return cfg.origins.get(key, "default")

    try:
        model.hf_config(cfg.model, ByteTokenizer().vocab_size)
    except model.ModelConfigError as exc:
        key = str(exc).split(":", 1)[0]
        problems.append(f"{at(key)}: {exc}")
    patterns = [cfg.data.path] if isinstance(cfg.data.path, str) else cfg.data.path or []
    for pattern in patterns:
        if not glob(str(Path(pattern).expanduser())):
            problems.append(f"{at('data.path')}: data.path: no file matches {pattern!r}")
    if resume is not None:
        try:
            checkpoint.find(cfg.run.output if resume == "latest" else resume)
        except FileNotFoundError as exc:
            problems.append(f"--resume: {exc}")
    elif earlier := checkpoint.complete(cfg.run.output):
        problems.append(
            f"{at('run.output')}: run.output {cfg.run.output} already holds checkpoints of an "
            f"earlier run (newest {earlier[-1].name}); continue it with --resume, or choose "
            f"another --output (nothing there is overwritten)"
        )
    if problems:
        raise ConfigError(problems)
    return cfg
