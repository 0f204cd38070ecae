"""Shared fixtures for sci-protenix's modules against Protenix's own (the `protenix` nox session).

Protenix is imported once here with ``LAYERNORM_TYPE=torch`` (its default layer norm is a CUDA
extension); when it is not installed every test in this folder errors with the way to run them.
``twin`` builds a Protenix module and ours from the same constructor arguments, gives Protenix's
random weights (its zero-initialised output projections would make every comparison trivial),
copies them into ours with ``load_state_dict(strict=True)`` and returns both in eval mode.
"""

from __future__ import annotations

import importlib
import os
import random
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

_HOW = (
    "run these tests with `nox -s protenix` (installs protenix==2.0.0 --no-deps, rdkit, optree, "
    "ml-collections, scipy and sets LAYERNORM_TYPE=torch), or install them into a venv that "
    "has sci-protenix and run `LAYERNORM_TYPE=torch python -m pytest "
    "packages/sci-protenix/tests_protenix`"
)

if os.environ.setdefault("LAYERNORM_TYPE", "torch") != "torch":
    raise RuntimeError(
        f"LAYERNORM_TYPE={os.environ['LAYERNORM_TYPE']!r}: Protenix's modules must use the torch "
        f"layer norm here (its fused one is a CUDA extension); {_HOW}"
    )
try:
    PX = SimpleNamespace(
        pairformer=importlib.import_module("protenix.model.modules.pairformer"),
        triangular=importlib.import_module("protenix.model.triangular.triangular"),
        layers=importlib.import_module("protenix.model.triangular.layers"),
        transformer=importlib.import_module("protenix.model.modules.transformer"),
        primitives=importlib.import_module("protenix.model.modules.primitives"),
    )
except ImportError as error:
    raise ImportError(f"Protenix is not importable ({error}); {_HOW}") from error


def randomize_(module: nn.Module, seed: int = 0) -> nn.Module:
    """Give every parameter of ``module`` seeded random values (layer-norm scales near 1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            if param.dim() >= 2:
                param.copy_(noise / param.shape[-1] ** 0.5)
            elif name.endswith("weight"):
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(0.1 * noise)
    return module


def twin_modules(
    px_cls: type[nn.Module], our_cls: type[nn.Module], *args: Any, seed: int = 0, **kwargs: Any
) -> tuple[nn.Module, nn.Module]:
    """Protenix's ``px_cls(*args, **kwargs)`` with random weights and ours holding a copy of them.

    Both are returned in eval mode, fp32; ours is loaded with ``strict=True``, so a parameter name
    or shape that differs from Protenix's fails here.
    """
    theirs = randomize_(px_cls(*args, **kwargs), seed).float().eval()
    ours = our_cls(*args, **kwargs).float()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs, ours.eval()


@pytest.fixture(scope="session")
def px() -> SimpleNamespace:
    """Protenix's model modules: pairformer, triangular, layers, transformer, primitives."""
    return PX


@pytest.fixture
def twin() -> Callable[..., tuple[nn.Module, nn.Module]]:
    """:func:`twin_modules`: (Protenix's module, ours) with the same random weights, eval mode."""
    return twin_modules


@pytest.fixture
def randomize() -> Callable[..., nn.Module]:
    """:func:`randomize_`: seeded random values for every parameter of a module, in place."""
    return randomize_


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Fixed seeds for every test: inputs drawn with torch/random are the same on each run."""
    torch.manual_seed(0)
    random.seed(0)
