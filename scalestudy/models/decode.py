"""Incremental decoding with a key/value cache, and greedy generation.

A `Cache` holds, for every layer of the decoder stack, the keys and values (after RoPE) of the
positions processed so far, in slots 0 .. length-1 of a fixed-size buffer, together with each
slot's segment id, position and prefix flag. `extend` runs a chunk of new positions: it writes
their keys and values into the next slots and attends each new query to every filled slot
under the same rule the full forward pass uses (`masks.by_slot`), through the very blocks
training runs (`decoder.Stack` with a cache: masked slots get exactly zero weight, so empty
cache slots change nothing), so the logits equal the uncached ones. The relative-position bias
is the stack's shared [H, L, S] table looked up at the new queries' slots against every slot.

The causal decoder can therefore keep its cache across the turns of a dialogue and pay only
for new tokens; a non-causal decoder's bidirectional prefix must be recomputed
whenever it grows (its earlier positions attend to the new ones), and an encoder-decoder
re-encodes the whole history. The encoder-decoder's cache also holds the cross-attention keys
and values of the encoder output, computed once per encoding.

This module never looks at the architecture: `models/api.py` passes the prefix flags (non-causal
decoder) and the encoder output (encoder-decoder). Shape letters as in `layers.py`, plus N
layers and P mask periods (mixed layers).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from scalestudy.config.experiment import ModelConfig
from scalestudy.models import masks
from scalestudy.models.decoder import Context, Stack, output_logits
from scalestudy.models.layers import KV


class Cache(NamedTuple):
    """Keys and values of the positions processed so far (slots 0 .. length - 1)."""

    k_NBSHK: jax.Array
    v_NBSHK: jax.Array
    segment_BS: jax.Array  # 0 on empty slots
    position_BS: jax.Array
    prefix_BS: jax.Array  # 1 on bidirectional-prefix slots (non-causal decoder)
    length: jax.Array  # int32 scalar: filled slots, the same in every row
    cross_k_NBSHK: jax.Array | None = None  # encoder-decoder: keys/values of the encoder output
    cross_v_NBSHK: jax.Array | None = None
    cross_segment_BS: jax.Array | None = None


def init_cache(
    cfg: ModelConfig,
    batch_size: int,
    max_length: int,
    stack: Stack | None = None,
    encoded_BSD: jax.Array | None = None,
    encoder_segment_BS: jax.Array | None = None,
) -> Cache:
    """An empty cache of `max_length` slots; with an encoder output (and the decoder `stack`
    reading it), also that output's cross-attention keys and values for every layer."""
    shape = (cfg.n_layers, batch_size, max_length, cfg.n_heads, cfg.head_dim)
    zeros_BS = jnp.zeros((batch_size, max_length), jnp.int32)
    cache = Cache(
        jnp.zeros(shape, cfg.dtype),
        jnp.zeros(shape, cfg.dtype),
        zeros_BS,
        zeros_BS,
        zeros_BS,
        jnp.zeros((), jnp.int32),
    )
    if encoded_BSD is None:
        return cache
    cross = stack.cross_kv(encoded_BSD)
    return cache._replace(
        cross_k_NBSHK=cross.k_BSHK, cross_v_NBSHK=cross.v_BSHK, cross_segment_BS=encoder_segment_BS
    )


