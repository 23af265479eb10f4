"""Decoder-only transformer and the layer stack shared with the encoder-decoder.

The causal and the non-causal (prefix) decoder are the same module: they differ only by the
attention mask passed in (built in `models/api.py` from `models/masks.py`) and by the
relative-position bucketing mode ("causal" or "prefix", see `layers.RelativePositionBias`).

A stack's layers are stored stacked along a leading "layers" axis and run with `lax.scan`
when `cfg.scan_layers` (compile time independent of depth), or as a list of layers otherwise.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

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

ACT_BLD = ("batch", "length", "embed")


class Context(NamedTuple):
    """Per-call inputs every layer of a stack sees (masks, bias, positions, encoder output)."""

    mask_BHLL: jax.Array
    bias_BHLL: jax.Array | None
    positions_BL: jax.Array
    encoded_BSD: jax.Array | None = None
    cross_mask_BHLS: jax.Array | None = None


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
        self, x_BLD: jax.Array, ctx: Context, rng: jax.Array | None, deterministic: bool
    ) -> jax.Array:
        keys = [None] * 6 if rng is None else list(jax.random.split(rng, 6))
        h = self.self_norm(x_BLD)
        h = self.self_attn(
            h, h, ctx.mask_BHLL, ctx.bias_BHLL, ctx.positions_BL, ctx.positions_BL,
            keys[0], deterministic,
        )  # fmt: skip
        x_BLD = x_BLD + dropout(h, self.rate, keys[1], deterministic)
        if self.cross:
            h = self.cross_norm(x_BLD)
            # No position information across the two sequences (as in T5).
            h = self.cross_attn(
                h, ctx.encoded_BSD, ctx.cross_mask_BHLS, None, None, None, keys[2], deterministic
            )
            x_BLD = x_BLD + dropout(h, self.rate, keys[3], deterministic)
        h = self.mlp(self.mlp_norm(x_BLD), keys[4], deterministic)
        x_BLD = x_BLD + dropout(h, self.rate, keys[5], deterministic)
        return constrain(x_BLD, ACT_BLD)


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
    ) -> jax.Array:
        if self.cfg.position == "relative_bias":
            ctx = ctx._replace(bias_BHLL=self.relpos(ctx.positions_BL, ctx.positions_BL))
        keys = None if rng is None else jax.random.split(rng, self.n_layers)

        def run(graphdef: nnx.GraphDef, layer_state: nnx.State, x: jax.Array, key) -> jax.Array:
            return nnx.merge(graphdef, layer_state)(x, ctx, key, deterministic)

        if self.cfg.remat == "full":
            run = jax.checkpoint(run, static_argnums=(0,))
        if self.cfg.scan_layers:
            graphdef, state = nnx.split(self.layers)

            def body(x: jax.Array, xs: tuple) -> tuple[jax.Array, None]:
                layer_state, key = xs
                return run(graphdef, layer_state, x, key), None

            x_BLD, _ = jax.lax.scan(body, x_BLD, (state, keys))
        else:
            for i in range(self.n_layers):
                graphdef, layer_state = nnx.split(getattr(self, f"layer_{i}"))
                x_BLD = run(graphdef, layer_state, x_BLD, None if keys is None else keys[i])
        return self.final_norm(x_BLD)


class Decoder(nnx.Module):
    """Decoder-only language model: embed, stack, (tied or untied) output projection."""

    def __init__(self, cfg: ModelConfig, relpos_mode: str, init: ParamInit):
        self.cfg = cfg
        self.embed = Embed(cfg, init)
        self.decoder = Stack(cfg, cfg.n_layers, False, relpos_mode, init)
        if not cfg.tie_embeddings:
            self.logits = param(
                init, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.d_model**-0.5,
                cfg.param_dtype,
            )  # fmt: skip

    def __call__(
        self,
        tokens_BL: jax.Array,
        mask_BHLL: jax.Array,
        positions_BL: jax.Array,
        rng: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """Float32 logits [B, L, V]."""
        keys = [None] * 3 if rng is None else list(jax.random.split(rng, 3))
        x_BLD = dropout(self.embed(tokens_BL), self.cfg.dropout, keys[0], deterministic)
        x_BLD = constrain(x_BLD, ACT_BLD)
        x_BLD = self.decoder(x_BLD, Context(mask_BHLL, None, positions_BL), keys[1], deterministic)
        x_BLD = dropout(x_BLD, self.cfg.dropout, keys[2], deterministic)
        return output_logits(self, x_BLD)


def output_logits(model: Decoder | nnx.Module, x_BLD: jax.Array) -> jax.Array:
    """Float32 logits; tied embeddings scale by 1/sqrt(d_model) as in T5X."""
    cfg: ModelConfig = model.cfg
    if cfg.tie_embeddings:
        logits_BLV = model.embed.attend(x_BLD) / jnp.sqrt(float(cfg.d_model))
    else:
        w_DV = model.logits[...].astype(cfg.dtype)
        logits_BLV = jnp.einsum("BLD,DV->BLV", x_BLD, w_DV, preferred_element_type=jnp.float32)
    return constrain(logits_BLV, ("batch", "length", "vocab"))
