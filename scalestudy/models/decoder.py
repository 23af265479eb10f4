"""Decoder-only transformer and the layer stack shared with the encoder-decoder.

The causal and the non-causal (prefix) decoder are the same module: they differ only by the
attention mask passed in (built in `models/api.py` from `models/masks.py`) and by the
relative-position bucketing mode ("causal" or "prefix", see `layers.RelativePositionBias`).

A stack's layers are stored stacked along a leading "layers" axis and run with `lax.scan`
when `cfg.scan_layers` (compile time independent of depth), or as a list of layers otherwise.

With the static flag `intermediates=True` a stack also returns its self-attention
probabilities and residual stream (`Intermediates`, for `decoder_only/attention_rank.py`);
without it the traced program is the plain forward pass.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from scalestudy.config import ModelConfig
from scalestudy.models.layers import (
    MLP,
    Attention,
    Embed,
    ParamInit,
    RelativePositionBias,
    RMSNorm,
    constrain,
    dropout,
    param,
)
from scalestudy.models.masks import MaskSpec

ACT_BLD = ("batch", "length", "embed")


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
# sublayers (named RESIDUAL below); the layer inputs are kept by the scan in every case.
RESIDUAL = "residual"
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "minimal": jax.checkpoint_policies.save_only_these_names(RESIDUAL),
    "save_dots": jax.checkpoint_policies.dots_saveable,
    "save_dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Intermediates(NamedTuple):
    """What a stack computed on the way, stacked over its N layers."""

    attention_NBHLL: jax.Array  # float32 self-attention probabilities, after mask and softmax
    hidden_NBLD: jax.Array  # [N + 1]: the residual stream entering each layer, then the output


class Block(nnx.Module):
    """Pre-norm residual block: self-attention, optional cross-attention, feed-forward."""

    def __init__(self, cfg: ModelConfig, cross: bool, init: ParamInit):
        self.self_norm = RMSNorm(cfg, init)
        self.self_attn = Attention(cfg, init)
        if cross:
            self.cross_norm = RMSNorm(cfg, init)
            self.cross_attn = Attention(cfg, init)
        self.mlp_norm = RMSNorm(cfg, init)
        self.mlp = MLP(cfg, init)
        self.cross = cross
        self.rate = cfg.dropout

    def __call__(
        self,
        x_BLD: jax.Array,
        ctx: Context,
        rng: jax.Array | None,
        deterministic: bool,
        return_probs: bool = False,
    ) -> tuple[jax.Array, jax.Array | None]:
        """The block's output, and its self-attention probabilities if `return_probs`."""
        keys = [None] * 6 if rng is None else list(jax.random.split(rng, 6))
        h = self.self_norm(x_BLD)
        h = self.self_attn(
            h, h, ctx.mask, ctx.bias_HLL, ctx.positions_BL, ctx.positions_BL,
            keys[0], deterministic, return_probs,
        )  # fmt: skip
        h, probs_BHLL = h if return_probs else (h, None)
        x_BLD = checkpoint_name(x_BLD + dropout(h, self.rate, keys[1], deterministic), RESIDUAL)
        if self.cross:
            h = self.cross_norm(x_BLD)
            # No position information across the two sequences (as in T5).
            h = self.cross_attn(
                h, ctx.encoded_BSD, ctx.cross_mask, None, None, None, keys[2], deterministic
            )
            x_BLD = checkpoint_name(x_BLD + dropout(h, self.rate, keys[3], deterministic), RESIDUAL)
        h = self.mlp(self.mlp_norm(x_BLD), keys[4], deterministic)
        x_BLD = x_BLD + dropout(h, self.rate, keys[5], deterministic)
        return constrain(x_BLD, ACT_BLD), probs_BHLL


