"""Everything checked before a process starts: the config, the model section (transformers
builds it, on the meta device), the optimizer and schedule (they accept their settings), the
data paths, the checkpoint to resume from and the output directory."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hyperparallel import checkpoint, launch, model, registries, report
from hyperparallel import data as corpus
from hyperparallel.config import Config, ConfigError, Override, load
from hyperparallel.data import ByteTokenizer


def resolve(
    path: str | None,
    overrides: Sequence[Override],
    resume: str | None = None,
    *,
    outputs: bool = True,
) -> Config:
    """The validated config; :class:`ConfigError` lists every problem with its origin.

    ``outputs=False`` is for a config not run here (``--print-config``): neither the
    ``resume`` target, what ``run.output`` already holds, nor this machine's devices and
    process-group backends are checked.
    """
    world = int(os.environ["WORLD_SIZE"]) if launch.under_torchrun() else None
    try:
        cfg = load(path, overrides, world)
    except ConfigError as exc:  # with what the sections valid on their own still show
        more = _model_and_data_problems(exc.sections, exc.origins)
        raise ConfigError(exc.problems + more) from None
    problems = _model_and_data_problems({"model": cfg.model, "data": cfg.data}, cfg.origins)
    problems += _optimizer_problems(cfg)
    if outputs:
        problems += _device_problems(cfg)
        problems += _output_problems(cfg, resume, world or cfg.parallel.nproc)
        problems += _config_file_problems(path, cfg, world)
    if problems:
        raise ConfigError(problems)
    return cfg


def _model_and_data_problems(sections: Mapping[str, Any], origins: Mapping[str, str]) -> list[str]:
    """transformers builds the model section's model, data.seq_len fits its positions, and
    data.path's globs match files (for whichever of the two sections is valid)."""
    problems = []
    section, data = sections.get("model"), sections.get("data")
    if section is not None:
        try:
            architecture = model.hf_config(section, ByteTokenizer().vocab_size)
        except model.ModelConfigError as exc:
            keys = exc.keys or (str(exc).split(":", 1)[0],)
            where = ", ".join(dict.fromkeys(origins.get(k, "default") for k in keys))
            problems.append(f"{where}: {exc}")
        else:
            problems += _build_problems(section, architecture, origins)
            limit = model.max_length(architecture)
            if data is not None and limit is not None and data.seq_len > limit:
                problems.append(
                    f"{origins.get('data.seq_len', 'default')}: data.seq_len={data.seq_len} "
                    f"exceeds the model's max_position_embeddings={limit}"
                )
    if data is not None:
        patterns = [data.path] if isinstance(data.path, str) else data.path or []
        for pattern in patterns:
            try:
                corpus.files(pattern)  # as the ranks will read them
            except (FileNotFoundError, ValueError) as exc:
                problems.append(f"{origins.get('data.path', 'default')}: data.path: {exc}")
    return problems


def _build_problems(section: Any, architecture: Any, origins: Mapping[str, str]) -> list[str]:
    """Key-value heads divide the attention heads, transformers builds the model (on the meta
    device), it names its decoder layers, and ``model.config`` keeps a pretrained model's
    parameter shapes."""
    heads = model.setting(architecture, "num_attention_heads")
    groups = model.setting(architecture, "num_key_value_heads")
    if isinstance(heads, int) and isinstance(groups, int) and (groups < 1 or heads % groups):
        return [  # transformers builds some such; their first forward fails
            f"{_where(origins, 'model.config')}: model.config.num_key_value_heads={groups} "
            f"does not divide num_attention_heads={heads}; each key-value head serves a "
            f"whole group of attention heads (1, or a divisor of {heads})"
        ]
    try:
        built = model.on_meta(architecture)
        model.decoder_layers(built)
    except Exception as exc:  # whatever transformers raises for settings its config took
        name = section.pretrained or model.type_name(section)
        return [
            f"{_where(origins, 'model')}: model: transformers cannot build {name} with "
            f"these settings ({type(exc).__name__}: {exc})"
        ]
    if changed := model.reshaped(section, built):
        return [
            f"{_where(origins, 'model.config')}: model.config: over "
            f"model.pretrained, {len(changed)} parameter(s) would change shape and "
            f"not load ({_first_three(changed)}); "
            f"set only settings that keep the shapes (e.g. dropout)"
        ]
    return []


