"""``spore train``: the command line over :mod:`hyperparallel.config` and :mod:`.launch`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

HELP = """Train a Hugging Face causal LM with FSDP2, configured by YAML.

With no CONFIG it runs the embedded default: a small Llama-style model on a generated corpus
that learns visibly in about a minute on two CPU cores. Outputs go to run.output (--output):
checkpoints/, metrics.jsonl, loss.png, config.yaml and final/ (save_pretrained).

\b
Examples:
  spore train
  spore train run.yaml --nproc 2 --set optim.lr=1e-3 --set run.steps=1000
  spore train run.yaml --resume                 # newest complete checkpoint in run.output
  spore train --print-config > run.yaml         # start a config from the defaults
  torchrun --nnodes 2 --nproc-per-node 8 ... -m hyperparallel run.yaml   # multi-node
"""


@click.command(name="train", help=HELP)
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY.PATH=VALUE",
    help="Override one setting (repeatable). VALUE is read as YAML: --set optim.lr=1e-3, "
    "--set 'data.path=[a/*.txt, b.jsonl]' (a list), --set run.stop_at=null. "
    "--print-config lists every key.",
)
@click.option("--nproc", type=click.IntRange(min=1), help="Local processes (parallel.nproc).")
@click.option(
    "--resume",
    is_flag=False,
    flag_value="latest",
    default=None,
    metavar="[PATH]",
    help="Continue from the newest complete checkpoint in run.output, or from PATH.",
)
@click.option("--output", type=click.Path(file_okay=False), help="Output directory (run.output).")
@click.option(
    "--print-config",
    is_flag=True,
    help="Print the resolved config as YAML and exit (run.output is not looked at).",
)
def train(
    config: str | None,
    overrides: tuple[str, ...],
    nproc: int | None,
    resume: str | None,
    output: str | None,
    print_config: bool,
) -> None:
    from hyperparallel import launch, preflight
    from hyperparallel.config import ConfigError, Override, notes

    if config is None and resume and Path(resume).suffix in (".yaml", ".yml"):
        raise click.UsageError(
            f"--resume took {resume} as the checkpoint to resume from, and no config was given; "
            f"put the config first: spore train {resume} --resume"
        )
    extra: list[Override] = list(overrides)
    if nproc is not None:
        extra.append((f"parallel.nproc={nproc}", f"--nproc {nproc}"))
    if output is not None:  # quoted: the directory's name as typed, never YAML (`a: b`, `[x]`)
        quoted = json.dumps(output, ensure_ascii=False)
        extra.append((f"run.output={quoted}", f"--output {quoted}"))
    try:
        cfg = preflight.resolve(config, extra, resume, outputs=not print_config)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    if os.environ.get("RANK", "0") == "0":  # under torchrun, once
        for line in notes(cfg):
            click.echo(f"note: {line}", err=True)
    if print_config:
        click.echo(cfg.to_yaml(), nl=False)
        return
    before = _saves(cfg.run.output)
    try:
        launch.launch(cfg, resume, echo=lambda line: click.echo(line, err=True))
    except launch.OutputBusy as exc:
        raise click.ClickException(str(exc)) from None
    except launch.TrainingFailed as exc:
        raise click.ClickException(f"{exc}. {_resume_hint(cfg.run.output, before)}") from None
    except launch.TrainingInterrupted as exc:
        click.echo(f"spore train: {exc}. {_resume_hint(cfg.run.output, before)}", err=True)
        raise SystemExit(128 + exc.signum) from None


def _saves(output: str) -> list[tuple[Path, float]]:
    """The complete checkpoints under ``output`` with the time of their ``meta.json``."""
    from hyperparallel import checkpoint

    return [(p, (p / "meta.json").stat().st_mtime) for p in checkpoint.complete(output)]


def _resume_hint(output: str, before: list[tuple[Path, float]]) -> str:
    """Where to go on from after a failed run, given the checkpoints there were ``before`` it.
    A run that saved none does not offer its starting checkpoint again: the failure may be
    that checkpoint's (its error names an older one)."""
    done = _saves(output)
    if not done:
        return f"No checkpoint in {output} was complete yet."
    if done == before:
        return f"This run saved no checkpoint; the newest is still {done[-1][0]}."
    return f"Newest complete checkpoint: {done[-1][0]} (continue with --resume)."
