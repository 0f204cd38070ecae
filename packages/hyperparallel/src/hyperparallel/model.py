"""Build the model a config names: a transformers architecture from its config, or a local
``save_pretrained`` directory; find its decoder layers for per-layer sharding."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import torch

from hyperparallel.config import MODEL_CONFIG, ModelSection, merged


class ModelConfigError(ValueError):
    """The model section names something transformers cannot build; ``keys`` are the settings
    at fault (dotted, e.g. ``model.config.hiden_size``), where the message's prefix is not."""

    def __init__(self, message: str, keys: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.keys = keys


def _base_config(model: ModelSection) -> Any:
    """The architecture's own config: the pretrained directory's, or the model type's default."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model.pretrained:
        path = Path(model.pretrained).expanduser()
        if not (path / "config.json").is_file():
            raise ModelConfigError(
                f"model.pretrained: {path} is not a save_pretrained directory (no config.json)"
            )
        return AutoConfig.from_pretrained(path, local_files_only=True)
    if model.type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(model.type, list(CONFIG_MAPPING.keys()), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ModelConfigError(f"model.type: transformers has no model type {model.type!r}{hint}")
    return CONFIG_MAPPING[model.type]()


def settings(model: ModelSection) -> dict[str, Any]:
    """The config settings the model is built with: ``model.config`` over Spore's small defaults
    (:data:`MODEL_CONFIG`, only those the architecture has, none over a pretrained model).

    A default yields to a setting given under the architecture's own name for it (GPT-2's
    ``n_layer`` for ``num_hidden_layers``), null included. Raises :class:`ModelConfigError`
    for a key the user set that the architecture lacks, or for two keys naming one setting.
    """
    base = _base_config(model)
    name = "model.pretrained's config" if model.pretrained else model.type
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
            for k, v in MODEL_CONFIG.items()
            if hasattr(base, k) and aliases.get(k, k) not in yours
        }
    )
    return merged(defaults, model.config)


def hf_config(model: ModelSection, vocab_size: int) -> Any:
    """The transformers config for the model section (checked: type and setting keys exist)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    given = settings(model)
    try:
        if model.pretrained:
            path = Path(model.pretrained).expanduser()
            config = AutoConfig.from_pretrained(path, local_files_only=True, **given)
        else:
            config = AutoConfig.for_model(model.type, **{**given, "vocab_size": vocab_size})
    except (ValueError, TypeError, StrictDataclassError) as exc:  # transformers' own checks
        keys = tuple(f"model.config.{k}" for k in model.config) or ("model.type",)
        raise ModelConfigError(
            f"{keys[0]}: transformers refused the model config: {exc}", keys
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
    return [f"{k} {saved.get(k)} -> {v}" for k, v in shapes(built).items() if saved.get(k) != v]


def shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Each state-dict entry's shape, by name."""
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def max_length(config: Any) -> int | None:
    """The longest sequence the architecture's positions cover (None: it names no limit)."""
    value = getattr(config, "max_position_embeddings", None)
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
    but for a block holding a parameter tied to one outside it (BERT's embeddings, tied to
    its LM head): FSDP2 shards a parameter in one group only, so the root's group keeps it."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    every = list(model.named_parameters(remove_duplicate=False))
    layers = []
    for prefix, module in model.named_modules():
        if type(module).__name__ not in names:
            continue
        inside = {id(p) for p in module.parameters()}
        if not any(id(p) in inside and not n.startswith(f"{prefix}.") for n, p in every):
            layers.append(module)
    if not layers:
        raise ModelConfigError(
            f"{type(model).__name__} does not name its decoder layers (_no_split_modules); "
            f"hyperparallel cannot shard it per layer"
        )
    return layers


def parameter_count(model: torch.nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
