"""Memory of a tiny Llama training step (``spore bench dvm -k llama-train``'s model, at a larger
batch) under eager, dvm and Inductor: what the forward keeps for the backward, and the peak
during the backward, both above the resident memory before the forward, in MiB.

Each side runs in a process of its own, with glibc's mmap threshold fixed at 64 KiB so that a
freed tensor goes back to the system at once and the resident memory follows the live tensors
(the peak is the kernel's high-water mark, reset before each phase). Two steps run first
(compiles, optimizer state).

    python packages/dvm/tools/backward_memory.py --batch 8 --seq 256 [--dtype bf16]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

SIDES = {"eager": None, "dvm": "dvm", "inductor": "inductor"}


def _resident_mib(key: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _side(name: str, batch: int, seq: int, dtype: str) -> None:
    import dataclasses

    import torch

    from dvm import benchmarks

    torch.manual_seed(0)
    size = dataclasses.replace(benchmarks.LLAMA, batch=batch, seq=seq)
    model = benchmarks._llama(size).to(benchmarks.DTYPES[dtype]).train()
    ids = torch.randint(0, size.vocab, (batch, seq))
    backend = SIDES[name]
    forward = model if backend is None else torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        forward(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    base = _resident_mib("VmRSS:")
    loss = forward(input_ids=ids, labels=ids).loss
    kept = _resident_mib("VmRSS:") - base
    _reset_peak()
    loss.backward()
    peak = _resident_mib("VmHWM:") - base
    print(f"{name:9s} kept by the forward {kept:7.1f} MiB   backward peak {peak:7.1f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--side", choices=sorted(SIDES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        _side(args.side, args.batch, args.seq, args.dtype)
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    for name in SIDES:
        command = [sys.executable, __file__, "--side", name]
        command += ["--batch", str(args.batch), "--seq", str(args.seq), "--dtype", args.dtype]
        subprocess.run(command, env=env, check=True)


if __name__ == "__main__":
    main()
