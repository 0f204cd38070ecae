"""The baseline a user would otherwise run: one process, a plain PyTorch training loop over
the same model, data and global batch as a ``spore train`` config (no FSDP, no launcher).

``python -m hyperparallel.plain_loop [--set KEY=VALUE ...] --steps N`` prints one JSON line
with the median step time (seconds) and tokens per second after ``--warmup`` steps. With
``--checkpoint-after K`` it saves model and optimizer with ``torch.save`` after the K-th timed
step and adds ``slowdown_after_checkpoint``: median step time after the save / before it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hyperparallel import data, model, registries
from hyperparallel.config import load
from hyperparallel.report import slowdown
from hyperparallel.train import clipped_grad_norm, documents


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--checkpoint-after", type=int, default=None)
    args = parser.parse_args(argv)
    if args.checkpoint_after is not None and not 0 < args.checkpoint_after < args.steps:
        parser.error(f"--checkpoint-after must be between 1 and --steps - 1 ({args.steps - 1})")
    cfg = load(None, args.overrides)
    tokenizer = data.ByteTokenizer()
    blocks = data.PackedBlocks(documents(cfg.data)[0], tokenizer, cfg.data.seq_len)
    global_batch = cfg.data.batch_size * cfg.parallel.nproc * cfg.optim.grad_accum
    sampler = data.ShardedSampler(len(blocks), global_batch, 0, 1, cfg.run.seed)
    net = model.build(cfg.model, tokenizer.vocab_size, cfg.run.seed)
    optimizer = registries.optimizers.get(cfg.optim.name)(net, cfg.optim)
    save_at = None if args.checkpoint_after is None else args.warmup + args.checkpoint_after
    times = []
    for done in range(1, args.warmup + args.steps + 1):
        t0 = time.perf_counter()
        ids, labels = data.batch(blocks, sampler.next_indices())
        logits = net(input_ids=ids).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        clipped_grad_norm(net, cfg.optim.grad_clip)  # the trainer's clipping: 0 disables it
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
        if done == save_at:
            with tempfile.TemporaryDirectory(prefix="plain-loop-") as tmp:
                state = {"model": net.state_dict(), "optim": optimizer.state_dict()}
                torch.save(state, Path(tmp) / "checkpoint.pt")
    step = statistics.median(times[args.warmup :])
    tokens = global_batch * cfg.data.seq_len
    out = {"seconds": step, "tokens_per_s": tokens / step}
    if save_at is not None:
        out["slowdown_after_checkpoint"] = slowdown(times[args.warmup : save_at], times[save_at:])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
