"""Compiled regions as custom ops ``torch.ops.mfusion_regions.region_<hash>``.

Each op runs what a region compiler returned; its fake implementation gives the region's
output tensors (from ``meta["val"]``), so Inductor calls it as an extern kernel. A compile is
verified before its op is defined: run on random inputs, the callable must return as many
tensors as the region, with the same sizes, dtypes and devices, and values equal to the
region run eagerly within ``torch.testing.assert_close``'s default tolerance for the dtype, or
:func:`_tolerance`'s where the region holds 16-bit values.
Ops are cached by (compiler, structural hash), failures too, so each region structure is
compiled once per compiler in a process.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from mfusion.autofuse.candidates import REGION_NAMESPACE
from mfusion.autofuse.protocol import RegionCompiler
from mfusion.autofuse.region import Region, tensor_spec
from mfusion.autofuse.registry import identity

Spec = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]

log = logging.getLogger("mfusion.autofuse")
_lock = threading.RLock()
_ops: dict[tuple[str, str], Any] = {}
_library: list[torch.library.Library] = []


def _lib() -> torch.library.Library:
    if not _library:
        _library.append(torch.library.Library(REGION_NAMESPACE, "FRAGMENT"))
    return _library[0]


def as_tuple(result: Any) -> tuple[Any, ...]:
    """A compiled region's result as a tuple (one tensor, a tuple or a list)."""
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def example_input(value: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A real tensor like the fake ``value`` (sizes, strides, dtype, device): normal values
    for floating dtypes, zeros otherwise (valid as indices)."""
    size = 1 + sum((s - 1) * st for s, st in zip(value.shape, value.stride(), strict=True))
    size = size if value.numel() else 0
    if value.dtype.is_floating_point or value.dtype.is_complex:
        flat = torch.randn(size, generator=generator).to(value.dtype)
    else:
        flat = torch.zeros(size, dtype=value.dtype)
    return flat.to(value.device).as_strided(tuple(value.shape), tuple(value.stride()))


_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def _tolerance(gm: torch.fx.GraphModule, expected: torch.Tensor) -> dict[str, float]:
    """``assert_close``'s tolerance for an output of the region ``gm``: its default for the
    output's dtype, unless a value in the region is 16-bit. A region may compute in float32
    between its loads and stores (the region-compiler contract), where eager rounds each
    16-bit step: the two differ by about an ulp of the coarsest 16-bit dtype, relative to
    the values summed where a sum cancels. Then rtol is two of its epsilons and atol that
    times the output's largest magnitude."""
    dtypes = {v.dtype for n in gm.graph.nodes if isinstance(v := n.meta.get("val"), torch.Tensor)}
    coarse = [torch.finfo(d).eps for d in _SIXTEEN_BIT if d in dtypes]
    if not coarse or not expected.dtype.is_floating_point:
        return {}
    rtol = 2 * max(coarse)
    scale = expected.detach().abs().nan_to_num(0, 0, 0).amax().item() if expected.numel() else 0
    return {"rtol": rtol, "atol": 1e-5 + rtol * scale}


def _verified(compiler: RegionCompiler, region: Region) -> Callable[..., Any]:
    """``compiler.compile`` of ``region``, checked against the region run eagerly."""
    gm = region.graph_module
    with unset_fake_temporarily(), torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        inputs = [example_input(n.meta["val"], generator) for n in region.inputs]
        expected = as_tuple(gm(*inputs))  # before the compiler may touch the graph
        tolerances = [_tolerance(gm, e) if isinstance(e, torch.Tensor) else {} for e in expected]
        compiled = compiler.compile(gm, inputs)
        if not callable(compiled):
            raise TypeError(f"compile() returned {type(compiled).__name__}, not a callable")
        got = as_tuple(compiled(*inputs))
        if len(got) != len(expected):
            raise ValueError(
                f"the callable returned {len(got)} outputs, the region has {len(expected)}"
            )
        for i, (g, e, tol) in enumerate(zip(got, expected, tolerances, strict=True)):
            if not isinstance(g, torch.Tensor):
                raise TypeError(f"output {i} is a {type(g).__name__}, not a tensor")
            if (g.shape, g.dtype, g.device) != (e.shape, e.dtype, e.device):
                raise ValueError(
                    f"output {i} is {g.dtype}{list(g.shape)} on {g.device}, the region's is "
                    f"{e.dtype}{list(e.shape)} on {e.device}"
                )
            torch.testing.assert_close(
                g, e, equal_nan=True, msg=lambda m, i=i: f"output {i}: {m}", **tol
            )
    return compiled


def _conform(
    outputs: tuple[Any, ...], specs: Sequence[Spec], inputs: Sequence[torch.Tensor], op: str
) -> list[torch.Tensor]:
    """The outputs with the promised strides, none aliasing an input or another output."""
    if len(outputs) != len(specs):
        raise RuntimeError(
            f"{op}: the region compiler returned {len(outputs)} outputs, expected {len(specs)}"
        )
    taken = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    conformed = []
    for i, (out, (sizes, strides, dtype, device)) in enumerate(zip(outputs, specs, strict=True)):
        if tuple(out.shape) != sizes or out.dtype != dtype:
            raise RuntimeError(
                f"{op}: output {i} is {out.dtype}{list(out.shape)}, expected {dtype}{list(sizes)}"
            )
        if tuple(out.stride()) != strides or (
            out.numel() and out.untyped_storage().data_ptr() in taken
        ):
            out = torch.empty_strided(sizes, strides, dtype=dtype, device=device).copy_(out)
        if out.numel():
            taken.add(out.untyped_storage().data_ptr())
        conformed.append(out)
    return conformed


def _define(name: str, region: Region, compiled: Callable[..., Any]) -> Any:
    specs = [tensor_spec(n.meta["val"]) for n in region.outputs]
    single = len(specs) == 1
    params = ", ".join(f"Tensor in{i}" for i in range(len(region.inputs)))
    returns = "Tensor" if single else f"({', '.join('Tensor' for _ in specs)})"
    qualified = f"{REGION_NAMESPACE}::{name}"

    def run(*inputs: torch.Tensor) -> Any:
        outputs = _conform(as_tuple(compiled(*inputs)), specs, inputs, qualified)
        return outputs[0] if single else tuple(outputs)

    def fake(*inputs: torch.Tensor) -> Any:
        outputs = [torch.empty_strided(s, st, dtype=d, device=dev) for s, st, d, dev in specs]
        return outputs[0] if single else tuple(outputs)

    lib = _lib()
    lib.define(f"{name}({params}) -> {returns}")
    lib.impl(name, run, "CompositeExplicitAutograd")
    torch.library.register_fake(qualified, fake, lib=lib)
    return getattr(getattr(torch.ops, REGION_NAMESPACE), name).default


def region_op(compiler: RegionCompiler, region: Region) -> Any | None:
    """The op running ``compiler``'s compile of ``region``, or ``None`` when compiling or its
    verification failed (logged as a warning once per region structure)."""
    key = (identity(compiler), region.structural_hash())
    with _lock:
        if key in _ops:
            return _ops[key]
        try:
            compiled = _verified(compiler, region)
        except Exception as exc:
            log.warning(
                "region compiler %r failed on a region of %d nodes (%s): %s: %s; the region is "
                "left to Inductor",
                compiler.name,
                len(region.nodes),
                ", ".join(sorted({str(n.target) for n in region.nodes})),
                type(exc).__name__,
                exc,
            )
            _ops[key] = None
            return None
        name = "region_" + hashlib.sha256("\n".join(key).encode()).hexdigest()[:16]
        _ops[key] = _define(name, region, compiled)
        return _ops[key]
