"""Boosters for diffusers' Wan video models: ``WanTransformer3DModel`` and ``AutoencoderKLWan``.

Importing this module is cheap: diffusers and the parallel and sparse modules are imported
only when a model is boosted or a boosted model runs.

Transformer: ``model.rope`` becomes :class:`CachedWanRope` (lite_boost.rope3d's cached float32
tables, which also carry the latent grid) and every ``WanAttention`` gets a
:class:`WanAttnProcessor`. With ``parallel`` a ``ParallelManager`` of world > 1, every rank
calls the model with the same inputs; the token sequence is split over the ranks before the
first block and gathered after the last, and self-attention runs through Ulysses all-to-all.

VAE: with ``parallel`` (world > 1), ``decode`` splits the latent frames over the ranks
(``lite_boost.parallel.decode_temporal_parallel``) with an overlap of the decoder's whole
causal receptive field (``lite_boost.parallel.wan_decoder_overlap``), so the frames equal a
one-process decode; otherwise the VAE is left unchanged. That receptive field is 38 latent
frames for the Wan 2.1 VAE: a video of fewer latent frames decodes on one rank.

Boosting again replaces the previous boost (options included); it never stacks.
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

from lite_boost import backends
from lite_boost.boosters import BoostOptions, _builtin_booster
from lite_boost.rope3d import apply_rope, rope_tables, split

TRANSFORMER_CHANGES = (
    "rope: WanRotaryPosEmbed is replaced by lite_boost.rope3d's cached float32 (cos, sin) "
    "tables per (grid, head_dim, device) (no per-call table build); they carry the latent grid",
    "self-attention (attn1): RoPE through torch.ops.spore.rope (interleaved pairs), attention "
    "through lite_boost.backends.attention when sparsity is 0, else "
    "lite_boost.sparse.sparse_attention over the (frames, height, width) latent grid "
    "(text_len 0, the boost's sparsity and block_size)",
    "cross-attention (attn2, text and image keys): dense attention through "
    "lite_boost.backends.attention",
    "parallel (a ParallelManager with world > 1): tokens are split over the ranks before the "
    "first block and gathered after the last; self-attention runs through "
    "lite_boost.parallel.ulysses_attention (heads must divide by the world size); a forward "
    "with diffusers' FirstBlockCache on raises RuntimeError (each rank would decide alone "
    "whether to skip blocks)",
    "diffusers' attention backends: model.set_attention_backend(name) raises ValueError before "
    "diffusers checks or downloads the backend (the processors use lite-boost's backend: "
    "lite_boost.use_backend or LITE_BOOST_ATTENTION); a forward under a diffusers backend other "
    "than its default (an attention_backend(name) block, or another model's "
    "set_attention_backend) warns and runs lite-boost's; reset_attention_backend() is taken",
    "processors: setting another processor on an attention module (set_attn_processor, "
    "set_processor) raises ValueError (diffusers' processors cannot take the cached RoPE "
    "tables); set processors on a model that is not boosted",
    "diffusers' context parallelism: model.enable_parallelism(...) raises ValueError, and a "
    "model that has it (enable_parallelism, from_pretrained(..., parallel_config=...)) is "
    "refused before any change (lite-boost's processors and RoPE tables do not take its token "
    "split); lite-boost's own is boost(model, parallel=lite_boost.ParallelManager())",
    "diffusers' SeaCache keeps working with parallel: its skip decision comes from the model's "
    "whole input latents and the scheduler step, the same on every rank",
    "projections, norms, feed-forward, embeddings and weights are unchanged",
)
VAE_CHANGES = (
    "parallel (a ParallelManager with world > 1): decode splits the latent frames over the "
    "ranks through lite_boost.parallel.decode_temporal_parallel, each chunk starting the "
    "decoder's causal receptive field early (lite_boost.parallel.wan_decoder_overlap: exact, "
    "38 latent frames for Wan 2.1), and all-gathers the frames",
    "inference only: a parallel decode under grad mode with latents or parameters that "
    "require grad raises RuntimeError (the frames would carry no gradient)",
    "without parallel (none, or world 1): nothing changes (a previous parallel boost is undone)",
)


def _manager(options: BoostOptions) -> Any:
    """The ParallelManager to use, or None when the boost is not parallel."""
    parallel = options.parallel
    if parallel is None:
        return None
    world = getattr(parallel, "world", None)
    if not isinstance(world, int) or getattr(parallel, "rank", None) is None:
        raise TypeError(
            f"parallel must be a lite_boost.parallel.ParallelManager, got {type(parallel).__name__}"
        )
    return parallel if world > 1 else None


class WanRope(tuple):
    """``(cos, sin)`` from :func:`lite_boost.rope3d.rope_tables` (this rank's tokens), with the
    full latent ``grid`` (frames, height, width) they belong to."""

    grid: tuple[int, int, int]

    def __new__(cls, cos: torch.Tensor, sin: torch.Tensor, grid: tuple[int, int, int]) -> WanRope:
        self = super().__new__(cls, (cos, sin))
        self.grid = grid
        return self


class CachedWanRope(torch.nn.Module):
    """Drop-in for ``WanRotaryPosEmbed``: ``forward(hidden_states)`` on the unpatched latents
    ``(batch, channels, frames, height, width)`` returns a :class:`WanRope`."""

    def __init__(
        self, attention_head_dim: int, patch_size: tuple[int, int, int], theta: float = 10000.0
    ) -> None:
        super().__init__()
        split(attention_head_dim)  # refused here, not at the first forward
        self.attention_head_dim = attention_head_dim
        self.patch_size = tuple(patch_size)
        self.theta = theta
        self.manager: Any = None

    def forward(self, hidden_states: torch.Tensor) -> WanRope:
        _, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.patch_size
        grid = (frames // p_t, height // p_h, width // p_w)
        cos, sin = rope_tables(
            grid, self.attention_head_dim, device=hidden_states.device, theta=self.theta
        )
        if self.manager is not None:
            from lite_boost.parallel import shard_sequence

            cos, sin = (shard_sequence(t, 0, self.manager) for t in (cos, sin))
        return WanRope(cos, sin, grid)


def _projections(
    attn: Any, hidden_states: torch.Tensor, context: torch.Tensor, self_attention: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if getattr(attn, "fused_projections", False):
        if self_attention:
            return attn.to_qkv(hidden_states).chunk(3, dim=-1)
        return attn.to_q(hidden_states), *attn.to_kv(context).chunk(2, dim=-1)
    return attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)


def _rotate(x: torch.Tensor, rotary_emb: Any) -> torch.Tensor:
    """RoPE on ``(batch, seq, heads, head_dim)``: lite-boost's tables, or diffusers' own
    ``(1, seq, 1, head_dim)`` tables (each pair's value twice), both interleaved."""
    cos, sin = rotary_emb
    if isinstance(rotary_emb, WanRope):
        return apply_rope(x, cos, sin, seq_dim=1)
    return torch.ops.spore.rope(x, cos, sin, "interleaved")


def _backend_name(backend: Any) -> str:
    """A diffusers backend's name (an ``AttentionBackendName`` or a str)."""
    return str(getattr(backend, "value", backend))


def _not_diffusers_backends(what: str) -> str:
    """Why a diffusers attention backend does nothing on a boosted model (``what`` happens),
    and how to choose lite-boost's."""
    return (
        f"a lite-boost-boosted Wan model does not use diffusers' attention backends, so {what}. "
        f"Pick lite-boost's backend with `with lite_boost.use_backend(name):` or the "
        f"{backends.ENV} environment variable (one of {backends.NAMES}; spore.dispatch.explain("
        f"'{backends.OP}', q, k, v) says which runs), or use diffusers' backends on a model that "
        f"is not boosted"
    )


def _diffusers_backends() -> tuple[Any, Any]:
    """diffusers' attention backend registry and its default backend (the
    ``DIFFUSERS_ATTN_BACKEND`` environment variable's at import, else ``native``)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
    from diffusers.utils.constants import DIFFUSERS_ATTN_BACKEND

    return _AttentionBackendRegistry, AttentionBackendName(DIFFUSERS_ATTN_BACKEND)


def _backend_refusal(backend: Any) -> ValueError:
    """The error for ``set_attention_backend(backend)`` on a boosted model or its modules."""
    return ValueError(
        _not_diffusers_backends(
            f"set_attention_backend({_backend_name(backend)!r}) would change nothing"
        )
    )


def _refused_set_attention_backend(model: torch.nn.Module, backend: str) -> None:
    """A boosted model's ``set_attention_backend``: refused before diffusers checks the
    backend's package or downloads its kernel (a hub backend's)."""
    raise _backend_refusal(backend)


def _context_parallel_refusal(what: str) -> ValueError:
    """The error for diffusers' context parallelism on a boosted model (``what`` happened)."""
    return ValueError(
        f"{what}: lite-boost's Wan boost cannot run with diffusers' context parallelism "
        f"(enable_parallelism, from_pretrained(..., parallel_config=...)), whose token split "
        f"its attention processors and RoPE tables do not take (they would fail at the first "
        f"forward). Use lite-boost's own sequence parallelism instead: load the model without "
        f"parallel_config and call lite_boost.boost(model, "
        f"parallel=lite_boost.ParallelManager()) on every rank"
    )


def _refused_enable_parallelism(model: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
    """A boosted model's ``enable_parallelism``: refused before diffusers changes anything."""
    raise _context_parallel_refusal("enable_parallelism() on a lite-boost-boosted Wan model")


def _boosted_set_processor(attn: torch.nn.Module, processor: Any) -> None:
    """A boosted ``WanAttention``'s ``set_processor``: lite-boost's :class:`WanAttnProcessor`
    only (diffusers' processors cannot take the cached RoPE tables or the parallel split)."""
    if not isinstance(processor, WanAttnProcessor):
        raise ValueError(
            f"a lite-boost-boosted Wan model runs lite-boost's attention processors (its RoPE "
            f"tables and parallel split are theirs), so {type(processor).__name__} cannot run "
            f"on it: set processors on a model that is not boosted (keep one with "
            f"lite_boost.boost(copy.deepcopy(model)), or load the model again)"
        )
    type(attn).set_processor(attn, processor)


class WanAttnProcessor:
    """lite-boost's processor for diffusers' ``WanAttention`` (self- and cross-attention, the
    I2V image keys included): same projections and norms as diffusers' ``WanAttnProcessor``,
    lite-boost's RoPE and attention (see :data:`TRANSFORMER_CHANGES`)."""

    IMAGE_TEXT_LEN = 512  # diffusers' Wan: the text context length after the image tokens

    def __init__(self, options: BoostOptions) -> None:
        self.options = options
        self.manager = _manager(options)
        self._diffusers_registry, self._diffusers_default = _diffusers_backends()

    @property
    def _attention_backend(self) -> None:
        """Always ``None``: diffusers' attention backend is not used here (see the setter)."""
        return None

    @_attention_backend.setter
    def _attention_backend(self, backend: Any) -> None:
        """``ValueError`` for a backend (diffusers' ``attn.set_attention_backend`` sets it),
        which would change nothing here; ``None`` (``reset_attention_backend``) is taken."""
        if backend is not None:
            raise _backend_refusal(backend)

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: Any = None,
    ) -> torch.Tensor:
        active = self._diffusers_registry._active_backend
        if active != self._diffusers_default:
            # an attention_backend(name) block, or any model's set_attention_backend(name),
            # which sets diffusers' backend for every model: a boosted model runs on under it
            name = _backend_name(active)
            message = _not_diffusers_backends(
                f"it ignores diffusers' active attention backend {name!r} (a `with "
                f"attention_backend({name!r}):` block around this call, or another model's "
                f"set_attention_backend({name!r}), which sets it for every model) and runs "
                f"lite-boost's"
            )
            warnings.warn(message, UserWarning, stacklevel=2)
        if attention_mask is not None:
            raise ValueError(
                "lite-boost's Wan attention takes no attention_mask (WanTransformer3DModel "
                "never passes one); call the model without it or do not boost it"
            )
        image = None
        if attn.add_k_proj is not None:
            split = encoder_hidden_states.shape[1] - self.IMAGE_TEXT_LEN
            image = encoder_hidden_states[:, :split]
            encoder_hidden_states = encoder_hidden_states[:, split:]
        self_attention = encoder_hidden_states is None
        context = hidden_states if self_attention else encoder_hidden_states
        q, k, v = _projections(attn, hidden_states, context, self_attention)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = _rotate(q, rotary_emb), _rotate(k, rotary_emb)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
        if self_attention:
            out = self._self_attention(q, k, v, rotary_emb)
        else:
            out = backends.attention(q, k, v)
        out = out.transpose(1, 2).flatten(2).type_as(q)
        if image is not None:
            k_img = attn.norm_added_k(attn.add_k_proj(image)).unflatten(2, (attn.heads, -1))
            v_img = attn.add_v_proj(image).unflatten(2, (attn.heads, -1))
            out_img = backends.attention(q, k_img.transpose(1, 2), v_img.transpose(1, 2))
            out = out + out_img.transpose(1, 2).flatten(2).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))

    def _self_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary_emb: Any
    ) -> torch.Tensor:
        attend: Callable[..., torch.Tensor] = backends.attention
        if self.options.sparsity > 0:
            grid = getattr(rotary_emb, "grid", None)
            if grid is None:
                raise ValueError(
                    "sparse Wan attention needs the latent grid, which lite-boost's rope "
                    "provides: boost the whole WanTransformer3DModel with lite_boost.boost"
                )
            from lite_boost.sparse import sparse_attention

            attend = functools.partial(
                sparse_attention,
                latent_shape=grid,
                text_len=0,
                sparsity=self.options.sparsity,
                block_size=self.options.block_size,
            )
        if self.manager is None:
            return attend(q, k, v)
        from lite_boost.parallel import ulysses_attention

        return ulysses_attention(attend, q, k, v, manager=self.manager)


