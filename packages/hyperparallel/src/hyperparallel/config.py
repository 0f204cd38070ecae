"""The training configuration: YAML sections validated against dataclasses, before any process
starts.

Every error names the key and where its value came from (``file.yaml:LINE``, ``--set``), with a
did-you-mean for unknown keys; all problems are reported together in one :class:`ConfigError`.
New capabilities add a section with :func:`register_section` instead of editing this module.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


def setting(default: Any, doc: str, choices: Sequence[Any] | None = None, **kw: Any) -> Any:
    meta = {"doc": doc, "choices": tuple(choices) if choices else None}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


@dataclass
class RunSection:
    """What to run and where its outputs go."""

    name: str = setting("default", "run name, shown in the progress bar and the summary")
    output: str = setting("runs/default", "output directory (checkpoints, metrics, plot, config)")
    seed: int = setting(0, "seed for model initialisation and data order")
    steps: int = setting(300, "optimizer steps to train for (the schedule spans them)")
    stop_at: int | None = setting(
        None, "end this invocation after this step (checkpointed); continue with --resume"
    )
    log_every: int = setting(
        10, "print a progress line every N steps when output is not a terminal"
    )


@dataclass
class ModelSection:
    """The model: a transformers architecture built from a config, or a saved directory."""

    type: str = setting("llama", "transformers model type, e.g. llama, qwen2, mistral")
    pretrained: str | None = setting(None, "local save_pretrained directory to start from instead")
    config: dict[str, Any] = setting(
        {
            "hidden_size": 128,
            "intermediate_size": 352,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "tie_word_embeddings": True,
        },
        "overrides of the architecture's config, merged over these defaults (a key set to null "
        "is dropped); vocab_size comes from the tokenizer",
    )


@dataclass
class DataSection:
    """Training text: files or the embedded default corpus, packed into fixed-length blocks."""

    path: str | list[str] | None = setting(
        None, "glob(s) of .txt (one document per file) / .jsonl files; null: embedded corpus"
    )
    text_key: str = setting("text", "the field holding the text in .jsonl lines")
    seq_len: int = setting(128, "tokens per training sequence (blocks are packed across documents)")
    batch_size: int = setting(16, "sequences per micro-batch on each data-parallel rank")


@dataclass
class ParallelSection:
    """Processes, sharding and precision."""

    nproc: int = setting(1, "local processes to start (--nproc); ignored under torchrun")
    replicate: int = setting(1, "HSDP replicate degree: world = replicate x shard; 1 = plain FSDP2")
    mixed_precision: str = setting(
        "none", "FSDP2 compute/communication dtype (reductions stay fp32)", ("none", "bf16", "fp16")
    )
    activation_checkpointing: bool = setting(False, "recompute each decoder layer in backward")
    reshard_after_forward: bool = setting(
        True,
        "free each layer's gathered parameters after forward (false: keep them for backward, "
        "one all-gather less per layer and step for more memory)",
    )
    device: str = setting("auto", "auto: cuda when available, else cpu", ("auto", "cpu", "cuda"))
    backend: str = setting(
        "auto", "process-group backend; auto: nccl on cuda, gloo on cpu", ("auto", "gloo", "nccl")
    )
    threads: int | None = setting(None, "CPU threads per rank; null: usable cores / local ranks")
    init_timeout: float = setting(300.0, "seconds to wait for all ranks to join")


@dataclass
class OptimSection:
    """Optimizer (from the optimizer registry), clipping and accumulation."""

    name: str = setting("adamw", "optimizer name in hyperparallel.registries.optimizers")
    lr: float = setting(3e-3, "peak learning rate")
    weight_decay: float = setting(0.1, "decoupled weight decay (not applied to norms and biases)")
    betas: list[float] = setting([0.9, 0.95], "Adam betas")
    eps: float = setting(1e-8, "Adam epsilon")
    grad_clip: float = setting(1.0, "clip the global gradient norm to this; 0 disables")
    grad_accum: int = setting(1, "micro-batches per optimizer step")
    options: dict[str, Any] = setting({}, "extra keyword arguments for the optimizer")


@dataclass
class ScheduleSection:
    """Learning-rate schedule (from the schedule registry)."""

    name: str = setting("cosine", "schedule name in hyperparallel.registries.schedules")
    warmup_steps: int = setting(20, "linear warm-up steps from 0 to optim.lr")
    min_lr_ratio: float = setting(0.1, "final learning rate as a fraction of optim.lr")


@dataclass
class CheckpointSection:
    """torch.distributed.checkpoint snapshots and the final export."""

    every: int = setting(100, "save every N steps (and at the end); 0: only at the end")
    keep: int = setting(2, "complete checkpoints kept (oldest removed first)")
    export: bool = setting(True, "write the final weights as a save_pretrained directory")


SECTIONS: dict[str, type] = {
    "run": RunSection,
    "model": ModelSection,
    "data": DataSection,
    "parallel": ParallelSection,
    "optim": OptimSection,
    "schedule": ScheduleSection,
    "checkpoint": CheckpointSection,
}


def register_section(name: str, cls: type) -> None:
    """Add a config section (a dataclass with ``_f``-style documented fields)."""
    if name in SECTIONS and SECTIONS[name] is not cls:
        raise ValueError(f"config section {name!r} is already registered")
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"config section {name!r} must be a dataclass, got {cls!r}")
    SECTIONS[name] = cls


class Config:
    """The validated configuration: one attribute per section (``config.optim.lr``)."""

    def __init__(self, sections: dict[str, Any], origins: dict[str, str]) -> None:
        self._sections = sections
        self.origins = origins

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_sections"][name]
        except KeyError:
            raise AttributeError(f"no config section {name!r}") from None

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(s) for name, s in self._sections.items()}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


class ConfigError(ValueError):
    """One or more configuration problems, each naming its key and where it was set."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        head = "invalid training config" + (
            f" ({len(problems)} problems)" if len(problems) > 1 else ""
        )
        super().__init__(head + ":\n" + "\n".join(f"  {p}" for p in problems))


