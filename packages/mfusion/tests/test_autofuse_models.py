"""Automatic fusion on a real model graph: a tiny Hugging Face Llama (random weights, CPU, fp32),
compiled with ``backend="spore"``, mfusion's hand-written passes off, the eager reference
region compiler taking the pointwise, reduction and RoPE ops."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers

from mfusion.autofuse import register_region_compiler
from mfusion.autofuse.eager import POINTWISE, EagerRegionCompiler

REGION = "mfusion_regions."  # the namespace of outlined region ops

aten = torch.ops.aten
OPS = (*POINTWISE, aten.pow, aten.rsqrt, aten.mean, aten.cos, aten.sin, aten.cat)
LAYERS = 2


def tiny_llama() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.usefixtures("only_autofuse")
def test_llama_forward_regions(mfusion_compile: Callable[..., Any]) -> None:
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad(), register_region_compiler(EagerRegionCompiler("wide", OPS)) as compiler:
        compiled = mfusion_compile(lambda i: model(i).logits, ids, env={"SPORE_PLUGINS": "mfusion"})
        expected = model(ids).logits
    (graph,) = compiled.graphs
    # per decoder layer: input RMSNorm, RoPE on q, RoPE on k, residual add + RMSNorm, SiLU·mul;
    # once: the cos and the sin scaling of the rotary tables, the final RMSNorm
    assert sum(v for k, v in graph.items() if k.startswith(REGION)) == 5 * LAYERS + 3
    structures = collections.Counter(
        tuple(str(n.target) for n in r.graph.nodes if n.op == "call_function")
        for r in compiler.compiled
    )
    rope = ("aten.mul.Tensor", "aten.neg.default", "aten.cat.default", "aten.mul.Tensor")
    assert structures[(*rope, "aten.add.Tensor")] == 2  # q and k differ in heads: two compiles
    assert len(compiler.compiled) == 8  # repeated structures (layers) share one compile
    torch.testing.assert_close(compiled.outputs, expected)  # fp32: default tolerance
