from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn


def randomized(module: nn.Module, seed: int = 0) -> nn.Module:
    """``module`` with seeded random parameters: AF3's zero-initialised output projections and
    gates would make most comparisons trivial. Layer-norm scales stay near 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            if param.dim() >= 2:
                param.copy_(noise / param.shape[-1] ** 0.5)
            else:
                param.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * noise)
    return module


@pytest.fixture
def randomize() -> Callable[..., nn.Module]:
    """:func:`randomized`: seeded random values for every parameter of a module, in place."""
    return randomized


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Fixed seeds for every test: inputs drawn with torch are the same on each run."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: the tests run many small ops (chunks), which OpenMP threads only
    slow down on a shared 2-core machine (a recomputed step: 4.7 s against 0.6 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
