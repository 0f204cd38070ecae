"""Build the model a config names: a transformers architecture from its config, or a local
``save_pretrained`` directory; find its decoder layers for per-layer sharding."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import torch

from hyperparallel.config import ModelSection


class ModelConfigError(ValueError):
    """The model section names something transformers cannot build."""


def hf_config(model: ModelSection, vocab_size: int) -> Any:
    """The transformers config for the model section (checked: type and override keys exist)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model.pretrained:
        path = Path(model.pretrained).expanduser()
        if not (path / "config.json").is_file():
            raise ModelConfigError(
                f"model.pretrained: {path} is not a save_pretrained directory (no config.json)"
            )
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        if config.vocab_size < vocab_size:
            raise ModelConfigError(
                f"model.pretrained: vocab_size {config.vocab_size} is smaller than the byte "
                f"tokenizer's {vocab_size}"
            )
        return config
    if model.type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(model.type, list(CONFIG_MAPPING.keys()), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ModelConfigError(f"model.type: transformers has no model type {model.type!r}{hint}")
    default = CONFIG_MAPPING[model.type]()
    unknown = [k for k in model.config if not hasattr(default, k)]
    if unknown:
        known = [k for k in vars(default) if not k.startswith("_")]
        hints = [
            f"{k}"
            + (
                f" (did you mean {m[0]!r}?)"
                if (m := difflib.get_close_matches(k, known, 1))
                else ""
            )
            for k in unknown
        ]
        raise ModelConfigError(f"model.config: {model.type} has no setting {', '.join(hints)}")
    return AutoConfig.for_model(model.type, **{**model.config, "vocab_size": vocab_size})


def build(model: ModelSection, vocab_size: int, seed: int) -> torch.nn.Module:
    """The causal LM, in float32 on CPU, initialised from ``seed`` (same on every rank)."""
    from transformers import AutoModelForCausalLM

    config = hf_config(model, vocab_size)
    torch.manual_seed(seed)
    if model.pretrained:
        built = AutoModelForCausalLM.from_pretrained(
            Path(model.pretrained).expanduser(), local_files_only=True, dtype=torch.float32
        )
    else:
        built = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    built.config.use_cache = False
    return built


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks, by the class names transformers lists in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ModelConfigError(
            f"{type(model).__name__} does not name its decoder layers (_no_split_modules); "
            f"hyperparallel cannot shard it per layer"
        )
    return layers


def parameter_count(model: torch.nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
