"""``spore.distributed.init_process_group`` with no plugin taking it: a synchronous init."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from spore.distributed import init_process_group


@pytest.fixture
def started(spore_manager, monkeypatch) -> Iterator[list[dict[str, Any]]]:
    """No plugin loaded; the keyword arguments each ``torch.distributed.init_process_group``
    got. Destroys the group a test leaves."""
    spore_manager({"SPORE_NO_PLUGINS": "1"})
    calls: list[dict[str, Any]] = []
    real = dist.init_process_group

    def record(*args: Any, **kwargs: Any) -> None:
        calls.append(kwargs)
        real(*args, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", record)
    yield calls
    if dist.is_initialized():
        dist.destroy_process_group()


def _start(**options: Any) -> Any:
    return init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, **options)


@pytest.mark.parametrize(
    ("options", "timeout"),
    [
        ({"init_timeout": 5}, datetime.timedelta(seconds=5)),
        ({"init_timeout": datetime.timedelta(minutes=2)}, datetime.timedelta(minutes=2)),
        (
            {"init_timeout": 5, "timeout": datetime.timedelta(seconds=60)},
            datetime.timedelta(seconds=60),
        ),
    ],
)
def test_init_timeout_becomes_torchs_timeout(started, options, timeout) -> None:
    """``init_timeout`` (mccl's) raised "init_process_group() got an unexpected keyword
    argument 'init_timeout'" once mccl was disabled."""
    handle = _start(**options)
    assert handle.done()
    assert handle.wait() is dist.group.WORLD
    assert [call["timeout"] for call in started] == [timeout]
    assert "init_timeout" not in started[0]


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        ("abc", TypeError, r"got 'abc' \(str\)"),
        ("30", TypeError, r"got '30' \(str\)"),
        (True, TypeError, r"got True \(bool\)"),
        (0, ValueError, "init_timeout must be a positive, finite time, got 0"),
        (float("nan"), ValueError, "init_timeout must be a positive, finite time, got nan"),
        (float("inf"), ValueError, "init_timeout must be a positive, finite time, got inf"),
    ],
)
def test_a_bad_init_timeout_names_it(started, bad, error, message) -> None:
    with pytest.raises(error, match=message) as raised:
        _start(init_timeout=bad)
    assert "init_timeout" in str(raised.value)
    assert started == []
    assert not dist.is_initialized()


def test_wait_returns_the_group_it_created_until_destroyed(started) -> None:
    """``wait()`` returned the default group of the moment: ``None`` after
    ``destroy_process_group()``, or a group started later, where mccl's handle raises."""
    handle = _start()
    group = handle.wait()
    assert group is dist.group.WORLD
    dist.destroy_process_group()
    with pytest.raises(RuntimeError, match="has been destroyed"):
        handle.wait()
    later = _start()
    assert later.wait() is not group
    with pytest.raises(RuntimeError, match="has been destroyed"):
        handle.wait()
