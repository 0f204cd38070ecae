"""The training configuration: YAML sections validated by pydantic models before any process
starts.

Every error names the key and where its value came from (``file.yaml:LINE``, ``--set``), with a
did-you-mean for unknown keys and names; all problems are reported together in one
:class:`ConfigError`. A capability adds its own section with :func:`register_section` instead of
editing this module; ``python -m hyperparallel.config`` prints the Markdown reference.
"""

from __future__ import annotations

import contextlib
import datetime
import difflib
import functools
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import annotated_types
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    create_model,
    field_validator,
)
from pydantic.fields import FieldInfo

from hyperparallel import registries


class Section(BaseModel):
    """Base of every config section: strict types (an integer is accepted as a number, nothing
    else converts), no unknown keys, read-only after validation. Each field documents itself
    with ``Field(description=...)``; the reference is generated from them."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


def merged(default: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """A mapping setting given in part: ``given`` over ``default``; a key set to null is dropped."""
    return {k: v for k, v in {**default, **given}.items() if v is not None}


def _suggest(key: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(known)}"


def _registered(registry: registries.Registry, name: str) -> str:
    if name not in registry:
        raise ValueError(f"unknown {name!r}{_suggest(name, registry.names())}")
    return name


class RunSection(Section):
    """What to run and where its outputs go."""

    name: str = Field("default", description="run name, shown in the progress bar and the summary")
    output: str = Field(
        "runs/default", description="output directory (checkpoints, metrics, plot, config)"
    )
    seed: int = Field(0, ge=0, lt=2**63, description="seed for model initialisation and data order")
    steps: int = Field(
        300, gt=0, description="optimizer steps to train for (the schedule spans them)"
    )
    stop_at: int | None = Field(
        None,
        gt=0,
        description=(
            "end this invocation after this step (checkpointed); continue with --resume "
            "(a resume at or past it trains on to `steps`)"
        ),
    )
    log_every: int = Field(
        10, gt=0, description="print a progress line every N steps when output is not a terminal"
    )

    @field_validator("output")
    @classmethod
    def _home(cls, value: str) -> str:
        """``~`` is the home directory, as in data.path and model.pretrained; an empty name
        would write into the current directory unasked."""
        if not value.strip():
            raise ValueError("needs a directory name; use '.' for the current directory")
        return os.path.expanduser(value)


DEFAULT_MODEL_TYPE = "llama"
"""The model type of a new model where ``model.type`` is null."""

MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}


PLUGIN_BACKENDS: dict[str, str] = {"dvm": "dvm"}
"""Compile backends that Spore plugins add, by name, with the plugin that adds each: the one
to install when torch does not know the name."""


def backend_problem(name: str, known: Sequence[str] | None = None) -> str | None:
    """What stops ``torch.compile(backend=name)``: a name no installed package registers (with a
    did-you-mean, or the Spore plugin to install), or one whose package fails to load it;
    ``None`` when it loads. ``known``: the names to look in, by default every backend dynamo
    lists (its own, ``torch_dynamo_backends`` entry points, Spore plugins' registrations)."""
    import torch._dynamo

    if known is None:
        known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        if name in PLUGIN_BACKENDS:
            plugin = PLUGIN_BACKENDS[name]
            return (
                f"the torch.compile backend {name!r} comes with the Spore plugin {plugin}, "
                f"which is not installed: pip install -c constraints.txt ./packages/{plugin} "
                f"(from the Spore repository), or choose another backend, e.g. inductor"
            )
        close = difflib.get_close_matches(name, [*known, *PLUGIN_BACKENDS], n=1)
        hint = f"did you mean {close[0]!r}?" if close else "e.g. inductor, spore"
        return f"no torch.compile backend is named {name!r}; {hint} (null: eager)"
    try:
        torch._dynamo.lookup_backend(name)
    except Exception as exc:  # whatever importing the backend's package raises
        return (
            f"the torch.compile backend {name!r} does not load ({type(exc).__name__}: {exc}); "
            f"reinstall the package that provides it, or choose another backend"
        )
    return None


class ModelSection(Section):
    """The model: a transformers architecture built from a config, or a saved directory."""

    type: str | None = Field(
        None,
        description="transformers model type, e.g. llama, qwen2, mistral; null: llama, or with "
        "model.pretrained its saved type (a type given beside model.pretrained must match it)",
    )
    pretrained: str | None = Field(
        None, description="local save_pretrained directory to start from instead"
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="settings of the architecture's config, over its own defaults and, where "
        "it has them and model.pretrained is not set, these small ones: "
        + ", ".join(
            f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in MODEL_CONFIG.items()
        )
        + " (a key set to null keeps the architecture's default; one given under the "
        "architecture's own name, GPT-2's n_layer, replaces the small one); vocab_size comes "
        "from the tokenizer",
    )
    compile: str | None = Field(
        None,
        description="torch.compile backend each decoder layer is compiled with before FSDP2 "
        "wraps it, e.g. inductor, dvm (the dvm plugin), spore (Inductor with Spore's passes); "
        "null: eager. Checkpoints and the export are the same either way",
    )

    @field_validator("compile")
    @classmethod
    def _known_backend(cls, value: str | None) -> str | None:
        if value is not None and (problem := backend_problem(value)):
            raise ValueError(problem)
        return value


class DataSection(Section):
    """Training text: files or the embedded default corpus, packed into fixed-length blocks."""

    path: str | list[str] | None = Field(
        None,
        description="glob(s) of .txt (one document per file) / .jsonl files; null: embedded corpus",
    )
    text_key: str = Field("text", description="the field holding the text in .jsonl lines")
    seq_len: int = Field(
        128, gt=0, description="tokens per training sequence (blocks are packed across documents)"
    )
    batch_size: int = Field(
        16, gt=0, description="sequences per micro-batch on each data-parallel rank"
    )

    @field_validator("path")
    @classmethod
    def _some_glob(cls, value: str | list[str] | None) -> str | list[str] | None:
        """An empty glob or list would read no documents: null is the embedded corpus."""
        globs = [value] if isinstance(value, str) else value or []
        if value is not None and (not globs or not all(g.strip() for g in globs)):
            raise ValueError(
                f"needs one or more non-empty globs, or null for the embedded corpus; got {value!r}"
            )
        return value


class ParallelSection(Section):
    """Processes, sharding and precision."""

    nproc: int = Field(
        1, gt=0, description="local processes to start (--nproc); ignored under torchrun"
    )
    replicate: int = Field(
        1, gt=0, description="HSDP replicate degree: world = replicate x shard; 1 = plain FSDP2"
    )
    mixed_precision: Literal["none", "bf16"] = Field(
        "none", description="FSDP2 compute/communication dtype (reductions stay fp32)"
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each decoder layer in backward"
    )

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _not_fp16(cls, value: Any) -> Any:
        if value == "fp16":  # FSDP2 runs forward and backward in fp16 without a loss scaler
            raise ValueError(
                "fp16 needs loss scaling, which spore train does not do (small fp16 gradients "
                "underflow to zero); use bf16 (fp32's range at fp16's memory) or none"
            )
        return value

    reshard_after_forward: bool = Field(
        True,
        description="free each layer's gathered parameters after forward (false: keep them for "
        "backward, one all-gather less per layer and step for more memory)",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: cuda when available, else cpu"
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="process-group backend; auto: nccl on cuda, gloo on cpu"
    )
    threads: int | None = Field(
        None, gt=0, description="CPU threads per rank; null: usable cores / local ranks"
    )
    init_timeout: float = Field(
        300.0, gt=0, le=7 * 86400, description="seconds to wait for all ranks to join"
    )


class OptimSection(Section):
    """Optimizer (from the optimizer registry), clipping and accumulation."""

    name: str = Field("adamw", description="optimizer name in hyperparallel.registries.optimizers")
    lr: float = Field(3e-3, gt=0, description="peak learning rate")
    weight_decay: float = Field(
        0.1, ge=0, description="decoupled weight decay (not applied to norms and biases)"
    )
    betas: list[float] = Field(
        default_factory=lambda: [0.9, 0.95], description="Adam betas, each in [0, 1)"
    )
    eps: float = Field(1e-8, ge=0, description="Adam epsilon")
    grad_clip: float = Field(
        1.0, ge=0, description="clip the global gradient norm to this; 0 disables"
    )
    grad_accum: int = Field(1, gt=0, description="micro-batches per optimizer step")
    options: dict[str, Any] = Field(
        default_factory=dict, description="extra keyword arguments for the optimizer"
    )

    @field_validator("name")
    @classmethod
    def _known_optimizer(cls, value: str) -> str:
        return _registered(registries.optimizers, value)

    @field_validator("betas")
    @classmethod
    def _two_betas(cls, value: list[float]) -> list[float]:
        if len(value) != 2 or not all(0 <= beta < 1 for beta in value):
            raise ValueError(f"needs two numbers in [0, 1), e.g. [0.9, 0.95], got {value}")
        return value

    @field_validator("options")
    @classmethod
    def _merge_options(cls, value: dict[str, Any]) -> dict[str, Any]:
        return merged({}, value)


class ScheduleSection(Section):
    """Learning-rate schedule (from the schedule registry)."""

    name: str = Field("cosine", description="schedule name in hyperparallel.registries.schedules")
    warmup_steps: int = Field(
        20, ge=0, description="linear warm-up steps from 0 to optim.lr (transformers' convention)"
    )
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="final learning rate as a fraction of optim.lr"
    )

    @field_validator("name")
    @classmethod
    def _known_schedule(cls, value: str) -> str:
        return _registered(registries.schedules, value)


