"""Fits the AVX-512 GELU's table (``GELU_TABLE`` in ``csrc/vmath.h``) and checks it.

GELU(x) = x (1/2 + sign(x) H(|x|)), H(a) = erf(a / sqrt 2) / 2. With u = |x| K (K = 16/3),
H is a degree-4 polynomial in t = u - round(u), |t| <= 1/2, one per interval round(u) =
0..31 (u is clamped to U_MAX first: beyond it H rounds to 1/2). Each polynomial is a least
squares fit on Chebyshev nodes in float64 (the first interval's through 0, so that H(0) = 0),
its coefficients rounded to float32. The check evaluates the rounded table in float32 as the
VM does (Horner with fused multiply-adds, t from the float32 u) on a dense grid and prints
the largest error of H.

    python packages/dvm/tools/fit_gelu.py          # prints the C++ table and the error
"""

from __future__ import annotations

import math
import textwrap

import torch

K = torch.tensor(16.0) / torch.tensor(3.0)  # float32, as the C++ code rounds 16.0f / 3.0f
U_MAX = torch.tensor(31.49)
DEGREE = 4
INTERVALS = 32


def half_erf(a: torch.Tensor) -> torch.Tensor:
    """H(a) in float64."""
    return 0.5 * torch.erf(a.double() / math.sqrt(2.0))


def fit() -> torch.Tensor:
    """coefficients[power, interval], float32, constant term first."""
    nodes = 0.5 * torch.cos(math.pi * (torch.arange(64, dtype=torch.float64) + 0.5) / 64)
    table = torch.zeros(DEGREE + 1, INTERVALS, dtype=torch.float64)
    for i in range(INTERVALS):
        t = nodes.abs() if i == 0 else nodes
        first = 1 if i == 0 else 0  # H(0) = 0: no constant term
        powers = torch.stack([t**p for p in range(first, DEGREE + 1)], dim=1)
        h = half_erf((i + t) / K.double())
        table[first:, i] = torch.linalg.lstsq(powers, h[:, None]).solution[:, 0]
    return table.float()


def evaluate(table: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """H(|x|) in float32 as the VM computes it."""
    u = torch.minimum(x.float().abs() * K, U_MAX)
    n = torch.round(u)
    t = (u - n).double()
    i = n.long()
    h = table[DEGREE, i]
    for p in range(DEGREE - 1, -1, -1):
        h = (h.double() * t + table[p, i].double()).float()  # an FMA rounds once
    return h


def main() -> None:
    table = fit()
    x = torch.linspace(0.0, 8.0, 2_000_001)
    err = (evaluate(table, x).double() - half_erf(x)).abs()
    print("constexpr float GELU_TABLE[5][32] = {")
    for p in range(DEGREE + 1):
        values = ", ".join(f"{v!r}f" for v in _shortest(table[p]))
        print(textwrap.fill(values, 96, initial_indent="    {", subsequent_indent="     ") + "},")
    print("};")
    at = x[err.argmax()].item()
    print(f"// largest |H error| on [0, 8]: {err.max().item():.3g} at x = {at:.4f}")


def _shortest(row: torch.Tensor) -> list[float]:
    """Each float32 value as the shortest decimal that rounds back to it."""
    out = []
    for v in row.tolist():
        for digits in range(1, 10):
            s = float(f"{v:.{digits}g}")
            if torch.tensor(s).item() == v:
                out.append(s)
                break
    return out


if __name__ == "__main__":
    main()