def _where(origins: Mapping[str, str], prefix: str, default: str = "default") -> str:
    """Where the settings under ``prefix`` were set (a problem of their combination names
    them all): the places of its leaf keys, each once, the first three; ``default`` when the
    user set none."""
    under = [k for k in origins if k == prefix or k.startswith(f"{prefix}.")]
    leaves = [k for k in under if not any(other.startswith(f"{k}.") for other in under)]
    return _first_three(list(dict.fromkeys(origins[k] for k in leaves))) or default


def _first_three(items: list[str]) -> str:
    """``items`` joined, the first three then ``...``."""
    return ", ".join(items[:3]) + (", ..." if len(items) > 3 else "")


def _optimizer_problems(cfg: Config) -> list[str]:
    """The optimizer and schedule accept their settings (``optim.options`` included): both are
    built once over a two-parameter module, as every rank would build them; the settings the
    schedule was registered reading are ``schedule.*`` settings."""
    probe = torch.nn.Linear(2, 2)
    at = _where(cfg.origins, "optim")
    try:
        optimizer = registries.optimizers.get(cfg.optim.name)(probe, cfg.optim)
    except Exception as exc:  # whatever torch or a registered builder raises
        return [f"{at}: optim {cfg.optim.name!r}: {exc}"]
    where = cfg.origins.get("schedule.name", "default")
    try:
        registries.schedules.get(cfg.schedule.name)(optimizer, cfg.schedule, cfg.run.steps)
    except Exception as exc:
        return [f"{where}: schedule {cfg.schedule.name!r}: {exc}"]
    settings = set(type(cfg.schedule).model_fields)  # name too: compared on resume anyway
    if unknown := (registries.schedules.reads(cfg.schedule.name) or set()) - settings:
        return [
            f"{where}: schedule {cfg.schedule.name!r} is registered reading "
            f"{', '.join(sorted(unknown))}, which the schedule section does not have (it has "
            f"{', '.join(sorted(settings))}); fix its registration's reads="
        ]
    return []


def _device_problems(cfg: Config) -> list[str]:
    """This machine has the device and the process-group backend the parallel section asks
    for (``auto`` resolved as each rank would)."""
    from hyperparallel.train import backend_for, device_type

    device = device_type(cfg.parallel)
    if device == "cuda" and not torch.cuda.is_available():
        return [
            f"{cfg.origins.get('parallel.device', 'default')}: parallel.device=cuda, but torch "
            f"finds no CUDA device (torch {torch.__version__}); use device: auto or cpu"
        ]
    backend = backend_for(cfg.parallel, device)
    if backend == "nccl" and device != "cuda":
        return [
            f"{cfg.origins.get('parallel.backend', 'default')}: parallel.backend=nccl runs on "
            f"CUDA, and this run's device is {device}; use backend: auto or gloo"
        ]
    if not torch.distributed.is_backend_available(backend):
        return [
            f"{cfg.origins.get('parallel.backend', 'default')}: parallel.backend={backend} is "
            f"not built into this torch ({torch.__version__}); use backend: auto"
        ]
    return []


def _resumed_model_problems(cfg: Config, path: Path) -> list[str]:
    """The checkpoint holds this run's model's parameters (built on the meta device): the same
    names, the same shapes, and optimizer state for the same trained parameters (tied weights
    are one)."""
    entries = checkpoint.dcp_entries(path)
    saved = checkpoint.model_shapes(entries)
    if not saved:  # unreadable metadata: the load reports it
        return []
    try:
        built = model.on_meta(model.hf_config(cfg.model, ByteTokenizer().vocab_size))
    except Exception:  # reported with the model section
        return []
    asked = model.shapes(built)
    names = [*saved, *(k for k in asked if k not in saved)]
    changed = [
        f"{k} {model.shown(saved.get(k))} -> {model.shown(asked.get(k))}"
        for k in names
        if saved.get(k) != asked.get(k)
    ]
    fix = "settings it was saved with (its run's config.yaml)"
    if changed:
        return [
            f"{_where(cfg.origins, 'model')}: --resume: {path.name} holds a model of other "
            f"shapes ({_first_three(changed)}); resume with the model {fix}"
        ]
    trained = checkpoint.optimized(entries)
    ours = _optimized_here(cfg, built)
    if not trained or ours is None:  # an optimizer without state (SGD without momentum)
        return []
    other = [f"{n} saved, not trained here" for n in sorted(trained - ours)]
    other += [f"{n} trained here, not saved" for n in sorted(ours - trained)]
    if not other:
        return []
    where = _where(cfg.origins, "model.config.tie_word_embeddings")
    return [
        f"{where}: --resume: {path.name} holds optimizer state for other parameters "
        f"({_first_three(other)}; tied weights, model.config.tie_word_embeddings, are one "
        f"parameter); resume with the model and optim {fix}"
    ]


