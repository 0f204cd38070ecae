"""``ParallelManager``: which torch.distributed group the parallel features use, and this
process's place in it."""

from __future__ import annotations

import torch.distributed as dist


class ParallelManager:
    """This process's rank and the world size of a torch.distributed group (default: WORLD).

    The process group must already be initialised (``torch.distributed.init_process_group``);
    any backend works (gloo on CPU, nccl/hccl on accelerators).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ParallelManager needs an initialised torch.distributed process group; call "
                "torch.distributed.init_process_group(...) first"
            )
        self.group: dist.ProcessGroup = group if group is not None else dist.group.WORLD
        self.rank: int = dist.get_rank(self.group)
        self.world: int = dist.get_world_size(self.group)
        if self.rank < 0:
            raise ValueError(
                "this process is not a member of the process group given to ParallelManager; "
                "pass a group that contains it"
            )

    def __deepcopy__(self, memo: dict[int, object]) -> ParallelManager:
        """The manager itself: a deep copy of a boosted model shares its process group (which
        cannot be copied)."""
        return self

    def __repr__(self) -> str:
        return f"ParallelManager(rank={self.rank}, world={self.world})"