def extend(
    module: nnx.Module,
    cfg: ModelConfig,
    cache: Cache,
    tokens_BL: jax.Array,
    segment_BL: jax.Array,
    positions_BL: jax.Array,
    prefix_BL: jax.Array | None = None,
) -> tuple[jax.Array, Cache]:
    """Float32 logits [B, L, V] of `L` new positions and the cache holding them too.

    `module` is a bound `Decoder` or `EncoderDecoder` (its `embed`, `decoder` stack and output
    projection are used). `prefix_BL` marks bidirectional-prefix positions (non-causal
    decoder); a prefix must arrive in one chunk, since its earlier positions attend to its
    later ones. The cache must have room for the chunk (not checked inside jit).
    """
    stack: Stack = module.decoder
    start = cache.length
    length = tokens_BL.shape[1]
    write = lambda buf, new: jax.lax.dynamic_update_slice_in_dim(buf, new, start, axis=1)
    prefix_BL = jnp.zeros_like(segment_BL) if prefix_BL is None else prefix_BL
    segment_BS = write(cache.segment_BS, segment_BL.astype(jnp.int32))
    position_BS = write(cache.position_BS, positions_BL.astype(jnp.int32))
    prefix_BS = write(cache.prefix_BS, prefix_BL.astype(jnp.int32))
    rows, slots = segment_BS.shape
    q_slot_BL = jnp.broadcast_to(start + jnp.arange(length), (rows, length))
    k_slot_BS = jnp.broadcast_to(jnp.arange(slots), (rows, slots))
    heads, mixed = cfg.n_heads, cfg.attention == "mixed"
    mask_BHLS = masks.per_layer(
        lambda d: masks.by_slot(
            q_slot_BL, k_slot_BS, segment_BL, segment_BS, prefix_BL, prefix_BS, heads, mixed, d
        ),
        cfg.attention,
    )
    bias_HLS = None
    if cfg.position == "relative_bias":
        bias_HLS = stack.relpos(q_slot_BL[0], k_slot_BS[0])
    cross_mask, cross = None, None
    if cache.cross_k_NBSHK is not None:
        cross_mask = masks.cross_spec(segment_BL, cache.cross_segment_BS)
        cross = KV(cache.cross_k_NBSHK, cache.cross_v_NBSHK)
    ctx = Context(mask_BHLS, bias_HLS, positions_BL, None, cross_mask)
    x_BLD, (self_kv, _) = stack(
        module.embed(tokens_BL), ctx, cache=(KV(cache.k_NBSHK, cache.v_NBSHK, start), cross)
    )
    new = cache._replace(
        k_NBSHK=self_kv.k_BSHK,
        v_NBSHK=self_kv.v_BSHK,
        segment_BS=segment_BS,
        position_BS=position_BS,
        prefix_BS=prefix_BS,
        length=start + length,
    )
    return output_logits(module, x_BLD), new


def greedy(
    module: nnx.Module,
    cfg: ModelConfig,
    cache: Cache,
    tokens_BL: jax.Array,
    positions_BL: jax.Array,
    prefix_BL: jax.Array | None,
    steps: int,
    segment_BL: jax.Array | None = None,
) -> jax.Array:
    """[B, steps] greedy continuation: prefill `tokens_BL` (one unpacked segment per row,
    `segment_BL` 1 on it and 0 on padding before it; default all 1), then feed back the
    argmax one position at a time."""
    rows, length = tokens_BL.shape
    if segment_BL is None:
        segment_BL = jnp.ones((rows, length), jnp.int32)
    logits_BLV, cache = extend(module, cfg, cache, tokens_BL, segment_BL, positions_BL, prefix_BL)
    first_B = jnp.argmax(logits_BLV[:, -1], axis=-1).astype(jnp.int32)
    next_position_B = positions_BL[:, -1] + 1

    def step(carry: tuple, i: jax.Array) -> tuple[tuple, jax.Array]:
        cache, token_B = carry
        logits_B1V, cache = extend(
            module,
            cfg,
            cache,
            token_B[:, None],
            jnp.ones((rows, 1), jnp.int32),
            (next_position_B + i)[:, None],
        )
        return (cache, jnp.argmax(logits_B1V[:, 0], axis=-1).astype(jnp.int32)), token_B

    (_, last_B), tokens_TB = jax.lax.scan(step, (cache, first_B), jnp.arange(steps - 1))
    return jnp.concatenate([tokens_TB.T, last_B[:, None]], axis=1)
