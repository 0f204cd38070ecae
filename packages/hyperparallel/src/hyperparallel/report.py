"""What rank 0 shows and writes: a rich progress bar (or plain lines when not a terminal), the
metrics JSONL, the loss-curve PNG and the final summary table."""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


class Metrics:
    """``metrics.jsonl``: one line per step. A resume starts it from the log of the run it
    continues, ``earlier`` (``path`` itself, or another output's), up to the checkpoint's step,
    when the first step is written (a run that logs no step leaves the file as it was)."""

    def __init__(self, path: Path, resume_step: int, earlier: Path) -> None:
        self.path = path
        self._kept = (
            [r for r in read_metrics(earlier) if r["step"] <= resume_step] if resume_step else []
        )
        self._file: Any = None

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record``; a float that is inf or NaN is written ``null`` (JSON has none)."""
        if self._file is None:
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in self._kept))
            self._file = self.path.open("a")
        finite = {
            k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in record.items()
        }
        self._file.write(json.dumps(finite, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` (none when there is none; ``OSError`` when it cannot be
    read, a directory too); a last line cut short (the process killed while writing it) is left
    out, any other line that is not a record (a JSON object with an integer ``step`` and a
    number or null ``loss``), or not UTF-8, is a ``ValueError`` naming it."""
    if not path.exists():
        return []
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        number = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(f"{path}:{number}: not UTF-8 text (byte {data[exc.start]:#04x})") from None
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines) and not text.endswith("\n"):
                break
            raise ValueError(f"{path}:{number}: not a metrics record ({exc})") from None
        if not _is_record(record):
            raise ValueError(
                f"{path}:{number}: not a metrics record (a JSON object with an integer step "
                f"and a number or null loss)"
            )
        records.append(record)
    return records


def _is_record(record: Any) -> bool:
    """Whether a parsed ``metrics.jsonl`` line is a step's record, as :class:`Metrics` writes."""
    if not isinstance(record, dict):
        return False
    step, loss = record.get("step"), record.get("loss", False)
    number = loss is None or (isinstance(loss, int | float) and not isinstance(loss, bool))
    return type(step) is int and number


def slowdown(before: list[float], after: list[float]) -> float:
    """Median step time after a checkpoint over the median before it."""
    return statistics.median(after) / statistics.median(before)


def plot(metrics: list[dict[str, Any]], path: Path, title: str) -> None:
    """The loss curve (per step, and a 20-step moving average) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kept = [m for m in metrics if m["loss"] is not None]  # a non-finite loss is logged null
    steps = [m["step"] for m in kept]
    losses = [m["loss"] for m in kept]
    window = 20
    smooth = [statistics.fmean(losses[max(0, i - window + 1) : i + 1]) for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, losses, lw=0.8, alpha=0.4, label="loss")
    ax.plot(steps, smooth, lw=1.8, label=f"{window}-step mean")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".tmp-{path.name}")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    os.replace(tmp, path)


class ProgressDisplay:
    """Rank 0's progress: a live bar on a terminal, else a plain line every ``log_every`` steps."""

    def __init__(self, name: str, total: int, start: int, log_every: int) -> None:
        self.console = Console(stderr=False)
        self.live = self.console.is_terminal
        self.log_every = log_every
        self.total = total
        if self.live:
            self.progress = Progress(
                TextColumn(f"[bold]{escape(name)}"),
                BarColumn(),
                TextColumn("step {task.completed}/{task.total}"),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[tps]} tok/s"),
                TextColumn("{task.fields[dt]} s/step"),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self.task = self.progress.add_task(
                name, total=total, completed=start, loss="-", tps="-", dt="-"
            )
            self.progress.start()

    def update(self, step: int, loss: float, tokens_per_s: float, step_s: float) -> None:
        if self.live:
            self.progress.update(
                self.task,
                completed=step,
                loss=f"{loss:.4f}",
                tps=f"{tokens_per_s:,.0f}",
                dt=f"{step_s:.3f}",
            )
        elif step % self.log_every == 0 or step == self.total:
            remaining = (self.total - step) * step_s
            self.console.print(
                f"step {step}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  "
                f"{step_s:.3f} s/step  ETA {remaining:.0f} s",
                highlight=False,
            )

    def close(self) -> None:
        if self.live:
            self.progress.stop()


def summary(rows: list[tuple[str, str]]) -> None:
    """The end-of-run table, each cell as written (paths and names may hold ``[...]``)."""
    table = Table(title="spore train: summary", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for key, value in rows:
        table.add_row(escape(key), escape(value))
    Console().print(table)
