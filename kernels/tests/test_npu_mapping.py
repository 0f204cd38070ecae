"""The NPU mapping (spore op -> torch_npu fused op) without torch_npu: a fake torch_npu whose
functions follow the documented signatures and outputs in plain torch stands in for it, and each
adapter must turn it into exactly the op's reference result."""

from __future__ import annotations

import importlib.abc
import sys
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from spore import dispatch
from spore_kernels import _checks, npu, registration

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _fake_torch_npu(without: tuple[str, ...] = ()) -> types.ModuleType:
    """torch_npu's documented fused ops (names, parameter names, output tuples) in plain torch,
    computing in float32 and rounding once; each call is recorded in ``calls``."""
    calls: list[tuple[str, dict[str, Any]]] = []

    def npu_rms_norm(self, gamma, epsilon=1e-06):
        calls.append(("npu_rms_norm", {"epsilon": epsilon}))
        xf = self.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
        return (xf * rstd * gamma.float()).to(self.dtype), rstd

    def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06):
        calls.append(("npu_add_rms_norm", {"epsilon": epsilon}))
        x = x1 + x2
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
        return (xf * rstd * gamma.float()).to(x.dtype), rstd, x

    def npu_swiglu(input, dim=-1):
        calls.append(("npu_swiglu", {"dim": dim}))
        a, b = input.float().chunk(2, dim)
        return (F.silu(a) * b).to(input.dtype)

    def npu_rotary_mul(input, r1, r2, rotary_mode="half"):
        calls.append(("npu_rotary_mul", {"rotary_mode": rotary_mode}))
        assert rotary_mode == "half"
        assert input.dim() == r1.dim() == r2.dim() == 4  # the documented layout: 4-D only
        xf = input.float()
        x1, x2 = xf.chunk(2, -1)
        return (r1.float() * xf + r2.float() * torch.cat((-x2, x1), -1)).to(input.dtype)

    def npu_gelu(input, approximate="none"):
        calls.append(("npu_gelu", {"approximate": approximate}))
        return F.gelu(input.float(), approximate=approximate).to(input.dtype)

    ops = {
        "npu_rms_norm": npu_rms_norm,
        "npu_add_rms_norm": npu_add_rms_norm,
        "npu_swiglu": npu_swiglu,
        "npu_rotary_mul": npu_rotary_mul,
        "npu_gelu": npu_gelu,
    }
    module = types.ModuleType("torch_npu")
    module.calls = calls
    for name, fn in ops.items():
        if name not in without:
            setattr(module, name, fn)
    return module


class _Recorder:
    """An OpRegistry stand-in that records ``kernel`` calls instead of touching dispatch."""

    def __init__(self) -> None:
        self.kernels: dict[str, dict[str, Any]] = {}

    def kernel(self, op: str, device: str, fn: Any, *, priority: int = 0, supports: Any = None):
        self.kernels[op] = {"device": device, "fn": fn, "priority": priority, "supports": supports}


def _inputs(op: str, dtype: torch.dtype, seed: int = 0) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    if op == "rms_norm":
        return randn(3, 5, 64), randn(64), 1e-6
    if op == "add_rms_norm":
        return randn(6, 96), randn(6, 96), randn(96), 1e-5
    if op == "swiglu":
        return (randn(4, 3, 40),)
    if op == "rope":
        angles = torch.randn(1, 7, 1, 32, generator=g)
        return randn(2, 7, 3, 32), angles.cos().to(dtype), angles.sin().to(dtype), "half"
    if op == "gelu":
        return randn(5, 33) * 3, "tanh"
    raise AssertionError(op)


def _close(out: Any, expected: Any) -> None:
    outs = out if isinstance(out, tuple) else (out,)
    wanted = expected if isinstance(expected, tuple) else (expected,)
    assert len(outs) == len(wanted)
    for o, e in zip(outs, wanted, strict=True):
        assert o.dtype == e.dtype
        assert o.shape == e.shape
        torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mapping", npu.MAPPINGS, ids=lambda m: m.op)
def test_each_adapter_gives_the_reference_result(mapping, dtype) -> None:
    fake = _fake_torch_npu()
    args = _inputs(mapping.op, dtype)
    assert mapping.supports(*args)
    out = mapping.adapter(fake)(*args)
    _close(out, dispatch.get(mapping.op).reference(*args))
    assert [name for name, _ in fake.calls] == [mapping.fused]


def test_adapters_pass_the_documented_keywords() -> None:
    fake = _fake_torch_npu()
    for m in npu.MAPPINGS:
        m.adapter(fake)(*_inputs(m.op, torch.float32))
    assert dict(fake.calls) == {
        "npu_rms_norm": {"epsilon": 1e-6},
        "npu_add_rms_norm": {"epsilon": 1e-5},
        "npu_swiglu": {"dim": -1},
        "npu_rotary_mul": {"rotary_mode": "half"},
        "npu_gelu": {"approximate": "tanh"},
    }


