"""The model API every other room uses: `build_model(cfg) -> Model`.

Parameters are a pure nested dict of arrays (no Flax objects), so optimizers, checkpoints and
shardings treat them as any pytree. This module is the only place (with `masks.py`) that
knows the three architectures apart:

- causal_decoder: decoder-only, causal mask; ignores `decoder_causal_attention`.
- noncausal_decoder: decoder-only, bidirectional over the `decoder_causal_attention` prefix.
- encoder_decoder: encoder over `encoder_*` features, decoder over `decoder_*` features.

Kept whole: it is the one place that branches on architecture (loss, scoring, generation and
the mixture-of-experts hooks); split, those branches would spread over several files.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from scalestudy.config.experiment import ModelConfig
from scalestudy.models import decode, masks
from scalestudy.models.decoder import Decoder
from scalestudy.models.encdec import EncoderDecoder
from scalestudy.models.layers import ParamInit

Params = dict[str, Any]
Batch = Mapping[str, jax.Array]
STACKS = ("encoder", "decoder")  # the layer stacks' names in the parameter tree


def _module(cfg: ModelConfig, rng: jax.Array) -> nnx.Module:
    init = ParamInit.from_key(rng)
    # Sharding is applied by the caller (jit out_shardings), not when variables are created.
    with nnx.use_eager_sharding(False):
        if cfg.arch == "encoder_decoder":
            return EncoderDecoder(cfg, init)
        return Decoder(cfg, masks.decoder_mode(cfg), init)


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
        return _forward(self._bind(params), batch, rng, deterministic)

    def intermediates(self, params: Params, batch: Batch) -> dict[str, dict[str, jax.Array]]:
        """Per stack ("decoder", and "encoder" for the encoder-decoder), deterministically:
        "attention": float32 self-attention probabilities [layers, B, H, Q, K] after masking
        and softmax; "hidden": float32 residual stream entering each layer, then the
        final-normed output [layers + 1, B, L, D]; "segment_ids": [B, L] (0 = padding), as the
        model read them from the batch; "tokens": [B, L], the token each position reads; and
        in stacks with MoE layers, "experts": int32 [MoE layers, B, L, K], the routed experts
        each position chose (in `moe_layers()` order)."""
        capture = nnx.capture(_forward, nnx.Intermediate)
        _, sown = capture(self._bind(params), batch, None, True, record=True)
        segments = {"decoder": _segments(batch, "decoder", batch["decoder_input_tokens"])}
        if self.cfg.arch == "encoder_decoder":
            segments["encoder"] = _segments(batch, "encoder", batch["encoder_input_tokens"])
        out = {}
        for name, segment_BL in segments.items():
            out[name] = {
                "attention": sown[name]["attention_NBHLL"][0],
                "hidden": sown[name]["hidden_NBLD"][0].astype(jnp.float32),
                "segment_ids": segment_BL,
                "tokens": jnp.asarray(batch[f"{name}_input_tokens"]),
            }
            if "moe" in sown[name]:
                out[name]["experts"] = sown[name]["moe"][0]["expert_BLK"]
        return out

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
        """Mean cross-entropy over loss-bearing tokens plus z-loss (and the MoE layers'
        auxiliary losses), and token counts (with MoE layers, "moe_aux_loss" and "moe": each
        stack's measurements, `train/moe_balance.layer_metrics` reads them)."""
        moe = {}
        if self.cfg.moe.enabled:
            capture = nnx.capture(_forward, nnx.Intermediate)
            logits_BLV, sown = capture(self._bind(params), batch, rng, deterministic)
            moe = {name: sown[name]["moe"][0] for name in STACKS if "moe" in sown.get(name, {})}
        else:
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
        if not moe:
            return ce + zl, aux
        moe_aux = sum(jnp.sum(stats["aux_loss"]) for stats in moe.values())
        return ce + zl + moe_aux, {**aux, "moe_aux_loss": moe_aux, "moe": moe}

    # ------------------------------------------------------------------ mixture of experts

    def moe_layers(self) -> dict[str, tuple[int, ...]]:
        """Each stack's MoE layer indices (stacks without any left out)."""
        depths = {"decoder": self.cfg.n_layers}
        if self.cfg.is_encoder_decoder:
            depths["encoder"] = self.cfg.encoder_layers
        layers = {name: self.cfg.moe.layers(name, n) for name, n in depths.items()}
        return {name: index for name, index in layers.items() if index}

    def score(self, params: Params, batch: Batch) -> dict[str, jax.Array]:
        """Per-example sum of target log-probabilities where loss weights > 0 (rank
        classification), the number of such tokens, and whether all were the argmax.

        With a `pair_context` feature (int [B]), the encoder features hold distinct contexts
        (rows of their own number) and decoder row b continues context `pair_context[b]`, so
        several continuations of one context encode it once. Decoder-only models, whose
        contexts are in the decoder rows, ignore it."""
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

    # ------------------------------------------------------------------ generation

    def new_cache(
        self,
        params: Params,
        rows: int,
        max_length: int,
        encoder_tokens_BS: jax.Array | None = None,
    ) -> decode.Cache:
        """An empty decoding cache of `max_length` decoder slots. The encoder-decoder needs
        `encoder_tokens_BS` (its input; 0 is padding): they are encoded here, once, and their
        cross-attention keys and values cached."""
        if not self.cfg.is_encoder_decoder:
            return decode.init_cache(self.cfg, rows, max_length)
        if encoder_tokens_BS is None:
            raise ValueError("the encoder-decoder's cache needs encoder_tokens_BS to encode")
        module, cfg = self._bind(params), self.cfg
        tokens_BS = jnp.asarray(encoder_tokens_BS)
        segment_BS = (tokens_BS > 0).astype(jnp.int32)
        positions_BS = jnp.broadcast_to(jnp.arange(tokens_BS.shape[1]), tokens_BS.shape)
        mask = masks.per_layer(
            lambda d: masks.encoder_self_spec(segment_BS, cfg.n_heads, cfg.attention == "mixed", d),
            cfg.attention,
        )
        encoded_BSD = module.encode(tokens_BS, mask, positions_BS)
        return decode.init_cache(cfg, rows, max_length, module.decoder, encoded_BSD, segment_BS)

    def extend(
        self,
        params: Params,
        cache: decode.Cache,
        tokens_BL: jax.Array,
        segment_BL: jax.Array | None = None,
        positions_BL: jax.Array | None = None,
        prefix_BL: jax.Array | None = None,
    ) -> tuple[jax.Array, decode.Cache]:
        """Logits [B, L, V] of `L` new decoder positions given everything in `cache`, and the
        cache with them added (see `models/decode.py`). Defaults: one segment (1), positions
        continuing from the cache's length. `prefix_BL` (1 = bidirectional prefix) counts only
        for the non-causal decoder, and a prefix must come in one call."""
        tokens_BL = jnp.asarray(tokens_BL)
        rows, length = tokens_BL.shape
        if segment_BL is None:
            segment_BL = jnp.ones((rows, length), jnp.int32)
        if positions_BL is None:
            positions_BL = jnp.broadcast_to(cache.length + jnp.arange(length), (rows, length))
        if self.cfg.arch != "noncausal_decoder":
            prefix_BL = None
        return decode.extend(
            self._bind(params), self.cfg, cache, tokens_BL, segment_BL, positions_BL, prefix_BL
        )

    def _prompt(
        self, params: Params, prompt_BP: jax.Array, room: int, lengths_B: jax.Array | None = None
    ) -> tuple:
        """(fresh cache with `room` free decoder slots after the prompt, decoder tokens,
        positions, prefix flags, segment ids) for reading `prompt_BP` as this architecture
        reads a prompt: decoder-only models read `0, prompt...` (the non-causal decoder
        bidirectionally: the prompt is its prefix, as in prefix-LM training); the
        encoder-decoder encodes the prompt and its decoder starts from 0.

        With `lengths_B`, row b holds a prompt of `lengths_B[b]` tokens padded with 0 at the
        right: the encoder masks the padding; a decoder-only row is moved to the right end
        (`0, prompt` right-aligned, the padding before it in segment 0), so that every row's
        next token lands in the same slot and relative distances are those of an unpadded
        row."""
        prompt_BP = jnp.asarray(prompt_BP, jnp.int32)
        rows, length = prompt_BP.shape
        if self.cfg.is_encoder_decoder:
            cache = self.new_cache(params, rows, 1 + room, prompt_BP)
            tokens_BL = jnp.zeros((rows, 1), jnp.int32)
        else:
            cache = self.new_cache(params, rows, 1 + length + room)
            if lengths_B is not None:  # right-align each row: slot j reads j - pad
                pad_B = length - jnp.asarray(lengths_B, jnp.int32)
                src_BP = jnp.arange(length)[None, :] - pad_B[:, None]
                moved_BP = jnp.take_along_axis(prompt_BP, jnp.maximum(src_BP, 0), axis=1)
                prompt_BP = jnp.where(src_BP >= 0, moved_BP, 0)
            tokens_BL = jnp.concatenate([jnp.zeros((rows, 1), jnp.int32), prompt_BP], axis=1)
        slot_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1]), tokens_BL.shape)
        if lengths_B is None or self.cfg.is_encoder_decoder:
            positions_BL, segment_BL = slot_BL, jnp.ones_like(tokens_BL)
        else:  # the start token sits at slot pad_B, the padding before it
            positions_BL = jnp.maximum(slot_BL - pad_B[:, None], 0)
            segment_BL = (slot_BL >= pad_B[:, None]).astype(jnp.int32)
        prefix_BL = None
        if self.cfg.arch == "noncausal_decoder":
            prefix_BL = segment_BL
        return cache, tokens_BL, positions_BL, prefix_BL, segment_BL

    def prefill(
        self, params: Params, prompt_BP: jax.Array, room: int
    ) -> tuple[jax.Array, decode.Cache]:
        """Read a prompt from scratch (see `generate`): the logits [B, L, V] of the decoder
        positions read and a cache with `room` free slots to decode into."""
        cache, tokens_BL, positions_BL, prefix_BL, segment_BL = self._prompt(
            params, prompt_BP, room
        )
        return self.extend(params, cache, tokens_BL, segment_BL, positions_BL, prefix_BL)

    def generate(
        self, params: Params, prompt_BP: jax.Array, steps: int, lengths_B: jax.Array | None = None
    ) -> jax.Array:
        """[B, steps] greedy continuation of each row's prompt, read as `prefill` reads it:
        rows of equal length, or with `lengths_B`, prompts of those lengths padded with 0 at
        the right (each row's continuation equals that of its prompt alone)."""
        cache, tokens_BL, positions_BL, prefix_BL, segment_BL = self._prompt(
            params, prompt_BP, steps, lengths_B
        )
        module = self._bind(params)
        return decode.greedy(
            module, self.cfg, cache, tokens_BL, positions_BL, prefix_BL, steps, segment_BL
        )