def _lines(text: str, source: str) -> dict[str, str]:
    """``dotted.key -> "source:LINE"`` for every mapping key in the YAML text."""
    where: dict[str, str] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                path = f"{prefix}{key.value}"
                where[path] = f"{source}:{key.start_mark.line + 1}"
                walk(value, path + ".")

    root = yaml.compose(text)
    if root is not None:
        walk(root, "")
    return where


def _parse_yaml(text: str, source: str) -> tuple[dict[str, Any], dict[str, str]]:
    try:
        data = yaml.safe_load(text)
        lines = _lines(text, source)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"{source}:{mark.line + 1}" if mark is not None else source
        raise ConfigError([f"{at}: not valid YAML: {getattr(exc, 'problem', exc)}"]) from None
    if data is None:
        return {}, lines
    if not isinstance(data, dict):
        raise ConfigError([f"{source}: the top level must be a mapping of sections"])
    return data, lines


def _apply_set(data: dict[str, Any], origins: dict[str, str], item: str) -> list[str]:
    if "=" not in item:
        return [f"--set {item}: expected key.path=value, e.g. --set optim.lr=1e-3"]
    path, raw = item.split("=", 1)
    keys = path.strip().split(".")
    if len(keys) < 2 or not all(keys):
        return [f"--set {item}: the key must be section.name, e.g. optim.lr"]
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            return [f"--set {item}: {key} is not a mapping"]
    node[keys[-1]] = value
    origins[".".join(keys)] = f"--set {item}"
    return []


