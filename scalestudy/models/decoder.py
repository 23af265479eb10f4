"""Decoder-only transformer and the layer stack shared with the encoder-decoder.

The causal and the non-causal (prefix) decoder are the same module: they differ only by the
attention mask passed in (built in `models/api.py` from `models/masks.py`) and by the
relative-position bucketing mode ("causal" or "prefix", see `layers.RelativePositionBias`).

A stack's layers are stored stacked along a leading "layers" axis and run with `lax.scan`
when `scanned(cfg)` (compile time independent of depth), or as a list of layers otherwise.

One block class serves training and decoding: given a cache (`layers.KV` per attention) it
attends to the cached slots and returns the cache with the new keys and values written
(`models/decode.py` builds the masks and slots). With the static `record=True` a stack sows its
self-attention probabilities and residual stream as `nnx.Intermediate` values (read with
`nnx.capture`, for `decoder_only/attention_rank.py`); the return type never changes, and
without it the traced program is the plain forward pass.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import ModelConfig
from scalestudy.models.attention import platform
from scalestudy.models.layers import (
    ATTENTION_OUT,
    KV,
    MLP,
    MLP_HIDDEN,
    QKV,
    Attention,
    Embed,
    ParamInit,
    RelativePositionBias,
    RMSNorm,
    constrain,
    dropout,
    param,
    project,
)
from scalestudy.models.masks import MaskSpec
from scalestudy.models.moe import MoE

ACT_BLD = ("batch", "length", "embed")


# `scan_layers: auto` unrolls on a CPU up to this depth: there the scanned step is slower,
# while accelerators and deep stacks keep the scan's depth-independent compile time and
# memory layout (docs/models.md#layer-scanning).
AUTO_UNROLL_MAX_LAYERS = 12
# On a GPU too the scanned stack is slower, and unrolled stacks as deep as the T5.1.1 XXL's
# 24 layers still compile in reasonable time (docs/performance.md#on-a-gpu).
AUTO_UNROLL_MAX_LAYERS_GPU = 32


def scanned(cfg: ModelConfig) -> bool:
    """Whether a stack of `cfg` runs its layers with `lax.scan` (resolving "auto" for the
    platform being compiled for: unrolled up to a depth on CPU and GPU, scanned on TPU; the
    parameter layout follows, so a checkpoint restores only into the same choice)."""
    if cfg.scan_layers != "auto":
        return bool(cfg.scan_layers)
    depth = max(cfg.n_layers, cfg.encoder_layers)
    most = {"cpu": AUTO_UNROLL_MAX_LAYERS, "gpu": AUTO_UNROLL_MAX_LAYERS_GPU}.get(platform(), 0)
    return depth > most


class Context(NamedTuple):
    """Per-call inputs every layer of a stack sees (masks, bias, positions, encoder output).

    Masks are `masks.MaskSpec` structures (or dense boolean [B, H or 1, L, S] arrays); for
    mixed layers the self-attention mask is a tuple of P masks (or dense ones stacked
    [P, B, H, L, S]) and layer i uses mask i % P. The relative-position bias is one [H, L, L]
    array shared by the batch."""

    mask: MaskSpec | jax.Array | tuple[MaskSpec | jax.Array, ...]
    bias_HLL: jax.Array | None
    positions_BL: jax.Array
    encoded_BSD: jax.Array | None = None
    cross_mask: MaskSpec | jax.Array | None = None


# Rematerialisation policies (`model.remat`): what the backward pass keeps from each layer's
# forward pass instead of recomputing it. "minimal" keeps only the residual stream between
# sublayers (named RESIDUAL below); "save_attention" also keeps the attention's query, key and
# value projections and its output before the output projection (the backward pass then
# recomputes only the scores and softmax of each attention and the MLPs), "save_attention_mlp"
# also the MLP's input projections (it recomputes little beyond norms, activations and the
# softmax); the layer inputs are kept by the scan in every case.
RESIDUAL = "residual"
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "minimal": jax.checkpoint_policies.save_only_these_names(RESIDUAL),
    "save_attention": jax.checkpoint_policies.save_only_these_names(RESIDUAL, QKV, ATTENTION_OUT),
    "save_attention_mlp": jax.checkpoint_policies.save_only_these_names(
        RESIDUAL, QKV, ATTENTION_OUT, MLP_HIDDEN
    ),
    "save_dots": jax.checkpoint_policies.dots_saveable,
    "save_dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


# One block's cache: its self-attention KV (written) and its cross-attention KV (fixed).
BlockCache = tuple[KV, KV | None]


class Block(nnx.Module):
    """Pre-norm residual block: self-attention, optional cross-attention, feed-forward (a
    dense MLP, or with `moe` a mixture-of-experts layer)."""

    def __init__(self, cfg: ModelConfig, cross: bool, init: ParamInit, moe: bool = False):
        self.self_norm = RMSNorm(cfg, init)
        self.self_attn = Attention(cfg, init)
        if cross:
            self.cross_norm = RMSNorm(cfg, init)
            self.cross_attn = Attention(cfg, init)
        self.mlp_norm = RMSNorm(cfg, init)
        self.mlp = MoE(cfg, init) if moe else MLP(cfg, init)
        self.moe = moe
        self.cross = cross
        self.rate = cfg.dropout

    def __call__(
        self,
        x_BLD: jax.Array,
        ctx: Context,
        rng: jax.Array | None,
        deterministic: bool,
        record: bool = False,
        cache: BlockCache | None = None,
    ) -> tuple[jax.Array, BlockCache | None, dict | None]:
        """The block's output, its cache with the new positions written (None without) and
        the MoE layer's measurements (None for a dense block). With `record` (static), the
        self-attention sows its probabilities and an MoE layer its routing choices."""
        keys = [None] * 6 if rng is None else list(jax.random.split(rng, 6))
        self_kv, cross_kv = (None, None) if cache is None else cache
        h = self.self_norm(x_BLD)
        h, self_kv = self.self_attn(
            h,
            h,
            ctx.mask,
            ctx.bias_HLL,
            ctx.positions_BL,
            ctx.positions_BL,
            keys[0],
            deterministic,
            record,
            self_kv,
        )
        x_BLD = checkpoint_name(x_BLD + dropout(h, self.rate, keys[1], deterministic), RESIDUAL)
        if self.cross:
            h = self.cross_norm(x_BLD)
            # No position information across the two sequences (as in T5).
            h, cross_kv = self.cross_attn(
                h,
                ctx.encoded_BSD,
                ctx.cross_mask,
                None,
                None,
                None,
                keys[2],
                deterministic,
                cache=cross_kv,
            )
            x_BLD = checkpoint_name(x_BLD + dropout(h, self.rate, keys[3], deterministic), RESIDUAL)
        h, stats = self.mlp_norm(x_BLD), None
        if self.moe:
            h, stats = self.mlp(h, keys[4], deterministic, record)
        else:
            h = self.mlp(h, keys[4], deterministic)
        x_BLD = x_BLD + dropout(h, self.rate, keys[5], deterministic)
        cache = None if cache is None else (self_kv, cross_kv)
        return constrain(x_BLD, ACT_BLD), cache, stats


class Stack(nnx.Module):
    """`n_layers` blocks, one shared relative-position table, a final norm. `name` ("decoder"
    or "encoder") picks the stack's MoE layers (`model.moe`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        n_layers: int,
        cross: bool,
        relpos_mode: str,
        init: ParamInit,
        name: str = "decoder",
    ):
        self.cfg = cfg
        self.n_layers = n_layers
        self.moe_layers = cfg.moe.layers(name, n_layers)
        if cfg.position == "relative_bias":
            self.relpos = RelativePositionBias(cfg, relpos_mode, init)
        self.scan = scanned(cfg)
        moe = len(self.moe_layers) == n_layers
        if self.scan and self.moe_layers and not moe:
            raise ConfigError(
                f"model.moe makes layers {list(self.moe_layers)} of the {n_layers}-layer {name} "
                "stack MoE layers, but scanned layers must all be alike; give model.moe.every=1 "
                "(every layer) or model.scan_layers=false"
            )
        # One seed per layer either way, so scanned and unrolled stacks draw equal weights.
        seeds_N2 = init.split(n_layers)
        if self.scan:

            @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make(seed_2: jax.Array) -> Block:
                return Block(cfg, cross, ParamInit(seed_2), moe)

            self.layers = make(seeds_N2)
        else:
            # Named attributes (not a list) keep the pure-dict keys strings, as checkpoints need.
            for i in range(n_layers):
                block = Block(cfg, cross, ParamInit(seeds_N2[i]), i in self.moe_layers)
                setattr(self, f"layer_{i}", block)
        self.final_norm = RMSNorm(cfg, init)

    def __call__(
        self,
        x_BLD: jax.Array,
        ctx: Context,
        rng: jax.Array | None = None,
        deterministic: bool = True,
        record: bool = False,
        cache: BlockCache | None = None,
    ) -> tuple[jax.Array, BlockCache | None]:
        """The final-normed output [B, L, D] and the cache (every layer's, stacked on a leading
        N axis; None without one). With `record` (static), sows "attention_NBHLL" (float32
        self-attention probabilities of each layer) and "hidden_NBLD" (the residual stream
        entering each layer, then the output) as `nnx.Intermediate` values. A stack with MoE
        layers always sows "moe": their measurements (`moe.MoE`), stacked over those layers
        (with `record`, also "expert_BLK": the routed experts each token chose).

        `ctx.bias_HLL`, when given, is the relative-position bias at the query and key slots
        (decoding); otherwise the stack computes it for positions 0 .. L - 1."""
        if self.cfg.position == "relative_bias" and ctx.bias_HLL is None:
            index_L = jnp.arange(x_BLD.shape[1])
            ctx = ctx._replace(bias_HLL=self.relpos(index_L, index_L))
        keys = None if rng is None else jax.random.split(rng, self.n_layers)
        layer_masks = _layer_masks(ctx.mask)
        start = None if cache is None else cache[0].start
        cache_arrays = _arrays(cache)
        run = _layer_runner(ctx, start, deterministic, record, self.cfg.remat)
        layers = self._scanned if self.scan else self._unrolled
        x_BLD, cache_arrays, per_layer, moe_stats = layers(
            run, x_BLD, keys, layer_masks, cache_arrays, record
        )
        if moe_stats is not None:
            self.sow(nnx.Intermediate, "moe", moe_stats)
        out_BLD = self.final_norm(x_BLD)
        if record:
            attention_NBHLL, hidden_NBLD = per_layer
            hidden_NBLD = jnp.concatenate([hidden_NBLD, out_BLD[None].astype(hidden_NBLD.dtype)])
            self.sow(nnx.Intermediate, "attention_NBHLL", attention_NBHLL)
            self.sow(nnx.Intermediate, "hidden_NBLD", hidden_NBLD)
        return out_BLD, (None if cache is None else _block_cache(cache_arrays, start))

    def _scanned(self, run, x_BLD, keys, layer_masks: tuple, cache_arrays, record: bool):
        """The scanned layers over `x_BLD`: (output, new cache arrays, per-layer recordings
        (attention, layer input) or None, stacked MoE measurements or None)."""
        graphdef, state = nnx.split(self.layers)

        def body(x: jax.Array, xs: tuple) -> tuple[jax.Array, tuple]:
            layer_state, key, index, kv = xs
            if len(layer_masks) == 1:
                out = run(graphdef, layer_state, x, key, layer_masks[0], kv)
            else:  # masks may differ in static structure: one branch per mask
                branches = [_with_mask(run, graphdef, m) for m in layer_masks]
                out = jax.lax.switch(index % len(layer_masks), branches, layer_state, x, key, kv)
            y, kv, probs_BHLL, stats = out
            return y, (kv, (probs_BHLL, x) if record else None, stats)

        xs = (state, keys, jnp.arange(self.n_layers), cache_arrays)
        x_BLD, (cache_arrays, per_layer, moe_stats) = jax.lax.scan(body, x_BLD, xs)
        return x_BLD, cache_arrays, per_layer, moe_stats

    def _unrolled(self, run, x_BLD, keys, layer_masks: tuple, cache_arrays, record: bool):
        """`_scanned`'s results from the layers called one after another (each its own
        attribute `layer_<i>`); the per-layer values are stacked as the scan stacks them."""
        per_layer, new_arrays, moe_stats = [], [], []
        for i in range(self.n_layers):
            graphdef, layer_state = nnx.split(getattr(self, f"layer_{i}"))
            key = None if keys is None else keys[i]
            mask = layer_masks[i % len(layer_masks)]
            kv = jax.tree.map(lambda a, i=i: a[i], cache_arrays)
            y, kv, probs_BHLL, stats = run(graphdef, layer_state, x_BLD, key, mask, kv)
            if stats is not None:
                moe_stats.append(stats)
            per_layer.append((probs_BHLL, x_BLD))
            new_arrays.append(kv)
            x_BLD = y
        if cache_arrays is not None:
            cache_arrays = jax.tree.map(lambda *xs: jnp.stack(xs), *new_arrays)
        if record:
            per_layer = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)
        moe_stats = jax.tree.map(lambda *xs: jnp.stack(xs), *moe_stats) if moe_stats else None
        return x_BLD, cache_arrays, per_layer, moe_stats

    def cross_kv(self, encoded_BSD: jax.Array) -> KV:
        """Every layer's cross-attention keys and values of an encoder output, stacked [N, ...]
        (the fixed part of a decoding cache)."""
        if self.scan:
            graphdef, state = nnx.split(self.layers)
            return jax.lax.map(
                lambda s: nnx.merge(graphdef, s).cross_attn.project_kv(encoded_BSD), state
            )
        per_layer = [
            getattr(self, f"layer_{i}").cross_attn.project_kv(encoded_BSD)
            for i in range(self.n_layers)
        ]
        return jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)