class Stack(nnx.Module):
    """`n_layers` blocks, one shared relative-position table, a final norm."""

    def __init__(
        self, cfg: ModelConfig, n_layers: int, cross: bool, relpos_mode: str, init: ParamInit
    ):
        self.cfg = cfg
        self.n_layers = n_layers
        if cfg.position == "relative_bias":
            self.relpos = RelativePositionBias(cfg, relpos_mode, init)
        if cfg.scan_layers:

            @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make(seed_2: jax.Array) -> Block:
                return Block(cfg, cross, ParamInit(seed_2))

            self.layers = make(init.split(n_layers))
        else:
            # Named attributes (not a list) keep the pure-dict keys strings, as checkpoints need.
            for i in range(n_layers):
                setattr(self, f"layer_{i}", Block(cfg, cross, init))
        self.final_norm = RMSNorm(cfg, init)

    def __call__(
        self,
        x_BLD: jax.Array,
        ctx: Context,
        rng: jax.Array | None = None,
        deterministic: bool = True,
        intermediates: bool = False,
    ) -> jax.Array | tuple[jax.Array, Intermediates]:
        """The final-normed output [B, L, D]; with `intermediates` (static), also the
        stack's `Intermediates`."""
        if self.cfg.position == "relative_bias":
            index_L = jnp.arange(x_BLD.shape[1])
            ctx = ctx._replace(bias_HLL=self.relpos(index_L, index_L))
        keys = None if rng is None else jax.random.split(rng, self.n_layers)
        layer_masks = _layer_masks(ctx.mask)

        def run(graphdef: nnx.GraphDef, layer_state: nnx.State, x: jax.Array, key, mask) -> tuple:
            layer = nnx.merge(graphdef, layer_state)
            return layer(x, ctx._replace(mask=mask), key, deterministic, intermediates)

        if self.cfg.remat != "none":
            run = jax.checkpoint(run, static_argnums=(0,), policy=REMAT_POLICIES[self.cfg.remat])
        if self.cfg.scan_layers:
            graphdef, state = nnx.split(self.layers)

            def body(x: jax.Array, xs: tuple) -> tuple[jax.Array, tuple | None]:
                layer_state, key, index = xs
                if len(layer_masks) == 1:
                    y, probs_BHLL = run(graphdef, layer_state, x, key, layer_masks[0])
                else:  # masks may differ in static structure: one branch per mask
                    branches = [_with_mask(run, graphdef, m) for m in layer_masks]
                    y, probs_BHLL = jax.lax.switch(
                        index % len(layer_masks), branches, layer_state, x, key
                    )
                return y, ((probs_BHLL, x) if intermediates else None)

            xs = (state, keys, jnp.arange(self.n_layers))
            x_BLD, per_layer = jax.lax.scan(body, x_BLD, xs)
        else:
            per_layer = []
            for i in range(self.n_layers):
                graphdef, layer_state = nnx.split(getattr(self, f"layer_{i}"))
                key = None if keys is None else keys[i]
                mask = layer_masks[i % len(layer_masks)]
                y, probs_BHLL = run(graphdef, layer_state, x_BLD, key, mask)
                per_layer.append((probs_BHLL, x_BLD))
                x_BLD = y
            if intermediates:
                per_layer = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)
        out_BLD = self.final_norm(x_BLD)
        if not intermediates:
            return out_BLD
        attention_NBHLL, hidden_NBLD = per_layer
        hidden_NBLD = jnp.concatenate([hidden_NBLD, out_BLD[None].astype(hidden_NBLD.dtype)])
        return out_BLD, Intermediates(attention_NBHLL, hidden_NBLD)


def _layer_masks(mask: MaskSpec | jax.Array | tuple) -> tuple:
    """A stack's self-attention masks as a tuple (layer i uses entry i % its length)."""
    if isinstance(mask, tuple):
        return mask
    if not isinstance(mask, MaskSpec) and mask.ndim == 5:
        return tuple(mask)  # dense masks stacked [P, B, H, L, S]
    return (mask,)


def _with_mask(run, graphdef: nnx.GraphDef, mask: MaskSpec | jax.Array):
    """`run` for one layer with `mask` fixed (a `lax.switch` branch)."""
    return lambda layer_state, x, key: run(graphdef, layer_state, x, key, mask)


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
        intermediates: bool = False,
    ) -> jax.Array | tuple[jax.Array, Intermediates]:
        """Float32 logits [B, L, V]; with `intermediates` (static), also the stack's."""
        keys = [None] * 3 if rng is None else list(jax.random.split(rng, 3))
        x_BLD = dropout(self.embed(tokens_BL), self.cfg.dropout, keys[0], deterministic)
        x_BLD = constrain(x_BLD, ACT_BLD)
        ctx = Context(mask, None, positions_BL)
        x_BLD = self.decoder(x_BLD, ctx, keys[1], deterministic, intermediates)
        x_BLD, inter = x_BLD if intermediates else (x_BLD, None)
        x_BLD = dropout(x_BLD, self.cfg.dropout, keys[2], deterministic)
        logits_BLV = output_logits(self, x_BLD)
        return (logits_BLV, inter) if intermediates else logits_BLV


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
        logits_BLV = jnp.einsum("BLD,DV->BLV", x_BLD, w_DV, preferred_element_type=jnp.float32)
    return constrain(logits_BLV, ("batch", "length", "vocab"))