def _type_name(tp: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true/false", str: "a string"}
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(args[0]).removeprefix('a ').removeprefix('an ')}s"
    if typing.get_origin(tp) is dict:
        return "a mapping"
    return names.get(tp, str(tp))


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """(ok, value converted to ``tp``): ints are accepted as floats, nothing else converts."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            ok, out = _coerce(value, arg)
            if ok:
                return True, out
        return False, value
    if tp is type(None):
        return value is None, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, value
    if tp is str:
        return isinstance(value, str), value
    if origin is list:
        if not isinstance(value, list):
            return False, value
        items = [_coerce(v, args[0]) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if origin is dict:
        return isinstance(value, dict), value
    return isinstance(value, tp), value


def _suggest(key: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(known)}"


def _build_section(
    name: str, cls: type, values: Any, origins: dict[str, str], problems: list[str]
) -> Any:
    where = origins.get(name, "config")
    if values is None:
        values = {}
    if not isinstance(values, dict):
        problems.append(f"{where}: {name}: expected a mapping of settings, got {values!r}")
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        path = f"{name}.{key}"
        at = origins.get(path, where)
        if key not in fields:
            problems.append(f"{at}: unknown key {path}{_suggest(str(key), list(fields))}")
            continue
        ok, converted = _coerce(value, hints[key])
        if not ok:
            problems.append(f"{at}: {path}: expected {_type_name(hints[key])}, got {value!r}")
            continue
        choices = fields[key].metadata.get("choices")
        if choices and converted not in choices:
            options = ", ".join(map(str, choices))
            problems.append(f"{at}: {path}: {converted!r} is not one of {options}")
            continue
        if isinstance(converted, dict):
            default = fields[key].default_factory()  # mappings merge over their defaults
            converted = {k: v for k, v in {**default, **converted}.items() if v is not None}
        kwargs[key] = converted
    return cls(**kwargs)


def _check(config: Config, problems: list[str], world: int | None) -> None:
    """Cross-field rules: ranges and combinations that cannot run (``world``: under torchrun)."""
    from hyperparallel import registries

    def at(path: str) -> str:
        return config.origins.get(path, "default")

    positive = [
        ("run.steps", config.run.steps),
        ("run.log_every", config.run.log_every),
        ("data.seq_len", config.data.seq_len),
        ("data.batch_size", config.data.batch_size),
        ("parallel.nproc", config.parallel.nproc),
        ("parallel.replicate", config.parallel.replicate),
        ("optim.grad_accum", config.optim.grad_accum),
        ("checkpoint.keep", config.checkpoint.keep),
        ("parallel.init_timeout", config.parallel.init_timeout),
        ("optim.lr", config.optim.lr),
    ]
    for path, value in positive:
        if value <= 0:
            problems.append(f"{at(path)}: {path} must be > 0, got {value}")
    for path, value in [
        ("checkpoint.every", config.checkpoint.every),
        ("optim.grad_clip", config.optim.grad_clip),
        ("optim.weight_decay", config.optim.weight_decay),
        ("schedule.warmup_steps", config.schedule.warmup_steps),
    ]:
        if value < 0:
            problems.append(f"{at(path)}: {path} must be >= 0, got {value}")
    if config.parallel.threads is not None and config.parallel.threads <= 0:
        problems.append(
            f"{at('parallel.threads')}: parallel.threads must be > 0, got {config.parallel.threads}"
        )
    if config.run.stop_at is not None and config.run.stop_at <= 0:
        problems.append(f"{at('run.stop_at')}: run.stop_at must be > 0, got {config.run.stop_at}")
    if not 0 <= config.schedule.min_lr_ratio <= 1:
        problems.append(
            f"{at('schedule.min_lr_ratio')}: schedule.min_lr_ratio must be in [0, 1], "
            f"got {config.schedule.min_lr_ratio}"
        )
    if len(config.optim.betas) != 2:
        problems.append(f"{at('optim.betas')}: optim.betas needs two numbers, e.g. [0.9, 0.95]")
    nproc, replicate = config.parallel.nproc, config.parallel.replicate
    if world is not None and replicate > 0 and world % replicate:
        problems.append(
            f"{at('parallel.replicate')}: parallel.replicate={replicate} does not divide "
            f"torchrun's world size {world}; HSDP needs world = replicate x shard"
        )
    elif world is None and nproc > 0 and replicate > 0 and nproc % replicate:
        problems.append(
            f"{at('parallel.replicate')}: parallel.replicate={replicate} does not divide "
            f"parallel.nproc={nproc} ({at('parallel.nproc')}); HSDP needs nproc = replicate x "
            f"shard"
        )
    if config.parallel.backend == "nccl" and config.parallel.device == "cpu":
        problems.append(
            f"{at('parallel.backend')}: parallel.backend=nccl needs parallel.device cuda "
            f"(gloo runs on cpu)"
        )
    for path, registry in (
        ("optim.name", registries.optimizers),
        ("schedule.name", registries.schedules),
    ):
        section, key = path.split(".")
        name = getattr(getattr(config, section), key)
        if name not in registry:
            problems.append(
                f"{at(path)}: {path}: unknown {name!r}{_suggest(name, registry.names())}"
            )
    max_pos = config.model.config.get("max_position_embeddings")
    if isinstance(max_pos, int) and config.data.seq_len > max_pos:
        problems.append(
            f"{at('data.seq_len')}: data.seq_len={config.data.seq_len} exceeds "
            f"model.config.max_position_embeddings={max_pos}"
        )


def build(
    data: Mapping[str, Any] | None = None,
    *,
    origins: Mapping[str, str] | None = None,
    overrides: Sequence[str] = (),
    world: int | None = None,
) -> Config:
    """Validate ``data`` (parsed YAML) plus ``--set`` overrides into a :class:`Config`.

    ``world`` is the job's world size when an outside launcher (torchrun) set it; otherwise
    ``parallel.nproc`` is.
    """
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in dict(data or {}).items()}
    where = dict(origins or {})
    problems: list[str] = []
    for item in overrides:
        problems += _apply_set(raw, where, item)
    sections: dict[str, Any] = {}
    for name in raw:
        if name not in SECTIONS:
            at = where.get(str(name), "config")
            problems.append(f"{at}: unknown section {name!r}{_suggest(str(name), list(SECTIONS))}")
    for name, cls in SECTIONS.items():
        sections[name] = _build_section(name, cls, raw.get(name), where, problems)
    config = Config(sections, where)
    if not problems:
        _check(config, problems, world)
    if problems:
        raise ConfigError(problems)
    return config


def load(
    path: str | Path | None = None, overrides: Sequence[str] = (), world: int | None = None
) -> Config:
    """Read a YAML file (``None``: the embedded defaults) and apply ``key.path=value`` overrides."""
    if path is None:
        return build(overrides=overrides, world=world)
    source = Path(path)
    try:
        text = source.read_text()
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read the config file: {exc.strerror}"]) from None
    data, origins = _parse_yaml(text, str(path))
    return build(data, origins=origins, overrides=overrides, world=world)


def reference() -> str:
    """The config reference as Markdown: every section and key with type, default and meaning."""
    out: list[str] = []
    for name, cls in SECTIONS.items():
        out.append(f"### `{name}`\n\n{(cls.__doc__ or '').strip()}\n")
        out.append("| key | type | default | meaning |\n|---|---|---|---|")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            )
            shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("\n...")
            doc = f.metadata.get("doc", "")
            if f.metadata.get("choices"):
                doc += " (" + " / ".join(map(str, f.metadata["choices"])) + ")"
            out.append(f"| `{f.name}` | {_type_name(hints[f.name])} | `{shown}` | {doc} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(reference(), end="")
