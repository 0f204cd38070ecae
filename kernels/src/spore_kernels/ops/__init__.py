"""One module per op family: its checks, reference (the oracle), CPU kernel wrappers, autograd
and ``register(registry)``. ``FAMILIES`` is the list the plugin registers, in order."""

from spore_kernels.ops import (
    add_rms_norm,
    block_sparse_attention,
    gelu,
    glu,
    layer_norm,
    mean_var,
    rms_norm,
    rope,
    triangle_attention,
)

FAMILIES = [
    rms_norm,
    add_rms_norm,
    layer_norm,
    mean_var,
    gelu,
    glu,
    rope,
    block_sparse_attention,
    triangle_attention,
]
