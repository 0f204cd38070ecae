"""Custom graph passes for Inductor: ``spore.register_custom_pass``, one multiplexer per slot.

Stages map to Inductor's config slots: ``pre_grad`` → ``pre_grad_custom_pass``, ``joint`` →
``joint_custom_post_pass``, ``post_grad`` → ``post_grad_custom_post_pass``. The first
registration for a stage installs Spore's multiplexer in that slot; it runs whatever the slot
held before (a user's pass is chained, never overwritten), then the registered passes in
priority order (highest first), skipping those whose ``device`` filter does not match the
graph. Its ``uuid()`` combines the stage, every pass's name, version and owner, the owners'
versions and the chained pass's uuid, so Inductor's FX graph cache is neither bypassed nor
stale. Passes must be idempotent (joint passes can run twice).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spore.registry import Registry

STAGES = {
    "pre_grad": "pre_grad_custom_pass",
    "joint": "joint_custom_post_pass",
    "post_grad": "post_grad_custom_post_pass",
}

_lock = threading.Lock()
_stats: dict[str, int] = {}


class GraphPass:
    """A whole-graph pass: ``__call__(gm) -> int`` (the number of rewrites it made)."""

    name: str = ""
    version: str = "1"

    def __call__(self, gm: Any) -> int:
        raise NotImplementedError


class PatternToPatternPass(GraphPass):
    """Rewrite every match of ``pattern`` into ``replacement`` (aten-level: post_grad, joint).

    Subclasses define ``pattern(*args)``, ``replacement(*args)`` (plain torch functions with
    the same arguments), ``example_inputs()`` (tensors to trace both with) and optionally
    ``extra_check(match) -> bool`` (a dtype/shape/numerics guard; the match's node args hold
    fake tensors in ``.meta["val"]``).
    """

    def pattern(self, *args: Any) -> Any:
        raise NotImplementedError

    def replacement(self, *args: Any) -> Any:
        raise NotImplementedError

    def example_inputs(self) -> list[Any]:
        raise NotImplementedError

    def extra_check(self, match: Any) -> bool:
        return True

    def _matcher(self) -> Any:
        matcher = self.__dict__.get("_spore_matcher")
        if matcher is None:
            from torch._inductor.pattern_matcher import (
                PatternMatcherPass,
                fwd_only,
                register_replacement,
            )

            matcher = PatternMatcherPass(pass_name=self.name or type(self).__name__)
            register_replacement(
                self.pattern,
                self.replacement,
                self.example_inputs(),
                fwd_only,
                matcher,
                extra_check=self.extra_check,
            )
            self.__dict__["_spore_matcher"] = matcher
        return matcher

    def __call__(self, gm: Any) -> int:
        return int(self._matcher().apply(gm.graph) or 0)


@dataclass(frozen=True)
class PassEntry:
    """A registered pass and where it runs."""

    name: str
    pass_: GraphPass | Callable[[Any], int | None]
    stage: str
    priority: int = 0
    device: str | None = None

    @property
    def version(self) -> str:
        return str(getattr(self.pass_, "version", "1"))


def _graph_device(gm: Any) -> str | None:
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        device = getattr(value, "device", None)
        if node.op == "placeholder" and device is not None:
            return device.type
    return None


def _owner_versions() -> dict[str, str]:
    from spore.plugins import get_manager

    return {i.name: i.version for i in get_manager().discover()}


def run_passes(gm: Any, entries: list[PassEntry]) -> dict[str, int]:
    """Run ``entries`` on ``gm`` in priority order; rewrites per pass name."""
    device = _graph_device(gm)
    counts: dict[str, int] = {}
    for entry in sorted(entries, key=lambda e: (-e.priority, e.name)):
        if entry.device is not None and device is not None and entry.device != device:
            continue
        counts[entry.name] = int(entry.pass_(gm) or 0)
        if counts[entry.name]:
            gm.graph.lint()
            gm.recompile()
    return counts


def _registry() -> PassRegistry:
    """The process-wide pass registry, as it is now (no plugin loading from inside a compile)."""
    from spore.plugins import get_manager

    return get_manager().registries["passes"]  # type: ignore[return-value]


def _make_multiplexer(stage: str, previous: Any) -> Any:
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_custom_graph_passes

    class SporePassMultiplexer(CustomGraphPass):
        """Spore's pass for one Inductor slot: the slot's previous pass, then Spore's."""

        def __init__(self) -> None:
            self.stage = stage
            self.previous = previous

        def __call__(self, graph: Any) -> None:
            for earlier in get_custom_graph_passes(self.previous):
                earlier(graph)
            counts = run_passes(graph.owning_module, _registry().for_stage(stage))
            with _lock:
                _stats.update(counts)

        def uuid(self) -> Any:
            parts = [f"stage={stage}"]
            owners = _owner_versions()
            registry = _registry()
            for entry in sorted(registry.for_stage(stage), key=lambda e: e.name):
                owner = registry.entry(entry.name).owner
                parts.append(
                    f"{entry.name}:{entry.version}:{entry.priority}:{entry.device}:"
                    f"{owner}:{owners.get(owner, '')}"
                )
            for earlier in get_custom_graph_passes(self.previous):
                chained = earlier.uuid() if isinstance(earlier, CustomGraphPass) else None
                parts.append(f"chained={chained!r}")
            return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    return SporePassMultiplexer()


