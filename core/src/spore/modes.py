"""``spore.DispatchMode``: see every aten op that runs (like MindSpore's ``MsDispatchMode``).

Built on PyTorch's ``TorchDispatchMode``. Subclass and override ``__spore_dispatch__``; use the
instance as a context manager or a decorator. Modes nest: the innermost sees an op first, and
what it runs is seen by the next one out; leaving the inner mode, the outer resumes. Entering
an instance that is already active on this thread (a decorated function called inside it, or
calling itself) changes nothing: it sees each op once. A copy is a mode of its own, not
entered.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from contextlib import ContextDecorator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def op_name(func: Any) -> str:
    """``aten.mm.default`` style name of an op overload."""
    return str(func)


class DispatchMode(TorchDispatchMode, ContextDecorator):
    """Base class: override ``__spore_dispatch__(func, args, kwargs)``; the default runs it."""

    def __enter__(self) -> Any:
        depth = self._depth()
        entered = self if getattr(depth, "value", 0) else super().__enter__()
        depth.value = getattr(depth, "value", 0) + 1  # counted once the mode is on the stack
        return entered

    def __exit__(self, *exc_info: Any) -> Any:
        depth = self._depth()
        depth.value -= 1
        return None if depth.value else super().__exit__(*exc_info)

    def _depth(self) -> threading.local:
        """How many times this instance is entered on the calling thread."""
        if "_spore_depth" not in self.__dict__:
            self.__dict__["_spore_depth"] = threading.local()
        return self.__dict__["_spore_depth"]

    def __getstate__(self) -> Any:
        """The state without the per-thread entry count: a copy (``copy``, ``deepcopy``,
        ``pickle``) is a mode of its own, not entered, whatever this one is. A subclass's
        ``__slots__`` are kept, as by Python's own state."""
        state = super().__getstate__()
        attrs, slots = state if isinstance(state, tuple) else (state, None)
        attrs = {k: v for k, v in (attrs or {}).items() if k != "_spore_depth"}
        return (attrs, slots) if slots else attrs

    def __spore_dispatch__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return func(*args, **kwargs)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return self.__spore_dispatch__(func, args, kwargs or {})


class OpCounter(DispatchMode):
    """Counts the ops run inside it, by ``aten.<op>.<overload>`` name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __spore_dispatch__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.counts[op_name(func)] += 1
        return func(*args, **kwargs)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}@{value.device.type}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    return repr(value)


class OpLogger(OpCounter):
    """An :class:`OpCounter` that also logs each op with its argument shapes and dtypes."""

    def __init__(self, logger: logging.Logger | None = None, level: int = logging.INFO) -> None:
        super().__init__()
        self.logger = logger or logging.getLogger("spore.ops")
        self.level = level

    def __spore_dispatch__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.logger.isEnabledFor(self.level):
            shown = ", ".join(
                [_describe(a) for a in args] + [f"{k}={_describe(v)}" for k, v in kwargs.items()]
            )
            self.logger.log(self.level, "%s(%s)", op_name(func), shown)
        return super().__spore_dispatch__(func, args, kwargs)
