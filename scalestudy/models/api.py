"""The model API every other room uses: `build_model(cfg) -> Model`.

Parameters are a pure nested dict of arrays (no Flax objects), so optimizers, checkpoints and
shardings treat them as any pytree. This module is the only place (with `masks.py`) that
knows the three architectures apart:

- causal_decoder: decoder-only, causal mask; ignores `decoder_causal_attention`.
- noncausal_decoder: decoder-only, bidirectional over the `decoder_causal_attention` prefix.
- encoder_decoder: encoder over `encoder_*` features, decoder over `decoder_*` features.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from scalestudy.config import ModelConfig
from scalestudy.models import masks
from scalestudy.models.decoder import Decoder
from scalestudy.models.encdec import EncoderDecoder
from scalestudy.models.layers import ParamInit

Params = dict[str, Any]
Batch = Mapping[str, jax.Array]


def _module(cfg: ModelConfig, rng: jax.Array) -> nnx.Module:
    init = ParamInit.from_key(rng)
    # Sharding is applied by the caller (jit out_shardings), not when variables are created.
    with nnx.use_eager_sharding(False):
        if cfg.arch == "encoder_decoder":
            return EncoderDecoder(cfg, init)
        return Decoder(cfg, "prefix" if cfg.arch == "noncausal_decoder" else "causal", init)


def _segments(batch: Batch, prefix: str, tokens: jax.Array) -> jax.Array:
    """Segment ids, or (unpacked data without them) 1 on real tokens, 0 on padding."""
    name = f"{prefix}_segment_ids"
    if name in batch:
        return jnp.asarray(batch[name])
    if prefix == "decoder":  # decoder inputs start with id 0; targets mark the real positions
        tokens = jnp.asarray(batch["decoder_target_tokens"])
    return (tokens > 0).astype(jnp.int32)


def _positions(batch: Batch, prefix: str, length: int) -> jax.Array:
    name = f"{prefix}_positions"
    if name in batch:
        return jnp.asarray(batch[name])
    rows = jnp.asarray(batch[f"{prefix}_input_tokens"]).shape[0]
    return jnp.broadcast_to(jnp.arange(length), (rows, length))


class Model:
    """A built model: pure functions of (params, batch) for one `ModelConfig`."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        abstract = nnx.eval_shape(lambda: _module(cfg, jax.random.key(0)))
        self._graphdef = nnx.graphdef(abstract)
        params = nnx.state(abstract, nnx.Param)
        self._abstract = params.to_pure_dict()
        self._axes = jax.tree.map(
            lambda v: tuple(v.get_metadata()["out_sharding"]),
            params,
            is_leaf=lambda v: isinstance(v, nnx.Variable),
        ).to_pure_dict()

    # ------------------------------------------------------------------ parameters

    def init(self, rng: jax.Array) -> Params:
        """Freshly initialised parameters (jit it with out_shardings to create them sharded)."""
        return nnx.state(_module(self.cfg, rng), nnx.Param).to_pure_dict()

    def abstract_params(self) -> Params:
        """Shapes and dtypes of the parameters, without allocating them."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self._abstract)

    def param_axes(self) -> Params:
        """The parameter tree with each leaf replaced by its tuple of logical axis names."""
        return self._axes

    def _bind(self, params: Params) -> nnx.Module:
        return nnx.merge(self._graphdef, params)

    # ------------------------------------------------------------------ forward

    def apply(
        self,
        params: Params,
        batch: Batch,
        *,
        rng: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """Float32 logits [B, L, V] at the decoder positions."""
        return self._forward(params, batch, rng, deterministic, intermediates=False)

    def intermediates(self, params: Params, batch: Batch) -> dict[str, dict[str, jax.Array]]:
        """Per stack ("decoder", and "encoder" for the encoder-decoder), deterministically:
        "attention": float32 self-attention probabilities [layers, B, H, Q, K] after masking
        and softmax; "hidden": float32 residual stream entering each layer, then the
        final-normed output [layers + 1, B, L, D]; "segment_ids": [B, L] (0 = padding), as the
        model read them from the batch."""
        _, stacks = self._forward(params, batch, None, True, intermediates=True)
        return {
            name: {
                "attention": inter.attention_NBHLL,
                "hidden": inter.hidden_NBLD.astype(jnp.float32),
                "segment_ids": segment_BL,
            }
            for name, (inter, segment_BL) in stacks.items()
        }

    def _forward(
        self,
        params: Params,
        batch: Batch,
        rng: jax.Array | None,
        deterministic: bool,
        intermediates: bool,
    ) -> jax.Array | tuple[jax.Array, dict]:
        """Logits; with `intermediates`, also {stack: (Intermediates, segment_ids)}."""
        cfg, module = self.cfg, self._bind(params)
        tokens_BL = jnp.asarray(batch["decoder_input_tokens"])
        length = tokens_BL.shape[1]
        segment_BL = _segments(batch, "decoder", tokens_BL)
        positions_BL = _positions(batch, "decoder", length)
        heads, mixed = cfg.n_heads, cfg.attention == "mixed"
        if cfg.arch == "encoder_decoder":
            enc_tokens_BS = jnp.asarray(batch["encoder_input_tokens"])
            enc_segment_BS = _segments(batch, "encoder", enc_tokens_BS)
            enc_positions_BS = _positions(batch, "encoder", enc_tokens_BS.shape[1])
            enc_rng, dec_rng = (None, None) if rng is None else jax.random.split(rng)
            encoded_BSD = module.encode(
                enc_tokens_BS,
                masks.encoder_self_spec(enc_segment_BS, heads, mixed),
                enc_positions_BS,
                enc_rng,
                deterministic,
                intermediates,
            )
            encoded_BSD, enc_inter = encoded_BSD if intermediates else (encoded_BSD, None)
            logits_BLV = module.decode(
                encoded_BSD,
                tokens_BL,
                masks.decoder_self_spec(segment_BL),
                masks.cross_spec(segment_BL, enc_segment_BS),
                positions_BL,
                dec_rng,
                deterministic,
                intermediates,
            )
            if not intermediates:
                return logits_BLV
            logits_BLV, dec_inter = logits_BLV
            stacks = {"encoder": (enc_inter, enc_segment_BS), "decoder": (dec_inter, segment_BL)}
            return logits_BLV, stacks
        prefix_BL = None
        if cfg.arch == "noncausal_decoder":
            prefix_BL = batch.get("decoder_causal_attention")
            prefix_BL = jnp.zeros_like(tokens_BL) if prefix_BL is None else prefix_BL
        mask = masks.decoder_self_spec(segment_BL, prefix_BL, heads, mixed)
        out = module(tokens_BL, mask, positions_BL, rng, deterministic, intermediates)
        if not intermediates:
            return out
        logits_BLV, inter = out
        return logits_BLV, {"decoder": (inter, segment_BL)}

    # ------------------------------------------------------------------ objectives

    def loss(
        self,
        params: Params,
        batch: Batch,
        rng: jax.Array | None,
        *,
        z_loss: float = 0.0,
        deterministic: bool = False,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Mean cross-entropy over loss-bearing tokens plus z-loss, and token counts."""
        logits_BLV = self.apply(params, batch, rng=rng, deterministic=deterministic)
        targets_BL = jnp.asarray(batch["decoder_target_tokens"])
        w_BL = jnp.asarray(batch["decoder_loss_weights"]).astype(jnp.float32)
        lse_BL = jax.nn.logsumexp(logits_BLV, axis=-1)
        target_logit_BL = jnp.take_along_axis(logits_BLV, targets_BL[..., None], axis=-1)[..., 0]
        ce_BL = lse_BL - target_logit_BL
        tokens = w_BL.sum()
        denom = jnp.maximum(tokens, 1.0)
        ce = (w_BL * ce_BL).sum() / denom
        zl = z_loss * (w_BL * lse_BL**2).sum() / denom
        correct_BL = (jnp.argmax(logits_BLV, axis=-1) == targets_BL).astype(jnp.float32)
        positions = (_segments(batch, "decoder", targets_BL) > 0).sum()
        if self.cfg.arch == "encoder_decoder":
            enc_tokens = jnp.asarray(batch["encoder_input_tokens"])
            positions = positions + (_segments(batch, "encoder", enc_tokens) > 0).sum()
        aux = {
            "ce": ce,
            "z_loss": zl,
            "accuracy": (w_BL * correct_BL).sum() / denom,
            "tokens": tokens,
            "positions": positions.astype(jnp.float32),
        }
        return ce + zl, aux

    def score(self, params: Params, batch: Batch) -> dict[str, jax.Array]:
        """Per-example sum of target log-probabilities where loss weights > 0 (rank
        classification), the number of such tokens, and whether all were the argmax."""
        logits_BLV = self.apply(params, batch, deterministic=True)
        targets_BL = jnp.asarray(batch["decoder_target_tokens"])
        w_BL = jnp.asarray(batch["decoder_loss_weights"]) > 0
        logp_BLV = jax.nn.log_softmax(logits_BLV, axis=-1)
        logp_BL = jnp.take_along_axis(logp_BLV, targets_BL[..., None], axis=-1)[..., 0]
        correct_BL = jnp.argmax(logits_BLV, axis=-1) == targets_BL
        return {
            "logprob": jnp.where(w_BL, logp_BL, 0.0).sum(axis=1),
            "n_tokens": w_BL.sum(axis=1).astype(jnp.int32),
            "all_correct": jnp.all(correct_BL | ~w_BL, axis=1),
        }


def build_model(cfg: ModelConfig) -> Model:
    """The model for `cfg` (architecture from `cfg.arch`)."""
    return Model(cfg)