def _layer_runner(ctx: Context, start, deterministic: bool, record: bool, remat: str):
    """`run(graphdef, layer_state, x, key, mask, kv) -> (y, kv, probs_BHLS, stats)`: one
    layer on `x` (its cache arrays `kv`, its attention probabilities with `record`, else None),
    under the stack's remat policy."""

    def run(graphdef: nnx.GraphDef, layer_state: nnx.State, x: jax.Array, key, mask, kv):
        layer = nnx.merge(graphdef, layer_state)
        layer_cache = None if kv is None else _block_cache(kv, start)
        args = (x, ctx._replace(mask=mask), key, deterministic, record, layer_cache)
        if not record:
            y, layer_cache, stats = layer(*args)
            return y, _arrays(layer_cache), None, stats
        (y, layer_cache, stats), sown = nnx.capture(layer, nnx.Intermediate)(*args)
        if stats is not None:  # an MoE layer: its routing choices beside its measurements
            stats = {**stats, "expert_BLK": sown["mlp"]["expert_BLK"][0]}
        return y, _arrays(layer_cache), sown["self_attn"]["probs_BHLS"][0], stats

    if remat != "none":
        run = jax.checkpoint(run, static_argnums=(0,), policy=REMAT_POLICIES[remat])
    return run


def _arrays(cache: BlockCache | None) -> tuple | None:
    """A block cache's arrays (what a layer scan carries per layer)."""
    if cache is None:
        return None
    self_kv, cross_kv = cache
    return self_kv[:2], None if cross_kv is None else cross_kv[:2]