def test_add_rms_norm_returns_the_sum_not_rstd() -> None:
    x, residual, w, eps = _inputs("add_rms_norm", torch.bfloat16)
    y, total = npu.MAPPINGS[1].adapter(_fake_torch_npu())(x, residual, w, eps)
    assert torch.equal(total, x + residual)
    assert y.shape == x.shape


@pytest.mark.parametrize(
    ("x_shape", "table_shape"),
    [((2, 7, 3, 32), (7, 1, 32)), ((2, 3, 7, 32), (7, 32)), ((2, 3, 7, 32), (1, 1, 1, 32))],
    ids=str,
)
def test_rope_tables_of_lower_rank_are_viewed_as_4d(x_shape, table_shape) -> None:
    g = torch.Generator().manual_seed(3)
    angles = torch.randn(*table_shape, generator=g)
    args = (torch.randn(*x_shape, generator=g), angles.cos(), angles.sin(), "half")
    mapping = _mapping("rope")
    assert mapping.supports(*args)
    _close(mapping.adapter(_fake_torch_npu())(*args), dispatch.get("rope").reference(*args))


def _mapping(op: str) -> npu.Mapping:
    return next(m for m in npu.MAPPINGS if m.op == op)


def _refused() -> list[tuple[str, tuple[Any, ...]]]:
    x, w, eps = _inputs("rms_norm", torch.float32)
    rx, rcos, rsin, _ = _inputs("rope", torch.float32)
    return [
        ("rope", (rx, rcos, rsin, "interleaved")),
        ("rope", (rx[0], rcos[0], rsin[0], "half")),
        ("rope", (rx[..., :30], rcos[..., :30], rsin[..., :30], "half")),
        (
            "rope",
            (torch.randn(1, 2, 1, 900), torch.ones(1, 1, 1, 900), torch.ones(1, 1, 1, 900), "half"),
        ),
        (
            "rope",
            (torch.randn(1, 2, 1, 31), torch.ones(1, 1, 1, 31), torch.ones(1, 1, 1, 31), "half"),
        ),
        (
            "rope",
            (
                rx,
                rcos.expand(1, 7, 2, 32).contiguous(),
                rsin.expand(1, 7, 2, 32).contiguous(),
                "half",
            ),
        ),
        ("rope", (rx, rcos.double(), rsin.double(), "half")),
        ("rope", (rx, rcos[..., :16].contiguous(), rsin[..., :16].contiguous(), "half")),
        ("rope", (rx, rcos[None], rsin[None], "half")),
        ("rms_norm", (x, w.to(torch.bfloat16), eps)),
        ("rms_norm", (x.double(), w.double(), eps)),
        ("rms_norm", (x.transpose(0, 1), w, eps)),
        ("rms_norm", (x[:0], w, eps)),
        ("rms_norm", (x, w[:10], eps)),
        ("add_rms_norm", (x, x[:1], w, eps)),
        ("swiglu", (torch.randn(4, 7),)),
        ("gelu", (torch.randn(4, 7), "sigmoid")),
        ("gelu", (torch.randn(2, *[1] * 8),)),
    ]


@pytest.mark.parametrize(("op", "args"), _refused(), ids=lambda v: v if isinstance(v, str) else "")
def test_what_the_fused_op_cannot_take_is_refused(op, args) -> None:
    assert not _mapping(op).supports(*args)


def test_register_adds_an_npu_kernel_per_mapping() -> None:
    recorder = _Recorder()
    added = npu.register(recorder, _fake_torch_npu())
    assert added == [m.op for m in npu.MAPPINGS]
    for m in npu.MAPPINGS:
        entry = recorder.kernels[m.op]
        assert (entry["device"], entry["priority"], entry["supports"]) == (
            "npu",
            _checks.PRIORITY,
            m.supports,
        )
        _close(
            entry["fn"](*_inputs(m.op, torch.float32)),
            m.adapter(_fake_torch_npu())(*_inputs(m.op, torch.float32)),
        )


def test_a_fused_op_torch_npu_lacks_is_left_to_the_reference() -> None:
    recorder = _Recorder()
    assert "gelu" not in npu.register(recorder, _fake_torch_npu(without=("npu_gelu",)))
    assert "gelu" not in recorder.kernels
    assert "rms_norm" in recorder.kernels


def test_plugin_registers_nothing_for_npu_without_torch_npu(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu raises ImportError
    recorder = _Recorder()
    assert registration.register_npu(recorder) is False
    assert recorder.kernels == {}


class _Broken(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name == "torch_npu":
            raise RuntimeError("libascendcl.so: cannot open shared object file")


def test_plugin_survives_a_torch_npu_that_fails_on_import(monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_Broken(), *sys.meta_path])
    recorder = _Recorder()
    assert registration.register_npu(recorder) is False
    assert recorder.kernels == {}


def test_plugin_registers_the_mapping_when_torch_npu_imports(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu())
    recorder = _Recorder()
    assert registration.register_npu(recorder) is True
    assert sorted(recorder.kernels) == sorted(m.op for m in npu.MAPPINGS)