class CheckpointSection(Section):
    """torch.distributed.checkpoint snapshots and the final export."""

    every: int = Field(
        100, ge=0, description="save every N steps (and at the end); 0: only at the end"
    )
    keep: int = Field(
        2, gt=0, description="complete checkpoints kept (the oldest written removed first)"
    )
    export: bool = Field(True, description="write the final weights as a save_pretrained directory")


S = TypeVar("S", bound=Section)


class Config(BaseModel):
    """The validated configuration: one typed section per attribute (``config.optim.lr``);
    sections added with :func:`register_section` are attributes too (see :meth:`section`)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    run: RunSection = Field(default_factory=RunSection)
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    schedule: ScheduleSection = Field(default_factory=ScheduleSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)

    _origins: dict[str, str] = PrivateAttr(default_factory=dict)

    @property
    def origins(self) -> dict[str, str]:
        """``dotted.key -> "file.yaml:LINE"``, ``"--set KEY=VALUE"`` or the option that set it
        (``--output "DIR"``, ``--nproc N``) for every key given."""
        return self._origins

    def section(self, model: type[S]) -> S:
        """The section validated by ``model``: typed access to a registered section."""
        for name, cls in SECTIONS.items():
            if cls is model:
                return typing.cast(S, getattr(self, name))
        raise KeyError(f"no config section is validated by {model.__name__}")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return self.model_dump()

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)


SECTIONS: dict[str, type[Section]] = {
    name: typing.cast(type[Section], field.annotation)
    for name, field in Config.model_fields.items()
}


def register_section(name: str, model: type[Section]) -> None:
    """Add the config section ``name``, validated by ``model`` (a :class:`Section` subclass whose
    fields carry ``Field(description=...)``). It is read from the YAML and ``--set``, checked
    like the built-in sections, listed by :func:`reference`, and read back with
    ``config.section(model)``."""
    if not (isinstance(model, type) and issubclass(model, Section)):
        raise TypeError(f"config section {name!r} must be a hyperparallel.config.Section subclass")
    if name in SECTIONS and SECTIONS[name] is not model:
        raise ValueError(f"config section {name!r} is already registered")
    if not name.isidentifier() or name.startswith("_") or hasattr(BaseModel, name):
        raise ValueError(f"{name!r} cannot name a config section (not a plain attribute name)")
    SECTIONS[name] = model


@functools.cache
def _schema(sections: tuple[tuple[str, type[Section]], ...]) -> type[Config]:
    """:class:`Config`, extended with the registered sections it does not declare."""
    added = {
        name: (model, Field(default_factory=model))
        for name, model in sections
        if name not in Config.model_fields
    }
    if not added:
        return Config
    return typing.cast(type[Config], create_model("Config", __base__=Config, **added))  # type: ignore[call-overload]


class ConfigError(ValueError):
    """One or more configuration problems, each naming its key and where it was set."""

    def __init__(
        self,
        problems: list[str],
        sections: Mapping[str, Section] | None = None,
        origins: Mapping[str, str] | None = None,
    ) -> None:
        self.problems = problems
        self.sections = dict(sections or {})
        """The sections that are valid on their own (checked further by the caller)."""
        self.origins = dict(origins or {})
        head = "invalid training config" + (
            f" ({len(problems)} problems)" if len(problems) > 1 else ""
        )
        super().__init__(head + ":\n" + "\n".join(f"  {p}" for p in problems))


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading numbers as YAML 1.2 does: every exponent float (``1e-3``,
    ``3E+4``, ``1.5e2``, ``.5e3``), which PyYAML, reading YAML 1.1, takes as a string unless it
    has both a dot and a signed exponent; an integer with leading zeros in base 10 (``0300``
    is 300, octal is ``0o``), where YAML 1.1 reads ``0300`` as octal 192; and no base-60
    numbers (YAML 1.1 reads ``1:30`` as 90 and ``1:30.5`` as 90.5; here they are text)."""


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    _INT,
    re.compile(r"^(?:[-+]?[0-9][0-9_]*|[-+]?0b[01_]+|[-+]?0o[0-7_]+|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
_Loader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+.0123456789"),
)


