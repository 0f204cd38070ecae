"""The optimizer and schedule registries: what each builder gives, step by step."""

from __future__ import annotations

import math

import pytest
import torch

from hyperparallel import config, preflight, registries

PEAK = 3e-3


def _before_transformers(kind: str, warm: int, floor: float, steps: int, step: int) -> float:
    """The rate factor of the hand-written schedules these replaced (warm-up from 1/warm)."""
    if kind == "constant":
        return min(1.0, (step + 1) / warm) if warm else 1.0
    if step < warm:
        return (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, steps - warm))
    if kind == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1 - (1 - floor) * progress


def _scheduler(kind: str, warm: int, floor: float, steps: int):
    param = torch.nn.Parameter(torch.zeros(2, 2))
    optimizer = torch.optim.AdamW([param], lr=PEAK)
    section = config.ScheduleSection(name=kind, warmup_steps=warm, min_lr_ratio=floor)
    return optimizer, registries.schedules.get(kind)(optimizer, section, steps)


def _rates(optimizer, scheduler, count: int) -> list[float]:
    """The rate each of the next ``count`` optimizer steps runs at."""
    out = []
    for _ in range(count):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("kind", ["constant", "cosine", "linear"])
def test_a_schedule_reads_the_settings_it_is_registered_with_and_no_other(kind: str) -> None:
    """A resume compares only the declared settings: one read but not declared would switch the
    schedule mid-run unnoticed; one declared but not read refuses a resume that changes
    nothing."""
    base = {"warmup_steps": 3, "min_lr_ratio": 0.1}
    other = {"warmup_steps": 5, "min_lr_ratio": 0.5}
    assert set(other) == set(config.ScheduleSection.model_fields) - {"name"}
    before = _rates(*_scheduler(kind, base["warmup_steps"], base["min_lr_ratio"], 12), 13)
    for key, value in other.items():
        settings = {**base, key: value}
        after = _rates(
            *_scheduler(kind, settings["warmup_steps"], settings["min_lr_ratio"], 12), 13
        )
        assert (after != before) == (key in registries.schedules.reads(kind)), key


@pytest.mark.parametrize("kind", ["constant", "cosine", "linear"])
@pytest.mark.parametrize(
    ("warm", "floor", "steps"), [(20, 0.1, 300), (0, 0.1, 10), (5, 0.0, 12), (3, 1.0, 7)]
)
def test_schedules_keep_their_rates_after_warm_up_and_warm_up_from_zero(
    kind: str, warm: int, floor: float, steps: int
) -> None:
    optimizer, scheduler = _scheduler(kind, warm, floor, steps)
    got = _rates(optimizer, scheduler, steps + 1)  # the last is the rate logged after training
    before = [PEAK * _before_transformers(kind, warm, floor, steps, s) for s in range(steps + 1)]
    for step in range(warm, steps + 1):
        assert got[step] == pytest.approx(before[step], rel=1e-12, abs=1e-18), step
    assert got[:warm] == pytest.approx([PEAK * s / warm for s in range(warm)], rel=1e-12)
    if warm:
        assert got[:warm] == pytest.approx([0.0, *before[: warm - 1]], rel=1e-12, abs=1e-18)
    if kind != "constant":
        assert got[steps] == pytest.approx(PEAK * floor, rel=1e-12, abs=1e-18)


@pytest.mark.parametrize("kind", ["constant", "cosine", "linear"])
def test_a_schedule_resumes_from_its_state_dict(kind: str) -> None:
    """As a checkpoint restores them: the optimizer (its rates), then the scheduler."""
    optimizer, scheduler = _scheduler(kind, 4, 0.2, 12)
    whole = _rates(optimizer, scheduler, 12)
    optimizer, scheduler = _scheduler(kind, 4, 0.2, 12)
    first = _rates(optimizer, scheduler, 5)
    saved = optimizer.state_dict(), scheduler.state_dict()
    optimizer, scheduler = _scheduler(kind, 4, 0.2, 12)
    optimizer.load_state_dict(saved[0])
    scheduler.load_state_dict(saved[1])
    rest = _rates(optimizer, scheduler, 7)
    assert first + rest == whole


def test_a_warm_up_as_long_as_the_run_ends_at_the_peak() -> None:
    optimizer, scheduler = _scheduler("linear", 6, 0.1, 6)
    assert _rates(optimizer, scheduler, 7)[-1] == pytest.approx(PEAK)


def test_adamw_decays_matrices_only_and_takes_the_options() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optim = config.OptimSection(weight_decay=0.2, betas=[0.8, 0.9], options={"amsgrad": True})
    optimizer = registries.optimizers.get("adamw")(model, optim)
    decayed, plain = optimizer.param_groups
    assert [p.dim() for p in decayed["params"]] == [2]
    assert (decayed["weight_decay"], plain["weight_decay"]) == (0.2, 0.0)
    assert decayed["betas"] == (0.8, 0.9)
    assert decayed["amsgrad"] is True
    with pytest.raises(ValueError, match=r"set optim\.weight_decay, not optim\.options"):
        registries.optimizers.get("adamw")(
            model, optim.model_copy(update={"options": {"weight_decay": 0.5}})
        )  # ignored: each group set its own


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(KeyError, match="unknown schedule 'step'; known: constant, cosine, linear"):
        registries.schedules.get("step")


def test_reads_takes_a_set_of_names_not_one_string() -> None:
    with pytest.raises(TypeError, match=r"schedule 'flat': reads= takes a set of names"):
        registries.schedules.register("flat", reads="warmup_steps")
    assert "flat" not in registries.schedules


def test_a_schedule_registered_reading_no_schedule_setting_is_a_config_error(monkeypatch) -> None:
    """A misspelt setting in reads= would leave the one it means uncompared on resume."""
    schedules = registries.ScheduleRegistry()
    schedules.register("flat", reads={"warmup"})(registries.constant)
    monkeypatch.setattr(registries, "schedules", schedules)
    with pytest.raises(
        config.ConfigError,
        match=r"--set schedule.name=flat: schedule 'flat' is registered reading warmup, which "
        r"the schedule section does not have \(it has min_lr_ratio, name, warmup_steps\)",
    ):
        preflight.resolve(None, ["schedule.name=flat"], outputs=False)
    schedules.register("named", reads={"name", "warmup_steps"})(registries.constant)
    cfg = preflight.resolve(None, ["schedule.name=named"], outputs=False)  # name was refused
    assert cfg.schedule.name == "named"