def _block_cache(arrays: tuple, start: jax.Array) -> BlockCache:
    """`_arrays` back to a block cache writing at `start`."""
    self_kv, cross_kv = arrays
    return KV(*self_kv, start), None if cross_kv is None else KV(*cross_kv)


def _layer_masks(mask: MaskSpec | jax.Array | tuple) -> tuple:
    """A stack's self-attention masks as a tuple (layer i uses entry i % its length)."""
    if isinstance(mask, tuple):
        return mask
    if not isinstance(mask, MaskSpec) and mask.ndim == 5:
        return tuple(mask)  # dense masks stacked [P, B, H, L, S]
    return (mask,)


def _with_mask(run, graphdef: nnx.GraphDef, mask: MaskSpec | jax.Array):
    """`run` for one layer with `mask` fixed (a `lax.switch` branch)."""
    return lambda layer_state, x, key, kv: run(graphdef, layer_state, x, key, mask, kv)


class Decoder(nnx.Module):
    """Decoder-only language model: embed, stack, (tied or untied) output projection."""

    def __init__(self, cfg: ModelConfig, relpos_mode: str, init: ParamInit):
        self.cfg = cfg
        self.embed = Embed(cfg, init)
        self.decoder = Stack(cfg, cfg.n_layers, False, relpos_mode, init)
        if not cfg.tie_embeddings:
            self.logits = output_projection(cfg, init)

    def __call__(
        self,
        tokens_BL: jax.Array,
        mask: MaskSpec | jax.Array | tuple,  # a tuple: one mask per layer parity (mixed layers)
        positions_BL: jax.Array,
        rng: jax.Array | None = None,
        deterministic: bool = True,
        record: bool = False,
    ) -> jax.Array:
        """Float32 logits [B, L, V]; with `record` (static), the stack sows its intermediates."""
        keys = [None] * 3 if rng is None else list(jax.random.split(rng, 3))
        x_BLD = dropout(self.embed(tokens_BL), self.cfg.dropout, keys[0], deterministic)
        x_BLD = constrain(x_BLD, ACT_BLD)
        ctx = Context(mask, None, positions_BL)
        x_BLD, _ = self.decoder(x_BLD, ctx, keys[1], deterministic, record)
        x_BLD = dropout(x_BLD, self.cfg.dropout, keys[2], deterministic)
        return output_logits(self, x_BLD)


def output_projection(cfg: ModelConfig, init: ParamInit) -> nnx.Param:
    """The untied [D, V] output embedding (T5.1.1), initialised with std 1/sqrt(d_model)."""
    return param(
        init, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.d_model**-0.5, cfg.param_dtype
    )


def output_logits(model: Decoder | nnx.Module, x_BLD: jax.Array) -> jax.Array:
    """Float32 logits; tied embeddings scale by 1/sqrt(d_model) as in T5X."""
    cfg: ModelConfig = model.cfg
    if cfg.tie_embeddings:
        logits_BLV = model.embed.attend(x_BLD) / jnp.sqrt(float(cfg.d_model))
    else:
        w_DV = model.logits[...].astype(cfg.dtype)
        logits_BLV = project("BLD,DV->BLV", x_BLD, w_DV, jnp.float32)
    return constrain(logits_BLV, ("batch", "length", "vocab"))
