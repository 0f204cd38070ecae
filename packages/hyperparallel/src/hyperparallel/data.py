"""Training data: byte tokenizer, document loading, packing into blocks, sharded resumable order.

The pipeline is ``load_documents`` (or ``default_corpus``) -> ``PackedBlocks`` ->
``ShardedSampler.next_indices`` -> ``batch``. Every step is deterministic, and the sampler's
state dict resumes the exact batch sequence of an uninterrupted run.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hyperparallel.corpus import default_corpus, default_corpus_info

__all__ = [
    "ByteTokenizer",
    "PackedBlocks",
    "ShardedSampler",
    "batch",
    "default_corpus",
    "default_corpus_info",
    "load_documents",
]

SUPPORTED_SUFFIXES = (".txt", ".jsonl")


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus ``bos_id`` 256, ``eos_id`` 257 and ``pad_id`` 258."""

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``, without special tokens."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of the byte tokens in ``ids``; specials are skipped, bad UTF-8 replaced."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                out.append(i)
            elif not 256 <= i < self.vocab_size:
                raise ValueError(
                    f"token id {i} is outside the byte vocabulary 0..{self.vocab_size - 1}"
                )
        return out.decode("utf-8", errors="replace")


def files(paths: str | Sequence[str]) -> list[Path]:
    """The files ``paths`` (globs) name, in the order given, each one's matches sorted and a
    file matched twice listed once; ``~`` is expanded and ``**`` recurses. A pattern matching
    nothing is a ``FileNotFoundError``, a directory or another file type a ``ValueError``."""
    found: dict[Path, None] = {}
    for pattern in [paths] if isinstance(paths, str) else paths:
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not matches:
            hint = (
                f" (several globs are a list: [{', '.join(p.strip() for p in pattern.split(','))}])"
                if "," in pattern
                else ""
            )
            raise FileNotFoundError(f"no file matches {pattern!r}; check the path or glob{hint}")
        found.update((Path(m), None) for m in matches)
    for path in found:
        if path.is_dir():
            raise ValueError(f"{path} is a directory; pass a glob such as '{path}/*.txt'")
        if path.suffix not in SUPPORTED_SUFFIXES:
            raise ValueError(
                f"{path}: unsupported file type {path.suffix!r}; supported: "
                f"{', '.join(SUPPORTED_SUFFIXES)}"
            )
    return list(found)


def _read_jsonl(path: Path, text_key: str) -> list[str]:
    docs = []
    with path.open(encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: invalid JSON ({e.msg}); each line must be one object"
                ) from e
            if not isinstance(record, dict):
                raise ValueError(
                    f"{path}:{lineno}: a JSON {type(record).__name__}, not an object; each line "
                    f"must be one object with a {text_key!r} field"
                )
            if text_key not in record:
                raise ValueError(
                    f"{path}:{lineno}: no {text_key!r} field; set data.text_key to the field "
                    "holding the text"
                )
            text = record[text_key]
            if not isinstance(text, str):
                raise ValueError(
                    f"{path}:{lineno}: field {text_key!r} is {type(text).__name__}, "
                    "expected a string"
                )
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:  # valid JSON ("\ud800"), no UTF-8 text
                raise ValueError(
                    f"{path}:{lineno}: field {text_key!r} holds {e.object[e.start]!r} at "
                    f"character {e.start}, a lone surrogate that UTF-8 cannot encode"
                ) from None
            docs.append(text)
    return docs


def load_documents(paths: str | Sequence[str], text_key: str = "text") -> list[str]:
    """Documents from files or globs: a ``.txt`` file is one document, a ``.jsonl`` line is one.

    The files are those of :func:`files`. Empty documents are skipped.
    """
    docs: list[str] = []
    for path in files(paths):
        try:
            found = (
                [path.read_text(encoding="utf-8")]
                if path.suffix == ".txt"
                else _read_jsonl(path, text_key)
            )
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not valid UTF-8 ({e.reason})") from e
        docs.extend(doc for doc in found if doc.strip())
    return docs


