"""Multi-process inference: Ulysses sequence parallel attention and VAE temporal-slice data
parallel over a torch.distributed group (see :class:`ParallelManager`)."""

from lite_boost.parallel.manager import ParallelManager
from lite_boost.parallel.sequence import gather_sequence, shard_sequence
from lite_boost.parallel.ulysses import ulysses_attention
from lite_boost.parallel.vae import decode_temporal_parallel, wan_decoder_overlap

__all__ = [
    "ParallelManager",
    "decode_temporal_parallel",
    "gather_sequence",
    "shard_sequence",
    "ulysses_attention",
    "wan_decoder_overlap",
]