def _install(stage: str) -> None:
    """Put the multiplexer for ``stage`` in its Inductor slot (chaining what was there)."""
    from torch._inductor import config

    slot = STAGES[stage]
    current = getattr(config, slot)
    if (
        getattr(current, "stage", None) == stage
        and type(current).__name__ == "SporePassMultiplexer"
    ):
        return
    setattr(config, slot, _make_multiplexer(stage, current))


class PassRegistry(Registry[PassEntry]):
    """What ``spore_register_passes`` receives: ``registry.add(pass_, stage=..., priority=...)``."""

    def add(  # type: ignore[override]
        self,
        value: Any,
        *,
        name: str | None = None,
        override: bool = False,
        stage: str = "post_grad",
        priority: int = 0,
        device: str | None = None,
    ) -> PassEntry:
        if stage not in STAGES:
            raise ValueError(f"unknown pass stage {stage!r}; choose one of {', '.join(STAGES)}")
        if not callable(value):
            raise TypeError(f"a pass must be callable (gm) -> int, got {type(value).__name__}")
        name = name or getattr(value, "name", "") or type(value).__name__
        entry = PassEntry(name, value, stage, priority, device)
        super().add(entry, name=name, override=override)
        _install(stage)
        return entry

    def for_stage(self, stage: str) -> list[PassEntry]:
        return [e.value for e in self.entries() if e.value.stage == stage]


def register_custom_pass(
    pass_: Any,
    *,
    name: str | None = None,
    stage: str = "post_grad",
    backend: str = "inductor",
    device: str | None = None,
    priority: int = 0,
    override: bool = False,
) -> PassEntry:
    """Register a pass for every ``torch.compile`` with Inductor in this process."""
    if backend != "inductor":
        raise ValueError(
            f"backend {backend!r} is not supported for custom passes; only 'inductor' (the "
            f"MindSpore frontend forwards .so passes separately)"
        )
    from spore.plugins import get_manager

    registry = get_manager().registry("passes")
    return registry.add(
        pass_, name=name, stage=stage, priority=priority, device=device, override=override
    )


def apply(gm: Any, stage: str = "post_grad") -> dict[str, int]:
    """Run the passes registered for ``stage`` on any FX GraphModule (no compile)."""
    from spore.plugins import get_manager

    if stage not in STAGES:
        raise ValueError(f"unknown pass stage {stage!r}; choose one of {', '.join(STAGES)}")
    registry = get_manager().registry("passes")
    counts = run_passes(gm, registry.for_stage(stage))
    with _lock:
        _stats.update(counts)
    return counts


def stats() -> dict[str, int]:
    """Rewrites per pass in its most recent run (a compile or :func:`apply`)."""
    with _lock:
        return dict(_stats)
