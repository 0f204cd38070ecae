"""The library's fp16/bf16 conversions (used by every kernel) against torch's, bit for bit."""

from __future__ import annotations

import pytest
import torch

from spore_kernels import _lib

ARGS = (_lib.ptr, _lib.i32, _lib.ptr, _lib.i32, _lib.i64, _lib.i32)


def _convert(src: torch.Tensor, dtype: torch.dtype, isa: str) -> torch.Tensor:
    dst = torch.empty(src.shape, dtype=dtype)
    fn = _lib.function("spore_convert", ARGS, _lib.load(isa))
    code = fn(
        src.data_ptr(),
        _lib.dtype_code(src),
        dst.data_ptr(),
        _lib.DTYPE_CODES[dtype],
        src.numel(),
        2,
    )
    assert code == 0
    return dst


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    assert torch.equal(a[~nan].view(bits[a.dtype]), b[~nan].view(bits[b.dtype]))


@pytest.mark.parametrize("isa", _lib.available())
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_every_16_bit_value_loads_exactly(isa, half) -> None:
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(half)
    _same_bits(_convert(every, torch.float32, isa), every.float())


@pytest.mark.parametrize("isa", _lib.available())
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_stores_round_like_torch(isa, half) -> None:
    g = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int64)
    edges = torch.tensor(
        [
            0.0,
            -0.0,
            65504.0,
            65519.99,
            65520.0,
            -65520.0,
            2**-14,
            2**-24,
            2**-25,
            3 * 2**-26,
            2**-25 * 1.0001,
            1 + 2**-11,
            1 + 3 * 2**-11,
            3.0e38,
            float("inf"),
            -float("inf"),
            float("nan"),
            1e-45,
        ]
    )
    values = torch.cat([random_bits.to(torch.int32).view(torch.float32), edges])
    _same_bits(_convert(values, half, isa), values.to(half))


def test_bad_dtype_codes_are_refused() -> None:
    x = torch.ones(4)
    fn = _lib.function("spore_convert", ARGS)
    assert fn(x.data_ptr(), 0, x.data_ptr(), 7, 4, 1) == 2
    assert fn(x.data_ptr(), 9, x.data_ptr(), 0, 4, 1) == 2
    assert fn(None, 0, x.data_ptr(), 0, 4, 1) == 1