def _read_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """An integer as written: base 10 with or without leading zeros, or ``0b``/``0o``/``0x``."""
    text = str(loader.construct_scalar(node)).replace("_", "")
    prefixed = text.lstrip("+-")[:2] in ("0b", "0o", "0x")
    return int(text, 0) if prefixed else int(text, 10)


_Loader.add_constructor(_INT, _read_int)


def _lines(text: str, source: str) -> tuple[dict[str, str], dict[str, str]]:
    """``dotted.key -> "source:LINE"`` for every mapping key in the YAML text, and
    ``dotted.key -> text`` for every scalar value (as written, before YAML reads it).
    :class:`ConfigError` for a key given twice in one mapping: YAML would keep only the last
    (a second ``optim:`` section dropped every setting of the first), and for a key YAML
    reads as no name (``10:``, ``on:``: a number, a boolean)."""
    where: dict[str, str] = {}
    texts: dict[str, str] = {}
    problems: list[str] = []

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            first: dict[str, str] = {}
            for key, value in node.value:
                path = f"{prefix}{key.value}"
                at = f"{source}:{key.start_mark.line + 1}"
                if key.tag == "tag:yaml.org,2002:merge":
                    problems.append(
                        f"{at}: a YAML merge key (<<) is not supported in a training config; "
                        f"write the merged settings out"
                    )
                    continue
                if key.tag != "tag:yaml.org,2002:str":
                    read = yaml.load(key.value, Loader=_Loader)
                    problems.append(
                        f"{at}: key {key.value!r}{f' in {prefix[:-1]}' if prefix else ''} is "
                        f'read by YAML as {read!r}, not a name; quote it ("{key.value}")'
                    )
                if path in first:
                    problems.append(
                        f"{at}: {path} is given again (first at {first[path]}); YAML keeps only "
                        f"the last: give each key once, merging the two"
                    )
                first[path] = where[path] = at
                if isinstance(value, yaml.ScalarNode):
                    texts[path] = value.value
                walk(value, path + ".")

    root = yaml.compose(text, Loader=_Loader)
    if root is not None:
        walk(root, "")
    if problems:
        raise ConfigError(problems)
    return where, texts


