"""The baseline a user would otherwise run: one process, a plain PyTorch training loop over
the same model, data and global batch as a ``spore train`` config (no FSDP, no launcher).

``python -m hyperparallel.plain_loop [--set KEY=VALUE ...] --steps N`` prints one JSON line
with the median step time (seconds) and tokens per second after ``--warmup`` steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from hyperparallel import data, model, registries
from hyperparallel.config import load
from hyperparallel.train import documents


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    cfg = load(None, args.overrides)
    tokenizer = data.ByteTokenizer()
    blocks = data.PackedBlocks(documents(cfg.data)[0], tokenizer, cfg.data.seq_len)
    global_batch = cfg.data.batch_size * cfg.parallel.nproc * cfg.optim.grad_accum
    sampler = data.ShardedSampler(len(blocks), global_batch, 0, 1, cfg.run.seed)
    net = model.build(cfg.model, tokenizer.vocab_size, cfg.run.seed)
    optimizer = registries.optimizers.get(cfg.optim.name)(net, cfg.optim)
    times = []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        ids, labels = data.batch(blocks, sampler.next_indices())
        logits = net(input_ids=ids).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
    step = statistics.median(times[args.warmup :])
    tokens = global_batch * cfg.data.seq_len
    print(json.dumps({"seconds": step, "tokens_per_s": tokens / step}))


if __name__ == "__main__":
    main()