def _resumed_schedule_problems(cfg: Config, path: Path, extra: dict[str, Any]) -> list[str]:
    """The checkpoint (``extra``: its trainer.pt) was saved under this run's ``schedule``
    settings, those its schedule was registered reading (all, for one that did not say): a
    resume under others would switch the learning-rate schedule mid-run. ``run.steps`` may
    change (the schedule then spans the new steps)."""
    saved = checkpoint.saved_schedule(extra)
    if saved is None:  # saved before trainer.pt named its schedule: nothing to compare
        return []
    asked = cfg.schedule.model_dump()
    reads = registries.schedules.reads(saved.get("name"))
    if reads is None:  # what it reads is unknown
        reads = frozenset(saved)
    changed = [k for k, v in saved.items() if (k == "name" or k in reads) and asked.get(k) != v]
    if not changed:
        return []
    where = ", ".join(dict.fromkeys(cfg.origins.get(f"schedule.{k}", "default") for k in changed))
    differ = "; ".join(f"schedule.{k}: {saved[k]!r} saved, {asked.get(k)!r} asked" for k in changed)
    fix = " ".join(f"--set schedule.{k}={saved[k]}" for k in changed)
    return [
        f"{where}: --resume: {path.name} was saved under other schedule settings ({differ}); "
        f"resuming under these would switch the learning-rate schedule mid-run: resume with the "
        f"saved ones ({fix}; its run's config.yaml), or start a new run from its export "
        f"(model.pretrained) to change them"
    ]


def _resumed_log_problems(cfg: Config, path: Path) -> list[str]:
    """The metrics log the resume continues (:func:`hyperparallel.train.run_log`), where there
    is one, is a regular file (a named pipe is not opened: that waits for a writer) whose
    lines rank 0 can read back."""
    from hyperparallel.train import damaged_log, run_log, unreadable_log

    output = Path(cfg.run.output)
    log = run_log(path, output)
    if log.exists() and not log.is_file():
        return [f"--resume: {unreadable_log(log, f'{_kind(log)}, not a file', output)}"]
    try:
        report.read_metrics(log)  # none yet: the log starts after the checkpoint
    except OSError as exc:
        return [f"--resume: {unreadable_log(log, exc.strerror or str(exc), output)}"]
    except ValueError as exc:
        return [f"--resume: {damaged_log(exc)}"]
    return []


