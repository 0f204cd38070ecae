"""Device mesh and FSDP2 sharding: ``fully_shard`` per decoder layer and at the root, over a
1-D (FSDP) or 2-D replicate x shard (HSDP) mesh, with optional mixed precision, per-layer
activation checkpointing and per-layer ``torch.compile``. One rank without mixed precision
trains the plain module."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hyperparallel.config import ParallelSection
from hyperparallel.model import decoder_layers

DTYPES = {"bf16": torch.bfloat16}


def mesh(device_type: str, world: int, replicate: int) -> DeviceMesh:
    """``("shard",)`` for plain FSDP, ``("replicate", "shard")`` for HSDP."""
    if replicate < 1 or world % replicate:
        raise ValueError(
            f"parallel.replicate={replicate} does not divide the world size {world}; "
            f"HSDP needs world = replicate x shard"
        )
    if replicate == 1:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(
        device_type, (replicate, world // replicate), mesh_dim_names=("replicate", "shard")
    )


def policy(mixed_precision: str) -> MixedPrecisionPolicy:
    """Parameters (and gradients) cast to the chosen dtype for compute; reductions in fp32."""
    if mixed_precision == "none":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=DTYPES[mixed_precision], reduce_dtype=torch.float32)


def uses_fsdp(world: int, parallel: ParallelSection) -> bool:
    """False for one rank without mixed precision: FSDP2 would shard nothing and cast nothing,
    only add per-layer copies, so the model trains unwrapped (checkpoints keep one format)."""
    return world > 1 or parallel.mixed_precision != "none"


def shard(
    model: torch.nn.Module,
    device_mesh: DeviceMesh,
    parallel: ParallelSection,
    compile_backend: str | None = None,
) -> torch.nn.Module:
    """Apply activation checkpointing (if asked), ``torch.compile`` with ``compile_backend``
    (if given) and FSDP2 (if :func:`uses_fsdp`) to each decoder layer, in that order, then
    FSDP2 to the root.

    Each layer is compiled in place (``Module.compile``): its state-dict keys stay those of
    the eager model (no ``_orig_mod.`` prefix), so checkpoints and the export do not depend
    on the setting. Compiled before ``fully_shard``, the graph holds the layer's computation
    while FSDP2's all-gather and reshard hooks run eagerly around it."""
    mp = policy(parallel.mixed_precision)
    fsdp = uses_fsdp(device_mesh.size(), parallel)
    for layer in decoder_layers(model):
        if parallel.activation_checkpointing:
            from torch.distributed._composable import checkpoint

            checkpoint(layer)
        if compile_backend is not None:
            layer.compile(backend=compile_backend, fullgraph=False)
        if fsdp:
            fully_shard(
                layer,
                mesh=device_mesh,
                mp_policy=mp,
                reshard_after_forward=parallel.reshard_after_forward,
            )
    if fsdp:
        fully_shard(model, mesh=device_mesh, mp_policy=mp)
    return model