def _parse_yaml(text: str, source: str) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
    """The data, each key's ``source:LINE`` and each scalar's text (see :func:`_lines`)."""
    try:
        data = yaml.load(text, Loader=_Loader)
        lines, texts = _lines(text, source)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"{source}:{mark.line + 1}" if mark is not None else source
        raise ConfigError([f"{at}: not valid YAML: {getattr(exc, 'problem', exc)}"]) from None
    if data is None:
        return {}, lines, texts
    if not isinstance(data, dict):
        raise ConfigError([f"{source}: the top level must be a mapping of sections"])
    return data, lines, texts


def _scalars_as_text(raw: dict[str, Any], texts: Mapping[str, str]) -> None:
    """A number or date given where a setting is a string (``name: 010``, ``--set
    run.output=2024-01-01``) becomes the text as written: YAML read a number or a date, the
    user meant a name. (A boolean stays an error: ``name: yes`` may mean a switch.)"""
    for name, cls in SECTIONS.items():
        section = raw.get(name)
        if not isinstance(section, dict):
            continue
        for key, field in cls.model_fields.items():
            value, text = section.get(key), texts.get(f"{name}.{key}")
            kinds = typing.get_args(field.annotation) or (field.annotation,)
            read = isinstance(value, int | float | datetime.date) and type(value) not in kinds
            read = read and not isinstance(value, bool)
            if str in kinds and read and text is not None:
                section[key] = text


_COMMENT = re.compile(r"(^|\s)#")


