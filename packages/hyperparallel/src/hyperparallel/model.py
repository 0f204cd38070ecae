"""Build the model a config names: a transformers architecture from its config, or a local
``save_pretrained`` directory; find its decoder layers for per-layer sharding."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

import torch

from hyperparallel.config import DEFAULT_MODEL_TYPE, MODEL_CONFIG, ModelSection, merged
from hyperparallel.data import ByteTokenizer


class ModelConfigError(ValueError):
    """The model section names something transformers cannot build; ``keys`` are the settings
    at fault (dotted, e.g. ``model.config.hiden_size``), where the message's prefix is not."""

    def __init__(self, message: str, keys: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.keys = keys


WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
"""The weight files ``from_pretrained`` loads from a local directory, in the order it looks."""


def type_name(model: ModelSection) -> str:
    """The model type a new model is built as: ``model.type``, :data:`DEFAULT_MODEL_TYPE`
    where it is null (over ``model.pretrained`` the saved config's type is built)."""
    return model.type or DEFAULT_MODEL_TYPE


def _base_config(model: ModelSection) -> Any:
    """The architecture's own config: the pretrained directory's, or the model type's default.
    Raises :class:`ModelConfigError` for a directory without config.json or weights, a
    ``model.type`` other than its saved one, and a type with no causal-LM class."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model.pretrained:
        path = Path(model.pretrained).expanduser()
        if not (path / "config.json").is_file():
            raise ModelConfigError(
                f"model.pretrained: {path} is not a save_pretrained directory (no config.json)"
            )
        if problem := _weights_problem(path):
            raise ModelConfigError(f"model.pretrained: {problem}")
        try:
            base = AutoConfig.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # unreadable JSON, a type transformers does not know, ...
            raise ModelConfigError(
                f"model.pretrained: transformers cannot read {path / 'config.json'} "
                f"({type(exc).__name__}: {_one_line(exc)})"
            ) from None
        if model.type is not None and model.type != base.model_type:
            raise ModelConfigError(
                f"model.type: {model.type}, but model.pretrained {path} holds a "
                f"{base.model_type} model (its config.json); set model.type to "
                f"{base.model_type} or null (with model.pretrained the saved config's type is "
                f"used), or drop model.pretrained to train a new {model.type}"
            )
        _check_causal(base, f"model.pretrained: {base.model_type} (in {path})")
        return base
    kind = type_name(model)
    if kind not in CONFIG_MAPPING:
        close = difflib.get_close_matches(kind, list(CONFIG_MAPPING.keys()), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ModelConfigError(f"model.type: transformers has no model type {kind!r}{hint}")
    base = CONFIG_MAPPING[kind]()
    _check_causal(base, f"model.type: {kind}")
    return base


def _weights_problem(path: Path) -> str | None:
    """Why ``from_pretrained`` finds no weights in the directory ``path``: none of
    :data:`WEIGHTS` is there, or its shard index is unreadable or names a missing shard; None
    when they are there."""
    found = next((name for name in WEIGHTS if (path / name).is_file()), None)
    if found is None:
        return (
            f"{path} has a config.json but no weights (looked for {', '.join(WEIGHTS)}); point "
            f"model.pretrained at the save_pretrained directory that holds them, or drop "
            f"model.pretrained to train a new model from model.type and model.config"
        )
    if not found.endswith(".index.json"):
        return _damaged(path / found)
    try:
        shards = set(json.loads((path / found).read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{path}: {found} is not a readable shard index ({type(exc).__name__}: {exc})"
    if missing := sorted(name for name in shards if not (path / name).is_file()):
        return (
            f"{path}: {found} names {', '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not there; copy the missing shard(s) "
            f"into it (an interrupted download or copy leaves them out)"
        )
    return next(filter(None, (_damaged(path / name) for name in sorted(shards))), None)


def _damaged(weights: Path) -> str | None:
    """Why the safetensors file ``weights`` cannot be loaded (its header unreadable, or the
    file shorter than the header says: a cut copy); None when it opens, or is not one."""
    if weights.suffix != ".safetensors":
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt"):
            return None
    except Exception as exc:  # SafetensorError is no OSError or ValueError
        return (
            f"{weights} is damaged or incomplete ({_one_line(exc)}); copy it again (an "
            f"interrupted download or copy leaves it short)"
        )


def _one_line(exc: BaseException) -> str:
    """``exc``'s message on one line (transformers' span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def _check_causal(base: Any, given: str) -> None:
    """Raise :class:`ModelConfigError` where transformers has no causal-LM class for ``base``'s
    model type; ``given`` starts the message (the setting and the type)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if base.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return
    what = "an encoder-decoder" if base.is_encoder_decoder else "not a text decoder"
    raise ModelConfigError(
        f"{given} is {what}: transformers has no causal-LM class for it "
        f"(AutoModelForCausalLM), and spore train trains causal LMs only; choose a decoder "
        f"type, e.g. llama, qwen2, mistral, gpt2 (the full list: "
        f"transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)"
    )


def settings(model: ModelSection) -> dict[str, Any]:
    """The config settings the model is built with: ``model.config`` over Spore's small defaults
    (:data:`MODEL_CONFIG`, and the byte tokenizer's special-token ids where the type's own lie
    outside its vocabulary: :func:`_special_tokens`; only those the architecture has, none over
    a pretrained model).

    A default yields to a setting given under the architecture's own name for it (GPT-2's
    ``n_layer`` for ``num_hidden_layers``), null included. Raises :class:`ModelConfigError`
    for a key the user set that the architecture lacks, or for two keys naming one setting.
    """
    base = _base_config(model)
    name = "model.pretrained's config" if model.pretrained else type_name(model)
    unknown = [k for k, v in model.config.items() if v is not None and not hasattr(base, k)]
    if unknown:
        known = [k for k in vars(base) if not k.startswith("_")]
        hints = [
            f"{k}"
            + (
                f" (did you mean {m[0]!r}?)"
                if (m := difflib.get_close_matches(k, known, 1))
                else ""
            )
            for k in unknown
        ]
        raise ModelConfigError(
            f"model.config: {name} has no setting {', '.join(hints)}",
            tuple(f"model.config.{k}" for k in unknown),
        )
    aliases = getattr(base, "attribute_map", {})  # e.g. GPT-2's hidden_size -> n_embd
    given: dict[str, str] = {}
    for key in (k for k, v in model.config.items() if v is not None):
        if (same := given.setdefault(aliases.get(key, key), key)) != key:
            raise ModelConfigError(
                f"model.config: {same} and {key} are one setting of {name}; give only one",
                (f"model.config.{same}", f"model.config.{key}"),
            )
    yours = {aliases.get(k, k) for k in model.config}  # null too: the architecture's default
    defaults = (
        {}
        if model.pretrained
        else {
            k: v
            for k, v in {**MODEL_CONFIG, **_special_tokens(base)}.items()
            if hasattr(base, k) and aliases.get(k, k) not in yours
        }
    )
    return merged(defaults, model.config)


def hf_config(model: ModelSection, vocab_size: int) -> Any:
    """The transformers config for the model section (checked: type and setting keys exist)."""
    from transformers import AutoConfig

    given = settings(model)
    try:
        if model.pretrained:
            path = Path(model.pretrained).expanduser()
            config = AutoConfig.from_pretrained(path, local_files_only=True, **given)
        else:
            config = AutoConfig.for_model(type_name(model), **{**given, "vocab_size": vocab_size})
    except Exception as exc:  # transformers' own checks (ValueError, NotImplementedError, ...)
        keys = tuple(f"model.config.{k}" for k in model.config) or ("model.type",)
        raise ModelConfigError(
            f"{keys[0]}: transformers refused the model config "
            f"({type(exc).__name__}: {_one_line(exc)})",
            keys,
        ) from None
    if model.pretrained and config.vocab_size < vocab_size:
        raise ModelConfigError(
            f"model.pretrained: vocab_size {config.vocab_size} is smaller than the byte "
            f"tokenizer's {vocab_size}"
        )
    if not config.is_encoder_decoder:
        # an encoder-style type (BERT, RoBERTa) as a causal LM attends causally only as a
        # decoder: without it each position would see the tokens it is trained to predict
        config.is_decoder = True
    return config


def _special_tokens(base: Any) -> dict[str, int]:
    """The byte tokenizer's pad, bos and eos ids (:class:`ByteTokenizer`) for those of a new
    model type's defaults ``base`` outside its vocabulary (phi3's pad id 32000 fails its
    embedding)."""
    own = {
        "pad_token_id": ByteTokenizer.pad_id,
        "bos_token_id": ByteTokenizer.bos_id,
        "eos_token_id": ByteTokenizer.eos_id,
    }
    return {
        key: value
        for key, value in own.items()
        if isinstance(v := setting(base, key), int) and not 0 <= v < ByteTokenizer.vocab_size
    }


def on_meta(config: Any) -> torch.nn.Module:
    """The causal LM for ``config`` built on the meta device: no memory, no initialisation."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def reshaped(model: ModelSection, built: torch.nn.Module) -> list[str]:
    """The parameters whose shapes ``model.config`` changes over a pretrained model (their
    weights would not load), as ``"name (saved) -> (asked)"``; ``built`` is the model of
    :func:`hf_config`'s config on the meta device (:func:`on_meta`). Empty without overrides."""
    if not model.pretrained or not merged({}, model.config):
        return []
    saved = shapes(on_meta(_base_config(model)))
    return [
        f"{k} {shown(saved.get(k))} -> {shown(v)}"
        for k, v in shapes(built).items()
        if saved.get(k) != v
    ]


def shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Each state-dict entry's shape, by name."""
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def shown(shape: tuple[int, ...] | None) -> str:
    """A state-dict entry's shape in a message, ``absent`` where the model lacks the entry."""
    return "absent" if shape is None else str(shape)


def setting(config: Any, key: str) -> Any:
    """``config.<key>``; None where the config lacks it or refuses to give one value (some
    configs raise for a setting that differs per layer)."""
    try:
        return getattr(config, key, None)
    except Exception:
        return None


def max_length(config: Any) -> int | None:
    """The longest sequence the architecture's positions cover (None: it names no limit)."""
    value = setting(config, "max_position_embeddings")
    return value if isinstance(value, int) else None


def build(model: ModelSection, vocab_size: int, seed: int) -> torch.nn.Module:
    """The causal LM, in float32 on CPU, initialised from ``seed`` (same on every rank)."""
    from transformers import AutoModelForCausalLM

    config = hf_config(model, vocab_size)
    torch.manual_seed(seed)
    if model.pretrained:
        built = AutoModelForCausalLM.from_pretrained(
            Path(model.pretrained).expanduser(),
            config=config,
            local_files_only=True,
            dtype=torch.float32,
        )
    else:
        built = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    built.config.use_cache = False
    return built


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks, by the class names transformers lists in ``_no_split_modules``,
    outermost only (Mamba lists its mixer and the block holding it, mBART its attention and
    layers: FSDP2 cannot shard a module inside one it sharded), but for a block holding a
    parameter tied to one outside it (BERT's embeddings, tied to its LM head): FSDP2 shards a
    parameter in one group only, so the root's group keeps it."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    every = list(model.named_parameters(remove_duplicate=False))
    layers = []
    taken: list[str] = []  # the chosen blocks' prefixes (named_modules yields parents first)
    for prefix, module in model.named_modules():
        if type(module).__name__ not in names or any(prefix.startswith(t) for t in taken):
            continue
        inside = {id(p) for p in module.parameters()}
        if not any(id(p) in inside and not n.startswith(f"{prefix}.") for n, p in every):
            layers.append(module)
            taken.append(f"{prefix}.")
    if not layers:
        raise ModelConfigError(
            f"{type(model).__name__} does not name its decoder layers (_no_split_modules); "
            f"hyperparallel cannot shard it per layer"
        )
    return layers


def parameter_count(model: torch.nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