def _kind(path: Path) -> str:
    """What ``path``, which exists and is not a regular file, is (a link followed)."""
    mode = path.stat().st_mode
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"))
    kinds += ((stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _optimized_here(cfg: Config, built: torch.nn.Module) -> set[str] | None:
    """The names of the parameters this run's optimizer trains, from the optimizer built over
    ``built`` (on the meta device); None when the builder refuses a meta model."""
    try:
        optimizer = registries.optimizers.get(cfg.optim.name)(built, cfg.optim)
    except Exception:  # a builder that needs real weights: nothing to compare
        return None
    names = {id(p): n for n, p in built.named_parameters()}
    return {names[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in names}


def _unwritable(existing: Path) -> str | None:
    """Why the run cannot make or write its output inside ``existing`` (the output or its
    nearest existing parent), ``None`` when it can: a directory made and removed there."""
    try:
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".spore-probe-"))
    except OSError as exc:
        return f"cannot write in {existing} ({exc.strerror or exc})"
    return None


def _config_file_problems(path: str | None, cfg: Config, world: int | None) -> list[str]:
    """A run writes its resolved config to ``run.output/config.yaml``: a CONFIG there that a
    run did not write (its text is not the resolved form of its own settings: a user's
    comments, order or spelling) would be replaced."""
    written = Path(cfg.run.output) / "config.yaml"
    if path is None or not written.is_file() or Path(path).resolve() != written.resolve():
        return []
    try:
        if written.read_text() == load(path, (), world).to_yaml():
            return []  # a run's own config.yaml, resumed: rewriting it loses nothing
    except ConfigError:
        pass  # valid only with the overrides: not a run's
    return [
        f"{path}: this is run.output's config.yaml, where spore train writes the resolved "
        f"config of the run, and it is not one it wrote: it would be replaced; keep your "
        f"config outside {cfg.run.output}"
    ]


_WRITTEN = (
    ("checkpoints", True),
    ("final", True),
    ("metrics.jsonl", False),
    ("config.yaml", False),
    ("loss.png", False),
    (launch.LOCK_FILE, False),
)
"""What a run writes in ``run.output``, and whether each is a directory."""


def _output_problems(cfg: Config, resume: str | None, world: int) -> list[str]:
    """The checkpoint to resume from exists and was saved with this run's data layout; neither
    a new run nor one resumed from elsewhere finds another run's checkpoints in its output;
    the output is a directory, or can be made one, and what a run writes there is not there
    as something else (a directory as a file, a named pipe as a file)."""
    at = cfg.origins.get("run.output", "default")
    if launch.holder() and (why := launch.busy(cfg.run.output)):
        return [f"{at}: {why}"]
    blocked = next(
        (p for p in (Path(cfg.run.output), *Path(cfg.run.output).parents) if p.exists()), None
    )
    if blocked is not None:
        if not blocked.is_dir():
            return [f"{at}: run.output {cfg.run.output}: {blocked} is a file, not a directory"]
        if why := _unwritable(blocked):
            return [f"{at}: run.output {cfg.run.output}: {why}; choose another --output"]
    for name, folder in _WRITTEN:
        path = Path(cfg.run.output) / name
        if name == "final" and not cfg.checkpoint.export:
            continue
        if folder and os.path.lexists(path) and not path.is_dir():  # a dangling link too
            what = "a directory, and it is not one"
        elif not folder and path.exists() and not path.is_file():  # a dangling link is replaced
            what = f"a file, and it is {_kind(path)}"  # a named pipe is not opened: it would wait
        else:
            continue
        return [
            f"{at}: run.output {cfg.run.output}: spore train writes {name} there as {what}; "
            f"move {path} away, or choose another --output"
        ]
    if resume is not None:
        try:
            path = checkpoint.find(cfg.run.output if resume == "latest" else resume)
        except FileNotFoundError as exc:
            return [f"--resume: {exc}"]
        extra = checkpoint.extras(path)
        saved = None if extra is None else checkpoint.data_layout(extra)
        if extra is None or saved is None:
            return [
                f"--resume: {path} has no readable trainer.pt (data position, schedule): it is "
                f"damaged; {checkpoint.instead_or_delete(path)}"
            ]
        problems = []
        own = checkpoint.complete(cfg.run.output)
        if own and path.parent.resolve() != checkpoint.directory(cfg.run.output).resolve():
            problems.append(
                f"{cfg.origins.get('run.output', 'default')}: run.output {cfg.run.output} "
                f"already holds checkpoints of another run (newest {own[-1].name}), and "
                f"--resume continues {path.name} of {path.parent.parent}: training would write "
                f"over that run's saves, metrics and export; choose another --output, or resume "
                f"one of its own checkpoints"
            )
        problems += _resumed_model_problems(cfg, path)
        problems += _resumed_schedule_problems(cfg, path, extra)
        problems += _resumed_log_problems(cfg, path)
        if (saved["world"], saved["batch_size"]) != (world, cfg.data.batch_size):
            problems.append(
                f"--resume: {path.name} was saved by {saved['world']} rank(s) of "
                f"data.batch_size={saved['batch_size']}, this run has {world} of "
                f"{cfg.data.batch_size}; the data order continues only on the same layout "
                f"(--nproc {saved['world']} --set data.batch_size={saved['batch_size']})"
            )
        if saved.get("seq_len", cfg.data.seq_len) != cfg.data.seq_len:
            problems.append(
                f"--resume: {path.name} was saved with data.seq_len={saved['seq_len']}, this run "
                f"has {cfg.data.seq_len}; the data order continues only on the same blocks "
                f"(--set data.seq_len={saved['seq_len']})"
            )
        return problems
    if earlier := checkpoint.complete(cfg.run.output):
        return [
            f"{at}: run.output {cfg.run.output} already holds checkpoints of an earlier run "
            f"(newest {earlier[-1].name}); continue it with --resume, or choose another "
            f"--output (nothing there is overwritten)"
        ]
    if damaged := checkpoint.unreadable(cfg.run.output):
        return [
            f"{at}: run.output {cfg.run.output} already holds checkpoints of an earlier run "
            f"whose meta.json is missing or unreadable ({', '.join(p.name for p in damaged)}: "
            f"damaged); choose another --output, or move them away (nothing there is "
            f"overwritten)"
        ]
    return []
