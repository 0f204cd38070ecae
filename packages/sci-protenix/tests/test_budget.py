"""parse_budget: sizes, fractions of free memory, bytes, and the errors for everything else."""

from __future__ import annotations

import pytest
import torch

from sci_protenix import budget
from sci_protenix.budget import format_bytes, free_memory, parse_budget


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", 4 * 2**30),
        ("512MiB", 512 * 2**20),
        ("512 mib", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("2GB", 2 * 10**9),
        ("64KiB", 65536),
        ("1000", 1000),
        (123456, 123456),
        ("9007199254740993", 2**53 + 1),  # exact (through a float it lost its last byte)
    ],
)
def test_sizes_and_bytes(text, expected) -> None:
    assert parse_budget(text) == expected


def test_a_fraction_is_of_the_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget, "free_memory", lambda device="cpu": 10 * 2**30)
    assert parse_budget("0.5") == 5 * 2**30
    assert parse_budget(0.25) == 10 * 2**30 // 4
    assert parse_budget("1.0") == 10 * 2**30
    for tiny in ("0.000000000001", 1e-12):  # returned 0 bytes
        with pytest.raises(ValueError, match="less than a byte of free memory"):
            parse_budget(tiny)


def test_free_cpu_memory_matches_proc_meminfo() -> None:
    with open("/proc/meminfo") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    free = free_memory("cpu")
    assert 0 < free <= fields["MemTotal"]
    assert free == pytest.approx(fields["MemAvailable"], rel=0.2)  # it moves while we read


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("lots", ValueError, "is not a size"),
        ("4 parsecs", ValueError, "unknown unit 'parsecs'"),
        ("-1GiB", ValueError, "is not a size"),
        ("0GiB", ValueError, "is not positive"),
        (0, ValueError, "must be positive"),
        (-5, ValueError, "must be positive"),
        ("1.5", ValueError, r"must be in \(0, 1\]"),
        (0.0, ValueError, r"must be in \(0, 1\]"),
        (2**64 + 1, ValueError, "more than 16 EiB"),
        ("17179869185GiB", ValueError, "more than 16 EiB"),
        (True, TypeError, "budget must be bytes"),
        ([4], TypeError, "budget must be bytes"),
    ],
)
def test_bad_budgets_say_how_to_write_one(value, error, match) -> None:
    with pytest.raises(error, match=match):
        parse_budget(value)


def test_unknown_device_free_memory() -> None:
    with pytest.raises(ValueError, match="give the budget in bytes"):
        parse_budget("0.5", device="meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_fraction_of_cuda_memory_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no CUDA device is available"):
        parse_budget("0.5", device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_free_memory_is_mem_get_info() -> None:
    free, _ = torch.cuda.mem_get_info()
    assert parse_budget("1.0", device="cuda") == pytest.approx(free, rel=0.05)


def test_format_bytes() -> None:
    assert format_bytes(3 * 2**29) == "1.50 GiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(2**20) == "1.00 MiB"
    assert format_bytes(2**30 + 1, up=True) == "1.01 GiB"
    assert format_bytes(10**400).endswith(" TiB")  # a float overflowed
