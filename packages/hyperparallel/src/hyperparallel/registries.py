"""Name -> builder registries the config refers to (``optim.name``, ``schedule.name``).

Later capabilities add entries (e.g. an optimizer) with ``optimizers.register("name")``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch


class Registry:
    """A small name -> builder mapping with clear errors."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, Callable[..., Any]] = {}

    def register(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def add(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self._items and self._items[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = fn
            return fn

        return add

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def names(self) -> list[str]:
        return sorted(self._items)

    def get(self, name: str) -> Callable[..., Any]:
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(
                f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}"
            ) from None


optimizers = Registry("optimizer")
schedules = Registry("schedule")


def _decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only: norms, biases and other 1-D parameters get none."""
    decay, plain = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else plain).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


@optimizers.register("adamw")
def adamw(model: torch.nn.Module, optim: Any) -> torch.optim.Optimizer:
    """torch.optim.AdamW over the model's parameters (foreach; decay on matrices only)."""
    return torch.optim.AdamW(
        _decay_groups(model, optim.weight_decay),
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
        **optim.options,
    )


def _lambda(fn: Callable[[int], float]) -> Callable[[torch.optim.Optimizer], Any]:
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, fn)


@schedules.register("constant")
def constant(schedule: Any, steps: int) -> Callable[[torch.optim.Optimizer], Any]:
    """Linear warm-up, then the peak rate."""
    warm = schedule.warmup_steps
    return _lambda(lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)


@schedules.register("cosine")
def cosine(schedule: Any, steps: int) -> Callable[[torch.optim.Optimizer], Any]:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` of the peak at the last step."""
    warm, floor = schedule.warmup_steps, schedule.min_lr_ratio

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = min(1.0, (step - warm) / max(1, steps - warm))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return _lambda(factor)


@schedules.register("linear")
def linear(schedule: Any, steps: int) -> Callable[[torch.optim.Optimizer], Any]:
    """Linear warm-up, then linear decay to ``min_lr_ratio`` of the peak at the last step."""
    warm, floor = schedule.warmup_steps, schedule.min_lr_ratio

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = min(1.0, (step - warm) / max(1, steps - warm))
        return 1 - (1 - floor) * progress

    return _lambda(factor)
