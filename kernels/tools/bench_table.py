"""Turn ``spore bench kernels --json`` output into the Markdown table in kernels/README.md.

    spore bench kernels --repeat 5 --json > bench.json
    python kernels/tools/bench_table.py bench.json

One row per op, phase (fwd, fwdbwd) and dtype; each cell is the median speed-up of the kernel
over that baseline (baseline time / kernel time), ``copy`` is the fraction of the copy
bandwidth achieved; the kernel's own median time is in the last column.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

COLUMNS = ("eager", "builtin", "compile", "copy")


def _cell(result: dict, percent: bool) -> str:
    if result.get("error"):
        return "error"
    return f"{result['ratio']:.0%}" if percent else f"{result['ratio']:.2f}x"


def table(results: list[dict]) -> str:
    rows: dict[tuple[str, str, str], dict[str, str]] = defaultdict(dict)
    kernel_ms: dict[tuple[str, str, str], float] = {}
    builtin_name: dict[tuple[str, str, str], str] = {}
    for result in results:
        case, baseline = result["name"].split("-vs-")
        op, phase, dtype = case.rsplit("-", 2)
        key = (op, phase, dtype)
        column = baseline if baseline in ("eager", "compile", "copy") else "builtin"
        if column == "builtin":
            builtin_name[key] = baseline
        rows[key][column] = _cell(result, percent=column == "copy")
        if result.get("candidate_s"):
            kernel_ms[key] = result["candidate_s"] * 1e3
    lines = [
        "| op | pass | dtype | vs eager | vs torch built-in | vs torch.compile | of copy bandwidth "
        "| kernel time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(rows):
        op, phase, dtype = key
        cells = rows[key]
        builtin = cells.get("builtin", "—")
        if key in builtin_name:
            builtin = f"{builtin} (`{builtin_name[key]}`)"
        ms = f"{kernel_ms[key]:.2f} ms" if key in kernel_ms else "—"
        lines.append(
            f"| {op} | {phase} | {dtype} | {cells.get('eager', '—')} | {builtin} | "
            f"{cells.get('compile', '—')} | {cells.get('copy', '—')} | {ms} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> str:
    """The table for the file named in ``argv``; ``SystemExit`` with the problem when the file
    is not ``spore bench kernels --json`` output."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench_json", help="the output of spore bench kernels --json")
    path = parser.parse_args(argv).bench_json
    try:
        with open(path) as f:
            results = json.load(f)["results"]
        return table(results)
    except OSError as exc:
        raise SystemExit(f"bench_table: cannot read {path}: {exc.strerror}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SystemExit(
            f"bench_table: {path} is not `spore bench kernels --json` output "
            f"({type(exc).__name__}: {exc})"
        ) from None


if __name__ == "__main__":
    print(main(sys.argv[1:]))