def _origin(where: Mapping[str, str], key: str) -> str:
    """Where ``key`` was set: its own origin, else that of a key set under it (an unknown
    section given by ``--set section.name=...``), else its section's, else ``config``."""
    if key in where:
        return where[key]
    under = next((origin for k, origin in where.items() if k.startswith(f"{key}.")), None)
    return under or where.get(key.split(".", 1)[0], "config")


Override = str | tuple[str, str]
"""A ``key.path=value`` override, or one and the option it came from, e.g.
``("run.output=out", "--output out")``, which its errors name instead of ``--set``."""


def _apply_set(
    data: dict[str, Any], origins: dict[str, str], texts: dict[str, str], override: Override
) -> list[str]:
    item, label = (override, f"--set {override}") if isinstance(override, str) else override
    if "=" not in item:
        return [f"{label}: expected key.path=value, e.g. --set optim.lr=1e-3"]
    path, raw = item.split("=", 1)
    keys = path.strip().split(".")
    if len(keys) < 2 or not all(keys):
        return [f"{label}: the key must be section.name, e.g. optim.lr"]
    try:
        value = yaml.load(raw, Loader=_Loader) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    if _COMMENT.search(raw) and raw.strip()[:1] not in ("'", '"'):
        value = raw.strip()  # YAML drops the rest as a comment: a `#` is part of the value
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            return [f"{label}: {key} is not a mapping"]
    node[keys[-1]] = value
    origins[".".join(keys)] = label
    texts[".".join(keys)] = raw.strip()
    return []