class PackedBlocks:
    """Documents as one token stream ``[bos] doc [eos] [bos] doc [eos] ...`` cut into blocks.

    Block ``i`` holds ``seq_len + 1`` consecutive tokens: inputs are ``block[:-1]``, labels
    ``block[1:]``. Blocks do not overlap and the trailing remainder is dropped.
    """

    def __init__(
        self, documents: Sequence[str], tokenizer: ByteTokenizer, seq_len: int, world: int = 1
    ) -> None:
        """Tokenize and pack ``documents``; ``world`` ranks must get at least one block each."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        if world < 1:
            raise ValueError(f"world must be at least 1, got {world}")
        stream = array("i")
        for doc in documents:
            stream.append(tokenizer.bos_id)
            stream.extend(tokenizer.encode(doc))
            stream.append(tokenizer.eos_id)
        self.seq_len = seq_len
        self.num_tokens = len(stream)
        block = seq_len + 1
        needed = world * block
        if self.num_tokens < needed:
            raise ValueError(
                f"the documents hold {self.num_tokens} tokens, but seq_len={seq_len} on {world} "
                f"data-parallel rank(s) needs at least {needed} (one block of seq_len + 1 per "
                "rank); add documents or lower seq_len"
            )
        count = self.num_tokens // block
        tokens = torch.frombuffer(stream, dtype=torch.int32)
        self._blocks = tokens[: count * block].clone().view(count, block)
        # the blocks' tokens hashed: a resume checks it continues on the same data
        digest = hashlib.blake2b(self._blocks.numpy().tobytes(), digest_size=16)
        self.fingerprint = digest.hexdigest()

    def __len__(self) -> int:
        """The number of blocks."""
        return self._blocks.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        """Block ``index``: ``seq_len + 1`` int64 token ids."""
        return self._blocks[index].long()


class ShardedSampler:
    """Per-rank batches of block indices, in a fresh deterministic order each epoch.

    Epoch ``e`` permutes all blocks with a generator seeded ``seed + e`` and truncates the
    permutation to whole steps of ``world * batch_size`` blocks. Step ``s`` uses permutation
    entries ``[s * world * batch_size, (s + 1) * world * batch_size)``; rank ``r`` takes the
    ``r``-th run of ``batch_size`` of them, so ranks never share a block within an epoch.
    The state is the same on every rank, so any one rank can save it.
    """

    def __init__(
        self,
        num_blocks: int,
        batch_size: int,
        rank: int,
        world: int,
        seed: int,
        fingerprint: str = "",
    ) -> None:
        """Sample from ``num_blocks`` blocks; ``batch_size`` is the per-rank micro-batch;
        ``fingerprint`` names the blocks' content (:attr:`PackedBlocks.fingerprint`), which a
        resume must match."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if world < 1 or not 0 <= rank < world:
            raise ValueError(
                f"rank must be in 0..world-1 with world >= 1, got rank={rank}, world={world}"
            )
        step = world * batch_size
        if num_blocks < step:
            raise ValueError(
                f"{num_blocks} blocks cannot fill one step of world={world} x "
                f"batch_size={batch_size} = {step} blocks; add data or lower seq_len or batch_size"
            )
        self.num_blocks = num_blocks
        self.fingerprint = fingerprint
        self.batch_size = batch_size
        self.rank = rank
        self.world = world
        self.seed = seed
        self.steps_per_epoch = num_blocks // step
        self._epoch = 0
        self._position = 0
        self._order: torch.Tensor | None = None

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (starting at 0)."""
        return self._epoch

    @property
    def position(self) -> int:
        """How many batches of the current epoch have been taken."""
        return self._position

    def next_indices(self) -> list[int]:
        """This rank's next batch of block indices; moves into the next epoch after the last."""
        if self._order is None:
            generator = torch.Generator().manual_seed(self.seed + self._epoch)
            self._order = torch.randperm(self.num_blocks, generator=generator)
        start = (self._position * self.world + self.rank) * self.batch_size
        indices = self._order[start : start + self.batch_size].tolist()
        self._position += 1
        if self._position == self.steps_per_epoch:
            self._epoch += 1
            self._position = 0
            self._order = None
        return indices

    def state_dict(self) -> dict[str, int]:
        """Everything needed to resume: progress, seed and the layout it is valid for."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "world": self.world,
            "batch_size": self.batch_size,
            "num_blocks": self.num_blocks,
            "documents": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()`` output; the seed is taken from it, the layout must match."""
        missing = sorted(set(self.state_dict()) - set(state) - {"documents"})  # newer key
        if missing:
            raise ValueError(
                f"sampler state lacks {', '.join(missing)}; was it saved by ShardedSampler?"
            )
        for key in ("world", "batch_size", "num_blocks"):
            saved, current = int(state[key]), getattr(self, key)
            if saved != current:
                raise ValueError(
                    f"the sampler state was saved with {key}={saved} but this run has "
                    f"{key}={current}; resuming needs the same data and data-parallel layout "
                    "(world size, per-rank batch size, seq_len and documents)"
                )
        saved_documents = state.get("documents", "")
        if saved_documents and self.fingerprint and saved_documents != self.fingerprint:
            raise ValueError(
                "the sampler state was saved from other documents (as many blocks, other "
                "tokens); resuming needs the same data: point data.path at the documents the "
                "run was trained on"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.steps_per_epoch:
            raise ValueError(
                f"sampler state has epoch={epoch}, position={position}; expected epoch >= 0 and "
                f"position in 0..{self.steps_per_epoch - 1}"
            )
        self.seed = int(state["seed"])
        self._epoch = epoch
        self._position = position
        self._order = None


def batch(blocks: PackedBlocks, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack the blocks at ``indices`` into int64 ``(input_ids, labels)``, each ``[B, seq_len]``."""
    if len(indices) == 0:
        raise ValueError("batch needs at least one block index, got none")
    rows = torch.stack([blocks[i] for i in indices])
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
