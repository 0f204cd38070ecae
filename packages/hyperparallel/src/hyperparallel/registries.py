"""Name -> builder registries the config refers to (``optim.name``, ``schedule.name``).

Later capabilities add entries (e.g. an optimizer) with ``optimizers.register("name")``; a
schedule also says which ``schedule.*`` settings it reads, ``schedules.register("name",
reads={"warmup_steps"})``, so that a resume compares only those with its checkpoint's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
from torch.optim.lr_scheduler import LRScheduler

if TYPE_CHECKING:
    from hyperparallel.config import OptimSection, ScheduleSection

F = TypeVar("F", bound=Callable[..., Any])

OptimizerBuilder = Callable[[torch.nn.Module, "OptimSection"], torch.optim.Optimizer]
"""``(model, optim section) -> optimizer`` over the model's parameters."""

ScheduleBuilder = Callable[[torch.optim.Optimizer, "ScheduleSection", int], LRScheduler]
"""``(optimizer, schedule section, run.steps) -> scheduler``, stepped once per optimizer step."""


class Registry(Generic[F]):
    """A small name -> builder mapping with clear errors."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            if name in self._items and self._items[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = fn
            return fn

        return add

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def names(self) -> list[str]:
        return sorted(self._items)

    def get(self, name: str) -> F:
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(
                f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}"
            ) from None


class ScheduleRegistry(Registry[ScheduleBuilder]):
    """The schedules, each with the ``schedule.*`` settings its registration says it reads
    (``reads=``; ``name`` may be among them, and a resume compares it either way), or None
    where it did not say."""

    def __init__(self) -> None:
        super().__init__("schedule")
        self._reads: dict[str, frozenset[str] | None] = {}

    def register(
        self, name: str, *, reads: Iterable[str] | None = None
    ) -> Callable[[ScheduleBuilder], ScheduleBuilder]:
        """Add the builder ``name``; ``reads``: the ``schedule.*`` settings it reads, which a
        resume compares with its checkpoint's (None, the default: unknown, so all are)."""
        if isinstance(reads, str):  # its letters would be taken as the settings
            raise TypeError(f"schedule {name!r}: reads= takes a set of names, got {reads!r}")
        declared = None if reads is None else frozenset(reads)
        add = super().register(name)

        def add_with_reads(fn: ScheduleBuilder) -> ScheduleBuilder:
            add(fn)
            self._reads[name] = declared
            return fn

        return add_with_reads

    def reads(self, name: str) -> frozenset[str] | None:
        """The ``schedule.*`` settings schedule ``name`` reads; None when it did not say (or
        is not registered)."""
        return self._reads.get(name)


optimizers: Registry[OptimizerBuilder] = Registry("optimizer")
schedules = ScheduleRegistry()


def _decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only: norms, biases and other 1-D parameters get none."""
    decay, plain = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else plain).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


@optimizers.register("adamw")
def adamw(model: torch.nn.Module, optim: OptimSection) -> torch.optim.Optimizer:
    """torch.optim.AdamW over the model's parameters (foreach; decay on matrices only)."""
    if "weight_decay" in optim.options:  # each group's own decay would win over it
        raise ValueError("set optim.weight_decay, not optim.options.weight_decay")
    beta1, beta2 = optim.betas
    return torch.optim.AdamW(
        _decay_groups(model, optim.weight_decay),
        lr=optim.lr,
        betas=(beta1, beta2),
        eps=optim.eps,
        **optim.options,
    )


# The schedules are transformers' (as its Trainer uses them): the warm-up rises linearly from 0
# at step 0 to the peak at step warmup_steps; the decay reaches min_lr_ratio at step run.steps.


@schedules.register("constant", reads={"warmup_steps"})
def constant(
    optimizer: torch.optim.Optimizer, schedule: ScheduleSection, steps: int
) -> LRScheduler:
    """Linear warm-up, then the peak rate."""
    from transformers import get_constant_schedule_with_warmup

    return get_constant_schedule_with_warmup(optimizer, schedule.warmup_steps)


@schedules.register("cosine", reads={"warmup_steps", "min_lr_ratio"})
def cosine(optimizer: torch.optim.Optimizer, schedule: ScheduleSection, steps: int) -> LRScheduler:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` of the peak at the last step."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, schedule.warmup_steps, steps, min_lr_rate=schedule.min_lr_ratio
    )


@schedules.register("linear", reads={"warmup_steps", "min_lr_ratio"})
def linear(optimizer: torch.optim.Optimizer, schedule: ScheduleSection, steps: int) -> LRScheduler:
    """Linear warm-up, then linear decay to ``min_lr_ratio`` of the peak at the last step
    (transformers' polynomial decay of power 1 down to that rate)."""
    from transformers import get_polynomial_decay_schedule_with_warmup

    if schedule.min_lr_ratio == 1:  # no decay; transformers wants a final rate below the peak
        return constant(optimizer, schedule, steps)
    peak = optimizer.defaults["lr"]
    return get_polynomial_decay_schedule_with_warmup(
        optimizer,
        schedule.warmup_steps,
        max(steps, schedule.warmup_steps + 1),  # decay over at least one step
        lr_end=schedule.min_lr_ratio * peak,
        power=1.0,
    )