def _type_name(tp: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true/false", str: "a string"}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is Literal:
        return _type_name(type(args[0]))
    if tp is type(None):
        return "null"
    if origin is list:
        return f"a list of {_type_name(args[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin is dict or (isinstance(tp, type) and issubclass(tp, BaseModel)):
        return "a mapping"
    return names.get(tp, str(tp))


def _choices(field: FieldInfo) -> tuple[Any, ...]:
    """The allowed values of a ``Literal[...]`` setting (empty for any other)."""
    tp = field.annotation
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else ()


def _range(field: FieldInfo) -> str:
    """The numeric bounds of a setting, as ``> 0`` or ``in [0, 1]`` (empty when unbounded)."""
    bounds = {}
    for item in field.metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if isinstance(item, getattr(annotated_types, attr.capitalize())):
                bounds[sign] = getattr(item, attr)
    if ">=" in bounds and "<=" in bounds:
        return f"in [{bounds['>=']}, {bounds['<=']}]"
    return ", ".join(f"{sign} {value}" for sign, value in bounds.items())


def _describe(error: Any, schema: type[BaseModel], data: Mapping[str, Any]) -> tuple[str, str]:
    """``(dotted key, problem)`` for one pydantic error, worded like the config reference."""
    loc = [str(part) for part in error["loc"]]
    model: Any = schema
    field: FieldInfo | None = None
    value: Any = data
    keys: list[str] = []
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            break
        if part not in model.model_fields:
            break
        keys.append(part)
        field = model.model_fields[part]
        value = value.get(part) if isinstance(value, Mapping) else None
        model = field.annotation
    path = ".".join(keys)
    kind = error["type"]
    if kind == "extra_forbidden":
        unknown = loc[len(keys)]
        known = list(model.model_fields)
        if not keys:
            return unknown, f"unknown section {unknown!r}{_suggest(unknown, known)}"
        key = f"{path}.{unknown}"
        return key, f"unknown key {key}{_suggest(unknown, known)}"
    if field is None:
        return path, f"{path}: {error['msg']}"
    if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
        return path, f"{path}: expected a mapping of settings, got {value!r}"
    if kind == "literal_error":
        options = ", ".join(map(str, _choices(field)))
        return path, f"{path}: {value!r} is not one of {options}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return path, f"{path} must be {_range(field)}, got {value}"
    if kind == "value_error":
        return path, f"{path}: {error['ctx']['error']}"
    if kind == "finite_number":
        return path, f"{path} must be a finite number, got {value}"
    return path, f"{path}: expected {_type_name(field.annotation)}, got {value!r}"


def _check(config: Config, world: int | None) -> list[str]:
    """Rules across settings: combinations that cannot run (``world``: under torchrun)."""
    problems = []

    def at(path: str) -> str:
        return config.origins.get(path, "default")

    nproc, replicate = config.parallel.nproc, config.parallel.replicate
    if world is not None and world % replicate:
        problems.append(
            f"{at('parallel.replicate')}: parallel.replicate={replicate} does not divide "
            f"torchrun's world size {world}; HSDP needs world = replicate x shard"
        )
    elif world is None and nproc % replicate:
        problems.append(
            f"{at('parallel.replicate')}: parallel.replicate={replicate} does not divide "
            f"parallel.nproc={nproc} ({at('parallel.nproc')}); HSDP needs nproc = replicate x "
            f"shard"
        )
    return problems


def notes(config: Config) -> list[str]:
    """Settings that run, but likely not as meant: one line each, naming where it was set."""
    run, warmup = config.run, config.schedule.warmup_steps
    found = []
    if run.stop_at is not None and run.stop_at > run.steps:
        found.append(
            f"{config.origins.get('run.stop_at', 'default')}: run.stop_at={run.stop_at} is past "
            f"run.steps={run.steps}: the run ends at step {run.steps} without stopping there"
        )
    if warmup > run.steps:
        found.append(
            f"{config.origins.get('schedule.warmup_steps', 'default')}: "
            f"schedule.warmup_steps={warmup} is more than run.steps={run.steps}: the learning "
            f"rate is still warming up when the run ends (it would reach optim.lr at step "
            f"{warmup})"
        )
    return found


def build(
    data: Mapping[str, Any] | None = None,
    *,
    origins: Mapping[str, str] | None = None,
    overrides: Sequence[Override] = (),
    world: int | None = None,
    texts: Mapping[str, str] | None = None,
) -> Config:
    """Validate ``data`` (parsed YAML) plus ``--set`` overrides into a :class:`Config`.

    ``world`` is the job's world size when an outside launcher (torchrun) set it; otherwise
    ``parallel.nproc`` is. ``texts``: each scalar's text in the YAML file (see :func:`_lines`).
    """
    raw = {k: ({} if v is None else v) for k, v in dict(data or {}).items()}
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    where = dict(origins or {})
    written = dict(texts or {})
    problems: list[str] = []
    for item in overrides:
        problems += _apply_set(raw, where, written, item)
    _scalars_as_text(raw, written)
    schema = _schema(tuple(SECTIONS.items()))
    valid: dict[str, Section] = {}
    try:
        config = schema.model_validate(raw)
    except ValidationError as exc:
        described: dict[str, str] = {}
        for error in exc.errors():
            key, problem = _describe(error, schema, raw)
            described.setdefault(key, problem)  # a union reports once per member: keep one
        for key, problem in described.items():
            problems.append(f"{_origin(where, key)}: {problem}")
        for name, cls in SECTIONS.items():
            with contextlib.suppress(ValidationError):
                valid[name] = cls.model_validate(raw.get(name, {}))
    else:
        config._origins = where
        problems += _check(config, world)
        valid = {name: getattr(config, name) for name in SECTIONS}
    if problems:
        raise ConfigError(problems, valid, where)
    return config


def load(
    path: str | Path | None = None, overrides: Sequence[Override] = (), world: int | None = None
) -> Config:
    """Read a YAML file (``None``: the embedded defaults) and apply ``key.path=value`` overrides."""
    if path is None:
        return build(overrides=overrides, world=world)
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read the config file: {exc.strerror}"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [f"{path}: not UTF-8 text (byte {exc.start}); save the config as UTF-8"]
        ) from None
    data, origins, texts = _parse_yaml(text, str(path))
    return build(data, origins=origins, overrides=overrides, world=world, texts=texts)


def _shown(field: FieldInfo) -> str:
    default = field.get_default(call_default_factory=True)
    return yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("\n...")


def reference() -> str:
    """The config reference as Markdown: every section and key with type, default and meaning."""
    out: list[str] = []
    for name, model in SECTIONS.items():
        out.append(f"### `{name}`\n\n{(model.__doc__ or '').strip()}\n")
        out.append("| key | type | default | meaning |\n|---|---|---|---|")
        for key, field in model.model_fields.items():
            kind = _type_name(field.annotation)
            if bounds := _range(field):
                kind += f" ({bounds})"
            doc = field.description or ""
            if choices := _choices(field):
                doc += " (" + " / ".join(map(str, choices)) + ")"
            out.append(f"| `{key}` | {kind} | `{_shown(field)}` | {doc} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(reference(), end="")
