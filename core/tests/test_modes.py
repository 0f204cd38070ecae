from __future__ import annotations

import copy
import logging
import pickle

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import spore
from spore.modes import DispatchMode


def test_counter_counts_every_aten_op() -> None:
    x = torch.randn(4, 4)
    with spore.OpCounter() as counter:
        torch.mm(x, x).relu().sum()
    assert counter.counts == {"aten.mm.default": 1, "aten.relu.default": 1, "aten.sum.default": 1}
    assert counter.total == 3


def test_nesting_innermost_first_outer_resumes() -> None:
    x = torch.randn(2)
    with spore.OpCounter() as outer:
        x.neg()
        with spore.OpCounter() as inner:
            x.exp()
        x.abs()
    assert inner.counts == {"aten.exp.default": 1}
    assert outer.counts == {"aten.neg.default": 1, "aten.exp.default": 1, "aten.abs.default": 1}


def test_innermost_mode_wins() -> None:
    class Replace(DispatchMode):
        def __init__(self, value: float) -> None:
            super().__init__()
            self.value = value

        def __spore_dispatch__(self, func, args, kwargs):
            out = func(*args, **kwargs)
            return out.fill_(self.value) if func is torch.ops.aten.add.Tensor else out

    zeros = torch.zeros(2)
    with Replace(1.0), Replace(2.0):  # the inner mode post-processes what the outer returned
        assert (zeros + 5).tolist() == [2.0, 2.0]
    with Replace(3.0):
        assert (torch.zeros(2) + 5).tolist() == [3.0, 3.0]
    assert (torch.zeros(2) + 5).tolist() == [5.0, 5.0]


def test_decorator_and_autograd() -> None:
    counter = spore.OpCounter()

    @counter
    def step(w):
        (w * w).sum().backward()

    w = torch.ones(3, requires_grad=True)
    step(w)
    step(w)
    assert counter.counts["aten.mul.Tensor"] >= 4  # forward and backward, twice
    assert w.grad.tolist() == [4.0, 4.0, 4.0]


def test_logger_logs_shapes(caplog) -> None:
    a, b = torch.ones(2, 3), torch.ones(3, 4)
    with caplog.at_level(logging.INFO, logger="spore.ops"), spore.OpLogger() as log:
        torch.mm(a, b)
    assert log.total == 1
    assert caplog.messages == ["aten.mm.default(float32[2, 3]@cpu, float32[3, 4]@cpu)"]


def test_an_active_mode_entered_again_sees_each_op_once() -> None:
    counter = spore.OpCounter()
    x = torch.ones(3)

    @counter
    def step(depth: int) -> torch.Tensor:
        return x + 1 if depth == 0 else step(depth - 1)

    with counter:
        with counter:
            x * 2
        x - 1
    step(2)
    assert counter.counts == {"aten.mul.Tensor": 1, "aten.sub.Tensor": 1, "aten.add.Tensor": 1}
    x + 1
    assert counter.total == 3  # left completely


def test_a_failed_enter_leaves_the_mode_usable(monkeypatch) -> None:
    counter = spore.OpCounter()

    def refuse(self):
        raise RuntimeError("no entry")

    monkeypatch.setattr(TorchDispatchMode, "__enter__", refuse)
    with pytest.raises(RuntimeError, match="no entry"), counter:
        pass
    monkeypatch.undo()
    x = torch.ones(2)
    with counter:
        x + 1
    assert counter.counts == {"aten.add.Tensor": 1}


@pytest.mark.parametrize(
    "make_copy", [copy.deepcopy, copy.copy, lambda m: pickle.loads(pickle.dumps(m))]
)
def test_a_copy_of_an_entered_mode_is_a_mode_of_its_own(make_copy) -> None:
    """deepcopy and pickle of a mode once entered raised (its per-thread entry count cannot be
    pickled); a copy.copy shared that count, so entering the copy inside the original did
    nothing and the copy saw no op."""
    x = torch.randn(2)
    with spore.OpCounter() as counter:
        x.neg()
        copied = make_copy(counter)
        copied.counts = type(counter.counts)()
        with copied:
            x.exp()
    assert copied.counts == {"aten.exp.default": 1}
    assert counter.counts == {"aten.neg.default": 1, "aten.exp.default": 1}


class _Slotted(spore.OpCounter):
    __slots__ = ("limit",)


@pytest.mark.parametrize(
    "make_copy", [copy.deepcopy, copy.copy, lambda m: pickle.loads(pickle.dumps(m))]
)
def test_a_copy_keeps_a_subclass_s_slots(make_copy) -> None:
    """Leaving out the entry count kept only ``__dict__``: a subclass's ``__slots__`` values
    were lost in the copy."""
    mode = _Slotted()
    mode.limit = 7
    with mode:
        copied = make_copy(mode)
    assert copied.limit == 7
