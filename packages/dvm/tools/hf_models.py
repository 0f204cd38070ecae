"""Many tiny Hugging Face models under ``backend="dvm"`` against eager: a sweep for wrong
results and for graphs dvm failed to compile (which then run eagerly, with a warning).

Each model class is built from its default config with the sizes made tiny (the attributes
below, where the config's default is of the same type, a tuple for a list, or None) and dropout
off, from seed 0; causal LMs train on a batch of token ids (their loss), base models on
``sin(output).sum()`` (a loss whose gradients are not near zero, as a squared LayerNorm
output's are). One line a model: the loss's relative difference from eager's, the largest
gradient difference relative to that parameter's largest gradient (parameters whose gradients
are all below 1e-5 of the model's largest are skipped: noise around a zero gradient, such as a
key bias's), the graphs dvm compiled, their regions and VM calls, and any compile failure.
With ``--dtype bf16`` the differences are from a float64 run of the same weights, eager bf16's
beside dvm's: each is off by its own rounding. A model that fails under dvm is run under
``aot_eager`` too, to tell dvm's failures from the model's or dynamo's. ``--dynamic``
compiles with ``dynamic=True`` and runs a second token length (image models: a second batch
size).

    python packages/dvm/tools/hf_models.py --kind causal [--dtype bf16] [--dynamic]
    python packages/dvm/tools/hf_models.py --kind base
"""

from __future__ import annotations

import argparse
import copy
import math
import warnings
from typing import Any

import torch

from dvm.backend import make_backend

TINY = {
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "n_inner": 128,
    "ffn_dim": 128,
    "d_ff": 128,
    "vocab_size": 256,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "num_local_experts": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "image_size": 32,
    "patch_size": 8,
    "embed_dim": 32,
    "depths": [1, 1],
    "num_heads": [2, 4],
    "hidden_sizes": [16, 32],
    "window_size": 2,
}
CAUSAL = [
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "OlmoeForCausalLM",
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "PhiForCausalLM",
    "GPTNeoXForCausalLM",
    "OPTForCausalLM",
    "BloomForCausalLM",
    "FalconForCausalLM",
    "GPTBigCodeForCausalLM",
    "StableLmForCausalLM",
    "Starcoder2ForCausalLM",
    "OlmoForCausalLM",
    "Olmo2ForCausalLM",
    "CohereForCausalLM",
    "GraniteForCausalLM",
    "NemotronForCausalLM",
    "PersimmonForCausalLM",
    "MptForCausalLM",
    "XGLMForCausalLM",
    "BioGptForCausalLM",
    "GPTNeoForCausalLM",
    "GPT2LMHeadModel",
]
BASE = [
    "BertModel",
    "RobertaModel",
    "DistilBertModel",
    "AlbertModel",
    "ElectraModel",
    "DebertaModel",
    "DebertaV2Model",
    "MPNetModel",
    "T5EncoderModel",
    "ViTModel",
    "DeiTModel",
    "SwinModel",
    "Swinv2Model",
    "ConvNextModel",
    "ConvNextV2Model",
    "ResNetModel",
    "RegNetModel",
    "CLIPVisionModel",
    "SiglipVisionModel",
    "Dinov2Model",
    "BeitModel",
    "SegformerModel",
]
IMAGES = ("ViT", "DeiT", "Swin", "ConvNext", "ResNet", "RegNet", "CLIP", "Siglip", "Dinov2", "Beit")
IMAGES += ("Segformer",)


def _model(name: str, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    cls = getattr(transformers, name)
    config = cls.config_class()
    for key, value in TINY.items():  # only where the default is of the same kind
        default = getattr(config, key, None)
        if isinstance(default, (list, tuple)) and isinstance(value, list):
            value = type(default)(value)  # Swin's and ConvNeXt's stages are tuples
        if type(default) is not type(value) and not (default is None and hasattr(config, key)):
            continue  # None: worked out when unset (Nemotron's key-value heads are the heads)
        try:
            setattr(config, key, value)
        except AttributeError:  # a property worked out from other fields
            continue
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key or "drop_path" in key):
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    return cls(config).to(dtype).train()


LENGTHS = (16, 23)
"""The token lengths run (the second with ``--dynamic``); image models take batches of 2 and 3."""


