"""Wan boosters on diffusers' own models from tiny configs (random weights, CPU, float32)."""

from __future__ import annotations

import copy
import datetime
import io
import json
import math
import os
import socket
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lite_boost import rope3d
from lite_boost.boosters import BoostOptions, boost, find
from lite_boost.boosters import wan as W
from spore import childproc

transformer_wan = pytest.importorskip("diffusers.models.transformers.transformer_wan")

TINY = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 12,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": 16,
    "freq_dim": 16,
    "ffn_dim": 32,
    "num_layers": 2,
    "rope_max_seq_len": 32,
}
# float32 tolerance of the whole tiny model: the boosted path differs from diffusers' only in
# float32 rounding (RoPE as x*cos + rot(x)*sin through one op, SDPA on another layout)
ATOL = RTOL = 1e-5
# bf16: the boosted model's largest error from float32 against diffusers' own bf16 model's
BF16_FACTOR = 1.5


def _model(seed=0, **config):
    torch.manual_seed(seed)
    return transformer_wan.WanTransformer3DModel(**{**TINY, **config}).eval()


def _vae():
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True]
    ).eval()


def _inputs(frames=3, height=8, width=8, batch=2, smooth=False, seed=1, per_token=False):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, TINY["in_channels"], frames, height, width)
    if smooth:  # a structured video: low-frequency waves in time and space, per channel
        t, y, x = torch.meshgrid(
            torch.linspace(0, 1, frames),
            torch.linspace(0, 1, height),
            torch.linspace(0, 1, width),
            indexing="ij",
        )
        phase = torch.rand(batch, shape[1], 3, generator=g) * 2 * math.pi
        latents = (
            torch.sin(2 * math.pi * x + phase[..., 0, None, None, None])
            + torch.cos(2 * math.pi * y + phase[..., 1, None, None, None])
            + 0.5 * torch.sin(math.pi * t + phase[..., 2, None, None, None])
        )
    else:
        latents = torch.randn(shape, generator=g)
    text = torch.randn(batch, 5, TINY["text_dim"], generator=g)
    if per_token:  # Wan 2.2 TI2V: one timestep per latent token
        tokens = frames * (height // 2) * (width // 2)
        return latents, torch.randint(0, 1000, (batch, tokens), generator=g), text
    return latents, torch.tensor([500] * batch), text


def _run(model, latents, timestep, text):
    with torch.no_grad():
        return model(latents, timestep, text, return_dict=False)[0]


@pytest.mark.parametrize("per_token", [False, True])
def test_sparsity_zero_equals_the_original(per_token):
    model = _model()
    inputs = _inputs(per_token=per_token)
    want = _run(model, *inputs)
    boosted = boost(copy.deepcopy(model), sparsity=0.0)
    assert isinstance(boosted.rope, W.CachedWanRope)
    processors = [m.processor for m in boosted.modules() if hasattr(m, "set_processor")]
    assert len(processors) == 2 * TINY["num_layers"]
    assert all(isinstance(p, W.WanAttnProcessor) for p in processors)
    got = _run(boosted, *inputs)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_a_boosted_model_compiles_as_one_graph():
    """The RoPE tables' cache takes a lock, which dynamo cannot trace: a boosted model failed
    ``torch.compile(fullgraph=True)``, which the original passes. Traced, the tables are made
    in the graph, equal to the cached ones."""
    model = _model()
    inputs = _inputs()
    want = _run(model, *inputs)
    boosted = boost(copy.deepcopy(model), sparsity=0.0)
    torch._dynamo.reset()
    compiled = torch.compile(boosted, backend="aot_eager", fullgraph=True)
    hits = rope3d.cache_info().hits
    torch.testing.assert_close(_run(compiled, *inputs), want, atol=ATOL, rtol=RTOL)
    assert rope3d.cache_info().hits == hits  # the compiled model did not read the cache


@pytest.mark.parametrize("sparsity", [0.0, 0.5])
def test_a_step_under_inference_mode_leaves_training_working(sparsity):
    """A validation step under torch.inference_mode, then a training step on the same grid: the
    RoPE tables the first one cached must not be inference tensors (autograd cannot save
    those), and the gradients equal diffusers' own."""
    rope3d.cache_clear()
    model = _model()
    boosted = boost(copy.deepcopy(model), sparsity=sparsity, block_size=8)
    inputs = _inputs(batch=1)
    with torch.inference_mode():
        boosted(*inputs, return_dict=False)
    boosted(*inputs, return_dict=False)[0].pow(2).mean().backward()
    if sparsity == 0.0:
        model(*inputs, return_dict=False)[0].pow(2).mean().backward()
        for (name, p), q in zip(boosted.named_parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    else:
        assert all(p.grad is not None for p in boosted.parameters() if p.requires_grad)


def test_boosted_runs_the_lite_boost_paths(monkeypatch):
    """The boosted model really uses lite-boost's attention and cached RoPE tables."""
    calls = []
    real = W.backends.attention

    def counting(q, k, v, **kwargs):
        calls.append(q.shape)
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(W.backends, "attention", counting)
    rope3d.cache_clear()
    model = boost(_model(), sparsity=0.0)
    _run(model, *_inputs())
    _run(model, *_inputs(seed=2))
    assert len(calls) == 2 * 2 * TINY["num_layers"]  # self + cross, two runs
    info = rope3d.cache_info()
    assert (info.misses, info.hits) == (1, 1)


def test_boosting_twice_is_one_boost():
    model = _model()
    inputs = _inputs(frames=2, height=6, width=10)
    want = _run(model, *inputs)
    boosted = boost(boost(copy.deepcopy(model), sparsity=0.0), sparsity=0.0)
    assert isinstance(boosted.rope, W.CachedWanRope)
    assert not boosted._lite_boost_handles
    attn = boosted.blocks[0].attn1
    assert isinstance(attn.processor, W.WanAttnProcessor)
    torch.testing.assert_close(_run(boosted, *inputs), want, atol=ATOL, rtol=RTOL)


def test_diffusers_attention_backend_is_refused_naming_lite_boosts_choice(monkeypatch):
    """``set_attention_backend("flex")`` on a boosted model was taken and changed nothing (the
    processors run lite-boost's backend): refused, naming ``use_backend``/the environment
    variable, before diffusers switches its global backend; a reset is taken. A hub backend
    (``flash_hub``) was refused only after diffusers checked its package and fetched its kernel
    from the Hub: refused before diffusers' backend setup runs."""
    from diffusers.models import attention_dispatch
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as registry

    setup = []
    for step in ("_check_attention_backend_requirements", "_maybe_download_kernel_for_backend"):
        real = getattr(attention_dispatch, step)
        monkeypatch.setattr(
            attention_dispatch, step, lambda b, step=step, real=real: (setup.append(step), real(b))
        )
    model = boost(_model(), sparsity=0.0)
    inputs = _inputs(batch=1)
    want = _run(model, *inputs)
    active = registry.get_active_backend()
    try:
        for name in ("flex", "native", "flash_hub", "sage_hub", "flash"):
            with pytest.raises(ValueError, match=f"set_attention_backend\\('{name}'\\)") as e:
                model.set_attention_backend(name)
            assert "lite_boost.use_backend" in str(e.value)
            assert W.backends.ENV in str(e.value)
            assert registry.get_active_backend() == active
        with pytest.raises(ValueError, match="set_attention_backend\\('flex'\\)"):
            model.blocks[0].attn1.set_attention_backend("flex")  # one module's
    finally:
        registry.set_active_backend(active[0])
    assert setup == []  # diffusers never checked nor fetched a backend
    model.reset_attention_backend()
    assert isinstance(model.blocks[0].attn1.processor, W.WanAttnProcessor)
    torch.testing.assert_close(_run(model, *inputs), want)


def test_a_diffusers_attention_backend_block_warns_at_the_call():
    """Under diffusers' ``with attention_backend("flex"):`` a boosted model ran lite-boost's
    backend, silently: it still does (another model's set_attention_backend sets the same
    global backend), with a warning naming lite-boost's way to choose; under diffusers'
    default backend (outside the block, or a block naming it) it warns nothing."""
    from diffusers.models.attention_dispatch import attention_backend

    model = boost(_model(), sparsity=0.0)
    inputs = _inputs(batch=1)
    want = _run(model, *inputs)
    ignored = "ignores diffusers' active attention backend 'flex'"
    with attention_backend("flex"), pytest.warns(UserWarning, match=ignored) as caught:
        torch.testing.assert_close(_run(model, *inputs), want)
    assert "lite_boost.use_backend" in str(caught[0].message)
    assert W.backends.ENV in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with attention_backend("native"):
            torch.testing.assert_close(_run(model, *inputs), want)
        torch.testing.assert_close(_run(model, *inputs), want)


def test_another_models_diffusers_backend_leaves_a_boosted_model_running():
    """diffusers' set_attention_backend on a model that is not boosted (a pipeline's second
    transformer) sets diffusers' backend for every model: the boosted model's forward was then
    refused with a ValueError; it runs lite-boost's backend, warning, as before either."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as registry

    boosted, other = boost(_model(), sparsity=0.0), _model(seed=1)
    inputs = _inputs(batch=1)
    want = _run(boosted, *inputs)
    active = registry.get_active_backend()
    try:
        other.set_attention_backend("flex")
        with pytest.warns(UserWarning, match="another model's set_attention_backend\\('flex'\\)"):
            torch.testing.assert_close(_run(boosted, *inputs), want)
    finally:
        registry.set_active_backend(active[0])


def test_setting_diffusers_processors_on_a_boosted_model_is_refused():
    """diffusers' own processors set on a boosted model failed at the forward with a shape error
    (the cached RoPE tables are lite-boost's layout): refused when set, naming what to do, the
    model left as it was; boosting again (a copy too) still sets lite-boost's processors."""
    model = _model()
    inputs = _inputs(batch=1)
    want = _run(model, *inputs)
    boosted = boost(copy.deepcopy(model), sparsity=0.0)
    attn = boosted.blocks[0].attn1
    for set_processor in (boosted.set_attn_processor, attn.set_processor):
        with pytest.raises(ValueError, match="WanAttnProcessor cannot run on it") as e:
            set_processor(transformer_wan.WanAttnProcessor())
        assert "set processors on a model that is not boosted" in str(e.value)
    processors = [m.processor for m in boosted.modules() if hasattr(m, "set_processor")]
    assert all(isinstance(p, W.WanAttnProcessor) for p in processors)
    torch.testing.assert_close(_run(boosted, *inputs), want, atol=ATOL, rtol=RTOL)
    clone = boost(copy.deepcopy(boosted), sparsity=0.5, block_size=16)
    assert clone.blocks[0].attn1.processor.options.sparsity == 0.5
    assert boosted.blocks[0].attn1.processor.options.sparsity == 0.0  # the copy's own modules
    model.set_attn_processor(transformer_wan.WanAttnProcessor())  # not boosted: taken


def test_diffusers_context_parallelism_is_refused_naming_lite_boosts_own():
    """diffusers' context parallelism on a boosted model was taken, and its first forward died
    in spore.rope on RoPE tables for all tokens against this rank's share: refused, before
    diffusers changes anything (boosted first), or by the boost, before any change (diffusers'
    first: its ``_parallel_config``, as ``enable_parallelism`` or ``from_pretrained(...,
    parallel_config=...)`` records it; enabling it for real needs two ranks and an accelerator)."""
    from diffusers import ContextParallelConfig
    from diffusers.models._modeling_parallel import ParallelConfig

    model = _model()
    inputs = _inputs(batch=1)
    want = _run(model, *inputs)
    config = ContextParallelConfig(ulysses_degree=2)
    boosted = boost(copy.deepcopy(model), sparsity=0.0)
    for target in (boosted, copy.deepcopy(boosted)):
        with pytest.raises(ValueError, match="enable_parallelism\\(\\) on a lite-boost") as e:
            target.enable_parallelism(config=config)
        assert "lite_boost.boost(model, parallel=lite_boost.ParallelManager())" in str(e.value)
        assert target._parallel_config is None
    torch.testing.assert_close(_run(boosted, *inputs), want, atol=ATOL, rtol=RTOL)

    rope, processor = model.rope, model.blocks[0].attn1.processor
    model._parallel_config = ParallelConfig(context_parallel_config=config)
    with pytest.raises(ValueError, match="this Wan model has diffusers' context parallelism on"):
        boost(model, sparsity=0.0)
    assert model.rope is rope
    assert model.blocks[0].attn1.processor is processor
    assert "enable_parallelism" not in vars(model)
    assert not hasattr(model, "lite_boost_options")


def test_a_boosted_model_saves_and_loads_whole():
    """``torch.save(model)`` of a boosted model pickled its refusing ``set_attention_backend``
    and ``set_processor`` as bound methods, which ``torch.load`` could not rebuild
    ("'WanAttention' object has no attribute '_boosted_set_processor'"): the loaded model runs
    as the saved one, and still refuses diffusers' backends and processors."""
    boosted = boost(_model(), sparsity=0.0)
    inputs = _inputs(batch=1)
    buffer = io.BytesIO()
    torch.save(boosted, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(_run(loaded, *inputs), _run(boosted, *inputs), atol=0, rtol=0)
    with pytest.raises(ValueError, match="WanAttnProcessor cannot run on it"):
        loaded.blocks[0].attn1.set_processor(transformer_wan.WanAttnProcessor())
    with pytest.raises(ValueError, match="set_attention_backend\\('flex'\\)"):
        loaded.set_attention_backend("flex")
    assert isinstance(loaded.blocks[0].attn1.processor, W.WanAttnProcessor)


def test_fused_projections_and_diffusers_tables_in_the_processor():
    """The processor also takes fused q/k/v projections and diffusers' own RoPE tables."""
    model = _model()
    inputs = _inputs(batch=1)
    want = _run(model, *inputs)
    boosted = copy.deepcopy(model)
    W.boost_transformer(boosted, BoostOptions())
    boosted.rope = model.rope  # diffusers' (1, seq, 1, head_dim) tables
    boosted.fuse_qkv_projections()
    torch.testing.assert_close(_run(boosted, *inputs), want, atol=ATOL, rtol=RTOL)


def test_image_to_video_model_equals_the_original():
    """I2V: the image keys (added k/v projections) attend densely next to the text."""
    model = _model(image_dim=8, added_kv_proj_dim=2 * TINY["attention_head_dim"])
    g = torch.Generator().manual_seed(5)
    latents = torch.randn(1, 4, 2, 8, 8, generator=g)
    text = torch.randn(1, 512, TINY["text_dim"], generator=g)  # diffusers' Wan: 512 text tokens
    image = torch.randn(1, 3, 8, generator=g)

    def run(m):
        with torch.no_grad():
            return m(latents, torch.tensor([300]), text, image, return_dict=False)[0]

    want = run(model)
    torch.testing.assert_close(run(boost(copy.deepcopy(model))), want, atol=ATOL, rtol=RTOL)


def test_bfloat16_strays_from_float32_within_the_bound_of_diffusers_own_bfloat16():
    """In bf16 the boosted model's largest error from the float32 original is within
    ``BF16_FACTOR`` times diffusers' own bf16 error (1.00x here, 0.89-1.28x over 12 model and
    input seeds: bf16 rounding lands differently, so "no further" does not hold in general)."""
    model = _model()
    latents, timestep, text = _inputs()
    want = _run(model, latents, timestep, text)
    low = copy.deepcopy(model).to(torch.bfloat16)
    args = (latents.bfloat16(), timestep, text.bfloat16())
    theirs = (_run(low, *args).float() - want).abs().max().item()
    ours = (_run(boost(low), *args).float() - want).abs().max().item()
    assert ours <= BF16_FACTOR * theirs, (ours, theirs)


def test_the_readme_states_the_bfloat16_bound_tested():
    """The README said bf16 is "no further from fp32 than diffusers' own bf16"; the test allows
    ``BF16_FACTOR`` times as far."""
    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    assert f"within {BF16_FACTOR}x of diffusers' own bf16" in readme


def test_boosting_a_compiled_model_says_to_boost_before_compiling():
    """``boost(torch.compile(model))`` said only that no booster exists for OptimizedModule."""
    model = _model()
    with pytest.raises(LookupError, match=r"torch.compile wrapped the WanTransformer3DModel; "):
        boost(torch.compile(model))
    assert not isinstance(model.rope, W.CachedWanRope)  # the model was left as it was
    with pytest.raises(LookupError, match=r"^no lite-boost booster for Linear \("):
        boost(torch.compile(torch.nn.Linear(2, 2)))  # not a model to boost, compiled or not


def test_registry_finds_the_boosters_by_class_name():
    assert find("WanTransformer3DModel").apply is W.boost_transformer
    assert find(transformer_wan.WanTransformer3DModel).changes == W.TRANSFORMER_CHANGES
    assert find("AutoencoderKLWan").apply is W.boost_vae


def test_explain_shows_the_changes(run_spore):
    result = run_spore("lite-boost", "explain", "WanTransformer3DModel")
    assert result.returncode == 0, result.stderr
    assert "WanTransformer3DModel: booster from lite-boost" in result.stdout
    for change in W.TRANSFORMER_CHANGES:
        assert f"  - {change}" in result.stdout


def test_bad_inputs_give_clear_errors():
    model = boost(_model(), sparsity=0.0)
    with pytest.raises(TypeError, match="ParallelManager"):
        boost(model, parallel=object())
    attn = model.blocks[0].attn1
    x = torch.zeros(1, 8, 24)
    with pytest.raises(ValueError, match="no attention_mask"):
        attn(x, attention_mask=torch.ones(1, 8, 8, dtype=torch.bool))
    # sparse attention without lite-boost's rope (which carries the latent grid)
    sparse = W.WanAttnProcessor(BoostOptions(sparsity=0.5))
    with pytest.raises(ValueError, match="latent grid"):
        sparse(attn, x, rotary_emb=None)
    with pytest.raises(ValueError, match="block_size"):  # not read as a block of 1 token
        boost(model, sparsity=0.5, block_size=True)


def test_a_head_too_small_for_3d_rope_is_refused_at_boost_and_the_model_kept():
    """Diffusers' RoPE gives a 4-channel head no row or column channels; lite-boost's tables
    need 2 of each: the boost refuses it, before changing anything, not at the first forward."""
    model = _model(attention_head_dim=4)
    rope, processor = model.rope, model.blocks[0].attn1.processor
    with pytest.raises(ValueError, match="head_dim must be even and at least 6, got 4"):
        boost(model, sparsity=0.5)
    assert model.rope is rope
    assert model.blocks[0].attn1.processor is processor


def test_a_model_without_blocks_is_refused_parallel_before_any_change():
    """A bare IndexError came after the rope had been replaced (the hooks go on the first and
    last block)."""
    model = _model(num_layers=0)
    rope = model.rope
    two_ranks = types.SimpleNamespace(rank=0, world=2, group=None)  # read only at a forward
    with pytest.raises(ValueError, match=r"this model has none \(num_layers=0\)"):
        boost(model, parallel=two_ranks)
    assert model.rope is rope
    assert not hasattr(model, "lite_boost_options")


def test_vae_without_parallel_is_unchanged():
    vae = _vae()
    z = torch.randn(1, 4, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = vae.decode(z).sample
        boost(vae)
        got = vae.decode(z).sample
    assert "decode" not in vae.__dict__
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_sparsity_half_stays_close_on_a_smooth_video():
    model = _model()
    inputs = _inputs(frames=4, height=16, width=16, batch=1, smooth=True)
    want = _run(model, *inputs)
    boosted = boost(copy.deepcopy(model), sparsity=0.5, block_size=16)
    got = _run(boosted, *inputs)
    cosine = F.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
    assert cosine >= 0.99, cosine
    assert not torch.allclose(got, want, atol=1e-4)  # blocks were really skipped


def _sea_cache_steps(model, steps=8):
    """``model`` over a short drifting schedule with diffusers' SeaCache (27 tokens: an uneven
    split on 2 ranks): the outputs, and per step whether the blocks ran (not skipped)."""
    from diffusers import SeaCacheConfig

    model.enable_cache(SeaCacheConfig())
    ran = []
    handle = model.blocks[0].attn1.register_forward_hook(lambda *args: ran.append(True))
    latents, timestep, text = _inputs(frames=3, height=6, width=6, batch=1)
    drift = torch.randn(latents.shape, generator=torch.Generator().manual_seed(7))
    outputs, pattern = [], []
    for i in range(steps):
        before = len(ran)
        step = {"step_index": i, "sigma": 1 - i / steps, "num_inference_steps": steps}
        with model.cache_context("cond", **step):
            outputs.append(_run(model, latents + 0.02 * i * drift, timestep - 100 * i, text))
        pattern.append(len(ran) > before)
    handle.remove()
    model.disable_cache()
    return outputs, pattern


def _two_rank_cases(manager) -> dict:
    """What one rank of :func:`test_two_gloo_ranks_equal_one_process` measures."""
    from diffusers import FirstBlockCacheConfig

    from lite_boost.parallel import wan_decoder_overlap
    from lite_boost.parallel.vae import plan_chunks

    def diff(a, b):
        return (a - b).abs().max().item()

    result = {}
    model = _model()
    for name, kwargs in {
        "even": {"frames": 2, "height": 8, "width": 8},  # 32 tokens: 16 a rank
        "uneven_per_token": {"frames": 3, "height": 6, "width": 6, "per_token": True},  # 27
    }.items():
        inputs = _inputs(**kwargs)
        want = _run(model, *inputs)
        got = _run(boost(copy.deepcopy(model), parallel=manager), *inputs)
        result[name] = diff(got, want)
    try:  # under grad mode: gradients would stop at the gather, silently
        boost(copy.deepcopy(model), parallel=manager)(*inputs, return_dict=False)
        result["grad_error"] = None
    except RuntimeError as exc:
        result["grad_error"] = str(exc)
    inputs = _inputs(frames=4, height=16, width=16, batch=1, smooth=True)
    one = _run(boost(copy.deepcopy(model), sparsity=0.5, block_size=16), *inputs)
    two = boost(copy.deepcopy(model), sparsity=0.5, block_size=16, parallel=manager)
    result["sparse"] = diff(_run(two, *inputs), one)
    inputs = _inputs(frames=2, height=8, width=8)
    cached = boost(copy.deepcopy(model), parallel=manager)
    cached.enable_cache(FirstBlockCacheConfig(threshold=0.05))
    try:  # each rank would decide from its own tokens whether to skip blocks: an abort
        with cached.cache_context("cond"):
            _run(cached, *inputs)
        result["cache_error"] = None
    except RuntimeError as exc:
        result["cache_error"] = str(exc)
    cached.disable_cache()
    result["cache_disabled"] = diff(_run(cached, *inputs), _run(model, *inputs))
    # SeaCache decides from the model's whole input latents and the scheduler step: every rank
    # alike, so it skips the blocks where one process skips them, with the same outputs
    want, result["sea_pattern_one"] = _sea_cache_steps(boost(copy.deepcopy(model)))
    got, result["sea_pattern"] = _sea_cache_steps(boost(copy.deepcopy(model), parallel=manager))
    result["sea_cache"] = max(diff(a, b) for a, b in zip(got, want, strict=True))
    try:
        boost(_model(num_attention_heads=3), parallel=manager)
        result["heads_error"] = None
    except ValueError as exc:
        result["heads_error"] = str(exc)
    vae = _vae()
    frames = wan_decoder_overlap(vae) + 3  # enough for both ranks to keep frames
    result["vae_chunk"] = plan_chunks(frames, manager.world, wan_decoder_overlap(vae))[manager.rank]
    z = torch.randn(1, 4, frames, 4, 4, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = vae.decode(z).sample
        got = boost(vae, parallel=manager).decode(z).sample
    result["vae_shapes"] = [list(got.shape), list(want.shape)]
    result["vae"] = diff(got, want)
    clone = copy.deepcopy(vae)  # a copy decodes with its own weights, in parallel too
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(0.5)
        own = type(clone).decode(clone, z).sample
        result["vae_copy"] = [diff(clone.decode(z).sample, own), diff(own, want)]
    inputs = _inputs(frames=2, height=8, width=8)
    boosted = boost(copy.deepcopy(model), parallel=manager)
    result["model_copy"] = diff(_run(copy.deepcopy(boosted), *inputs), _run(model, *inputs))
    try:  # under grad mode, parameters that require grad would get none, silently
        boost(vae, parallel=manager).decode(z)
        result["vae_grad_error"] = None
    except RuntimeError as exc:
        result["vae_grad_error"] = str(exc)
    return result


def test_two_gloo_ranks_equal_one_process():
    """Ulysses (dense and sparse, uneven token split, per-token timesteps) and the VAE's
    temporal-parallel decode on 2 gloo ranks equal one process; diffusers' FirstBlockCache,
    whose skip decision each rank would take from its own tokens, is refused on every rank;
    diffusers' SeaCache, which decides from the whole input, skips as one process does."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = childproc.run_json_all(
        [[sys.executable, __file__, str(rank), "2", str(port)] for rank in range(2)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=240,
    )
    for r in results:
        assert r["even"] <= ATOL
        assert r["uneven_per_token"] <= ATOL
        assert r["sparse"] <= ATOL
        assert "sequence parallelism is for inference" in r["grad_error"]
        assert "cannot run with diffusers' FirstBlockCache" in r["cache_error"]
        assert r["cache_disabled"] <= ATOL
        assert r["sea_pattern"] == r["sea_pattern_one"]
        assert True in r["sea_pattern"]  # the blocks ran at some steps
        assert False in r["sea_pattern"]  # and were skipped at others
        assert r["sea_cache"] <= ATOL
        assert "3 attention heads" in r["heads_error"]
        assert "world size 2" in r["heads_error"]
        assert r["vae_chunk"] is not None  # this rank decoded a chunk
        assert r["vae_shapes"][0] == r["vae_shapes"][1]
        assert r["vae"] == 0.0  # the overlap covers the decoder's receptive field: bit-exact
        assert r["vae_copy"][0] == 0.0 < r["vae_copy"][1]  # the copy's weights, not the VAE's
        assert r["model_copy"] < 1e-5  # a copy shares the process group, and works
        assert "parallel VAE decode is for inference" in r["vae_grad_error"]


def _rank_main(rank: int, world: int, port: int) -> None:
    import faulthandler

    import torch.distributed as dist

    from lite_boost.parallel import ParallelManager

    faulthandler.enable()  # an abort in gloo's C++ prints where Python was
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    torch.set_num_threads(1)
    try:
        result = _two_rank_cases(ParallelManager())
    finally:
        dist.destroy_process_group()
    print(json.dumps(result), flush=True)
    # No interpreter teardown, as parallel_worker.py: a rank aborted now and then with
    # "terminate called without an active exception" (a gloo thread joinable at exit).
    os._exit(0)


if __name__ == "__main__":  # one rank of test_two_gloo_ranks_equal_one_process
    _rank_main(*map(int, sys.argv[1:4]))