def _forward(
    module: nnx.Module,
    batch: Batch,
    rng: jax.Array | None,
    deterministic: bool,
    record: bool = False,
) -> jax.Array:
    """Float32 logits at the decoder positions of the bound `module`; with `record` (static),
    its stacks sow their intermediates."""
    cfg: ModelConfig = module.cfg
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
            masks.per_layer(
                lambda d: masks.encoder_self_spec(enc_segment_BS, heads, mixed, d),
                cfg.attention,
            ),
            enc_positions_BS,
            enc_rng,
            deterministic,
            record,
        )
        context_B = batch.get("pair_context")
        if context_B is not None:  # encoder rows are distinct contexts, each encoded once
            encoded_BSD = jnp.take(encoded_BSD, context_B, axis=0)
            enc_segment_BS = jnp.take(enc_segment_BS, context_B, axis=0)
        return module.decode(
            encoded_BSD,
            tokens_BL,
            masks.decoder_self_spec(segment_BL),
            masks.cross_spec(segment_BL, enc_segment_BS),
            positions_BL,
            dec_rng,
            deterministic,
            record,
        )
    prefix_BL = None
    if cfg.arch == "noncausal_decoder":
        prefix_BL = batch.get("decoder_causal_attention")
        prefix_BL = jnp.zeros_like(tokens_BL) if prefix_BL is None else prefix_BL
    # Mixed layers only change bidirectional regions: the causal decoder has none.
    mask = masks.per_layer(
        lambda d: masks.decoder_self_spec(segment_BL, prefix_BL, heads, mixed, d),
        cfg.attention if prefix_BL is not None else "standard",
    )
    return module(tokens_BL, mask, positions_BL, rng, deterministic, record)


