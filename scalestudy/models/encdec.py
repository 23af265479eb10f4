"""Encoder-decoder transformer (T5.1.1): a bidirectional encoder stack, a causal decoder stack
with cross-attention, one input embedding shared by both, and a tied or untied output
projection. Masks come in from `models/api.py`."""

from __future__ import annotations

import jax
from flax import nnx

from scalestudy.config.experiment import ModelConfig
from scalestudy.models.decoder import (
    ACT_BLD,
    Context,
    Stack,
    output_logits,
    output_projection,
)
from scalestudy.models.layers import Embed, ParamInit, constrain, dropout
from scalestudy.models.masks import MaskSpec


class EncoderDecoder(nnx.Module):
    """T5-style encoder-decoder with `encode()` and `decode()`."""

    def __init__(self, cfg: ModelConfig, init: ParamInit):
        self.cfg = cfg
        self.embed = Embed(cfg, init)
        self.encoder = Stack(cfg, cfg.encoder_layers, False, "bidirectional", init, "encoder")
        self.decoder = Stack(cfg, cfg.n_layers, True, "causal", init)
        if not cfg.tie_embeddings:
            self.logits = output_projection(cfg, init)

    def encode(
        self,
        tokens_BS: jax.Array,
        mask: MaskSpec | jax.Array | tuple,  # a tuple: one mask per layer parity (mixed layers)
        positions_BS: jax.Array,
        rng: jax.Array | None = None,
        deterministic: bool = True,
        record: bool = False,
    ) -> jax.Array:
        """Encoder output [B, S, D] in the compute dtype; with `record` (static), the encoder
        stack sows its intermediates."""
        keys = [None] * 3 if rng is None else list(jax.random.split(rng, 3))
        x_BSD = dropout(self.embed(tokens_BS), self.cfg.dropout, keys[0], deterministic)
        x_BSD = constrain(x_BSD, ACT_BLD)
        ctx = Context(mask, None, positions_BS)
        x_BSD, _ = self.encoder(x_BSD, ctx, keys[1], deterministic, record)
        return dropout(x_BSD, self.cfg.dropout, keys[2], deterministic)

    def decode(
        self,
        encoded_BSD: jax.Array,
        tokens_BL: jax.Array,
        mask: MaskSpec | jax.Array,
        cross_mask: MaskSpec | jax.Array,
        positions_BL: jax.Array,
        rng: jax.Array | None = None,
        deterministic: bool = True,
        record: bool = False,
    ) -> jax.Array:
        """Float32 logits [B, L, V] of the decoder given the encoder output; with `record`
        (static), the decoder stack sows its intermediates."""
        keys = [None] * 3 if rng is None else list(jax.random.split(rng, 3))
        x_BLD = dropout(self.embed(tokens_BL), self.cfg.dropout, keys[0], deterministic)
        x_BLD = constrain(x_BLD, ACT_BLD)
        ctx = Context(mask, None, positions_BL, encoded_BSD, cross_mask)
        x_BLD, _ = self.decoder(x_BLD, ctx, keys[1], deterministic, record)
        x_BLD = dropout(x_BLD, self.cfg.dropout, keys[2], deterministic)
        return output_logits(self, x_BLD)