FIRST_BLOCK_CACHE_HOOK = "fbc_leader_block_hook"
"""The name diffusers' FirstBlockCache gives its hook on the first transformer block."""


def _refuse_rank_local_cache(block: torch.nn.Module) -> None:
    """``RuntimeError`` (on every rank alike, before any collective) when diffusers'
    FirstBlockCache is on: it decides from the first block's output whether to skip the other
    blocks, and each rank would decide from its own tokens alone."""
    registry = getattr(block, "_diffusers_hook", None)
    if registry is not None and registry.get_hook(FIRST_BLOCK_CACHE_HOOK) is not None:
        raise RuntimeError(
            "lite-boost's sequence parallelism cannot run with diffusers' FirstBlockCache: "
            "each rank would judge from its own tokens whether to skip the remaining blocks, "
            "and ranks that judge differently desynchronise the collectives (an abort or a "
            "hang). Call model.disable_cache(), or boost the model without parallel="
        )


def _sequence_hooks(model: torch.nn.Module, manager: Any) -> list[Any]:
    """Split the tokens (and per-token timestep embeddings) over the ranks before the blocks,
    gather them after the last block."""
    from lite_boost.parallel import gather_sequence, shard_sequence

    def split_tokens(block: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        _refuse_rank_local_cache(block)
        return (shard_sequence(args[0], 1, manager), *args[1:])

    def split_timesteps(block: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        temb = args[2]
        if temb.dim() != 4:  # (batch, 6, dim): one embedding for every token
            return args
        return (*args[:2], shard_sequence(temb, 1, manager), *args[3:])

    def gather_tokens(block: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and output.requires_grad:  # on every rank alike
            raise RuntimeError(
                "lite-boost's sequence parallelism is for inference: gradients do not flow "
                "back through its gather across ranks. Run the model under torch.no_grad() or "
                "torch.inference_mode() (diffusers pipelines do), or boost it without parallel="
            )
        return gather_sequence(output, 1, manager)

    blocks = model.blocks
    handles = [blocks[0].register_forward_pre_hook(split_tokens)]
    # Wan 2.2 TI2V: (batch, tokens, 6, dim) timestep embeddings, split like the tokens
    handles += [block.register_forward_pre_hook(split_timesteps) for block in blocks]
    handles.append(blocks[-1].register_forward_hook(gather_tokens))
    return handles


@_builtin_booster("WanTransformer3DModel", changes=TRANSFORMER_CHANGES)
def boost_transformer(model: torch.nn.Module, options: BoostOptions) -> None:
    """Patch a diffusers ``WanTransformer3DModel`` in place (see :data:`TRANSFORMER_CHANGES`)."""
    from diffusers.models.transformers.transformer_wan import WanAttention

    if getattr(model, "_parallel_config", None) is not None:  # set by diffusers' parallelism
        raise _context_parallel_refusal("this Wan model has diffusers' context parallelism on")
    manager = _manager(options)
    attentions = [m for m in model.modules() if isinstance(m, WanAttention)]
    if manager is not None:
        if len(model.blocks) == 0:
            raise ValueError(
                "Ulysses parallel splits the tokens over ranks at the first transformer block "
                "and gathers them after the last; this model has none (num_layers=0): boost "
                "it without parallel="
            )
        for attn in attentions:
            if attn.heads % manager.world:
                raise ValueError(
                    f"Ulysses parallel splits heads over ranks: the model's {attn.heads} "
                    f"attention heads do not divide by world size {manager.world}; use a "
                    f"ParallelManager over a group whose size divides {attn.heads}"
                )
    rope = model.rope
    if not isinstance(rope, CachedWanRope):  # made first: a head it cannot split changes nothing
        rope = CachedWanRope(rope.attention_head_dim, rope.patch_size)
    for handle in getattr(model, "_lite_boost_handles", ()):
        handle.remove()
    model._lite_boost_handles = []
    model.rope = rope
    rope.manager = manager
    # partials over the module, not closures nor bound methods: copy.deepcopy rebinds them to
    # the copy, and pickle (torch.save of the model) takes them
    model.set_attention_backend = functools.partial(_refused_set_attention_backend, model)
    model.enable_parallelism = functools.partial(_refused_enable_parallelism, model)
    for attn in attentions:
        attn.set_processor = functools.partial(_boosted_set_processor, attn)
        attn.set_processor(WanAttnProcessor(options))
    if manager is not None:
        model._lite_boost_handles = _sequence_hooks(model, manager)


@_builtin_booster("AutoencoderKLWan", changes=VAE_CHANGES)
def boost_vae(vae: torch.nn.Module, options: BoostOptions) -> None:
    """Patch a diffusers ``AutoencoderKLWan`` in place (see :data:`VAE_CHANGES`)."""
    manager = _manager(options)
    vae.__dict__.pop("decode", None)  # undo a previous boost
    vae.__dict__.pop("_lite_boost_parallel", None)
    if manager is None:
        return
    from lite_boost.parallel import wan_decoder_overlap

    vae._lite_boost_parallel = (manager, wan_decoder_overlap(vae))
    # a method bound to the VAE, not a closure over it: a copy of the VAE decodes with its own
    # weights (copy.deepcopy rebinds a bound method to the copy)
    vae.decode = types.MethodType(_parallel_decode, vae)


def _parallel_decode(vae: torch.nn.Module, z: torch.Tensor, return_dict: bool = True) -> Any:
    """A parallel-boosted VAE's ``decode`` (:func:`boost_vae`)."""
    from diffusers.models.autoencoders.vae import DecoderOutput

    from lite_boost.parallel import decode_temporal_parallel

    if torch.is_grad_enabled() and any(p.requires_grad for p in vae.parameters()):
        raise RuntimeError(
            "lite-boost's parallel VAE decode is for inference: the decoded frames carry no "
            "gradient back to the VAE's parameters. Decode under torch.no_grad() or "
            "torch.inference_mode() (diffusers pipelines do), or boost it without parallel="
        )
    manager, overlap = vae._lite_boost_parallel

    def decode_frames(chunk: torch.Tensor) -> torch.Tensor:
        return type(vae).decode(vae, chunk, return_dict=False)[0]

    frames = decode_temporal_parallel(decode_frames, z, manager=manager, overlap=overlap)
    return DecoderOutput(sample=frames) if return_dict else (frames,)