def build_model(cfg: ModelConfig) -> Model:
    """The model for `cfg` (architecture from `cfg.arch`)."""
    return Model(cfg)


def stack_depths(cfg: ModelConfig) -> dict[str, int]:
    """The model's layer stacks as {the config field setting its depth: that depth}."""
    if cfg.arch == "encoder_decoder":
        return {"n_layers": cfg.n_layers, "n_encoder_layers": cfg.encoder_layers}
    return {"n_layers": cfg.n_layers}


class PromptLayout(NamedTuple):
    """How `Model.prefill` reads a prompt: `encoded` positions through the encoder (0: none),
    `read` decoder positions in its first call, `slots` in the decoder's cache."""

    encoded: int
    read: int
    slots: int


def prompt_layout(cfg: ModelConfig, length: int, room: int) -> PromptLayout:
    """The layout `Model.prefill` gives a `length`-token prompt with `room` slots to decode
    into: decoder-only models read `0, prompt` into a cache of them plus the room; the
    encoder-decoder encodes the prompt and its decoder cache holds `0` and the room."""
    if cfg.arch == "encoder_decoder":
        return PromptLayout(encoded=length, read=1, slots=1 + room)
    return PromptLayout(encoded=0, read=1 + length, slots=1 + length + room)


def is_compatible_adaptation(parent: ModelConfig, arch: str) -> bool:
    """Whether a run of `parent` can go on as a model of architecture `arch` with the same
    parameter tree: the two decoder-only architectures share one (position tables aside,
    which a comparison of `abstract_params` settles); the encoder-decoder shares with neither."""
    return (arch == "encoder_decoder") == (parent.arch == "encoder_decoder")