def _inputs(name: str, length: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if name.startswith(IMAGES):
        batch = 2 + LENGTHS.index(length)
        return {"pixel_values": torch.randn(batch, 3, 32, 32, generator=g).to(dtype)}
    ids = torch.randint(0, TINY["vocab_size"], (2, length), generator=g)
    return {"input_ids": ids, "labels": ids} if name in CAUSAL else {"input_ids": ids}


def _loss(name: str, out: Any) -> torch.Tensor:
    if name in CAUSAL:
        return out.loss.float()
    hidden = (
        out.last_hidden_state if getattr(out, "last_hidden_state", None) is not None else out[0]
    )
    return hidden.float().sin().sum()


Diffs = tuple[float, float]


def _step(name: str, model: torch.nn.Module, forward: Any, batch: dict[str, Any]) -> Any:
    """One forward and backward: the loss and each parameter's gradient (float64)."""
    loss = _loss(name, forward(**batch))
    loss.backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return loss.detach().double(), grads


def _diffs(got: Any, want: Any) -> Diffs:
    """The loss's relative difference and the largest gradient difference relative to that
    parameter's largest gradient (parameters below 1e-5 of the largest skipped)."""
    (got_loss, got_grads), (want_loss, want_grads) = got, want
    loss = ((want_loss - got_loss).abs() / want_loss.abs().clamp_min(1e-12)).item()
    floor = 1e-5 * max(g.abs().max().item() for g in want_grads.values())
    grad = 0.0
    for key, w in want_grads.items():
        scale = w.abs().max().item()
        if scale > floor:
            grad = max(grad, (w - got_grads[key]).abs().max().item() / scale)
    return loss, grad


def _max(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _compare(name: str, dtype: torch.dtype, backend: Any, dynamic: bool) -> list[Diffs]:
    """The largest differences over the lengths run of ``backend``'s step from eager's, in
    float32; in a 16-bit dtype, of ``backend``'s and of eager's (in that dtype) from a float64
    run of the same weights, as eager itself is off by its rounding (NaN for eager's when the
    model has no float64 run: then ``backend``'s is from eager's)."""
    model = _model(name, dtype)
    low = dtype != torch.float32
    exact = copy.deepcopy(model).double() if low else None
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, dynamic=dynamic or None)
    worst = [(0.0, 0.0), (0.0, 0.0)] if low else [(0.0, 0.0)]
    for length in LENGTHS if dynamic else LENGTHS[:1]:
        batch = _inputs(name, length, dtype)
        steps = [_step(name, model, compiled, batch), _step(name, eager, eager, batch)]
        diffs = [_diffs(steps[0], steps[1])]
        if low:
            wide = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
            try:
                want = _step(name, exact, exact, wide)
            except RuntimeError:  # an op without float64 (MoE grouped mm): against eager's
                diffs.append((math.nan, math.nan))
            else:
                diffs = [_diffs(steps[0], want), _diffs(steps[1], want)]
        worst = [(_max(a, c), _max(b, d)) for (a, b), (c, d) in zip(worst, diffs, strict=True)]
    return worst


def _row(name: str, dtype: torch.dtype, dynamic: bool) -> str:
    graphs: list[Any] = []
    backend = make_backend(lambda _kind, compiled: graphs.append(compiled))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            diffs = _compare(name, dtype, backend, dynamic)
    except Exception as e:
        try:
            _compare(name, dtype, "aot_eager", dynamic)
            also = "aot_eager runs it"
        except Exception as e2:
            also = f"aot_eager fails too ({type(e2).__name__})"
        return f"{name:24s} FAILS {type(e).__name__}: {str(e)[:120]} [{also}]"
    failed = [str(w.message)[:160] for w in caught if "dvm could not" in str(w.message)]
    regions = sum(len(g.regions) for g in graphs)
    calls = sum(g.vm_calls for g in graphs)
    (loss, grad), *eager = diffs
    against = f"  (eager: loss {eager[0][0]:.1e}  grad {eager[0][1]:.1e})" if eager else ""
    if eager and math.isnan(eager[0][0]):
        against = "  (from eager bf16: the model has no float64 run)"
    return (
        f"{name:24s} loss {loss:.1e}  grad {grad:.1e}{against}  {len(graphs)} graphs, "
        f"{regions} regions, {calls} VM calls{'  ' + '; '.join(failed) if failed else ''}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=["causal", "base"], default="causal")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument(
        "--dynamic", action="store_true", help="dynamic=True, two lengths (batches)"
    )
    parser.add_argument("models", nargs="*", help="model classes (default: the kind's list)")
    args = parser.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    import transformers

    names = args.models or (CAUSAL if args.kind == "causal" else BASE)
    unknown = [n for n in names if not hasattr(transformers, n)]
    if unknown:
        parser.error(f"not in transformers {transformers.__version__}: {', '.join(unknown)}")
    for name in names:
        print(_row(name, dtype, args.dynamic), flush=True)


if __name__ == "__main__":
    main()
