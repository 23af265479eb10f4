"""Attention masks as pure functions of the batch features.

Every mask is boolean, True where a query may attend to a key, shaped [B, H or 1, Q, K] so it
broadcasts over heads. The three architectures differ only in which of these they combine
(see `models/api.py`): the causal decoder uses `causal`; the non-causal decoder adds the
bidirectional prefix of `decoder_causal_attention`; the encoder is bidirectional and the
encoder-decoder's cross-attention only joins matching packed segments.

"Mixed" attention (for bidirectional regions only) gives the first half of the heads a forward
(lower-triangular, key <= query) mask and the second half a backward (upper-triangular,
key >= query) mask. "Mixed layers" does the same per layer instead of per head: even layers
forward, odd layers backward (`LAYER_DIRECTIONS`); a stack then receives one mask per
direction (`per_layer`), and layer i uses mask i % 2.

`MaskSpec` holds the same information in structured form (segment ids, causal or prefix,
mixed heads, a layer's direction) so that fused attention kernels, which take segment ids and
a causal flag rather than a dense [B, H, Q, K] array, can be used; `MaskSpec.dense()` is the
boolean mask it stands for, and the dense builders below are defined through it.

`by_slot` builds the same masks from explicit query and key indices, for incremental decoding
with a key/value cache (`models/decode.py`), where queries are a few new positions and keys
every cached one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from scalestudy.config.experiment import ModelConfig

LAYER_DIRECTIONS = ("forward", "backward")  # "mixed_layers": layer i goes LAYER_DIRECTIONS[i % 2]


def decoder_mode(cfg: ModelConfig) -> str:
    """A decoder-only model's stack mode: "prefix" where the non-causal
    decoder's prefix gets mirrored relative-position buckets, else "causal"; the table
    `api._module` builds and `counting.py` counts."""
    mirrored = cfg.arch == "noncausal_decoder" and cfg.rel_prefix_buckets == "mirrored"
    return "prefix" if mirrored else "causal"


def causal(q_len: int, k_len: int | None = None) -> jnp.ndarray:
    """[1, 1, Q, K] lower-triangular mask: query i sees keys j <= i."""
    k_len = q_len if k_len is None else k_len
    q_Q1 = jnp.arange(q_len)[:, None]
    k_1K = jnp.arange(k_len)[None, :]
    return (k_1K <= q_Q1)[None, None]


def directions(
    length: int, n_heads: int, mixed: bool, layer_direction: str | None = None
) -> jnp.ndarray:
    """[1, H or 1, L, L] head directions of a bidirectional region.

    Standard attention sees everything (all True, one head); mixed attention gives heads
    [0, H/2) the forward mask (key <= query) and heads [H/2, H) the backward mask
    (key >= query); `layer_direction` ("forward" or "backward") gives every head of a layer
    that one direction (mixed layers).
    """
    forward_LL = causal(length)[0, 0]
    if layer_direction is not None:
        return (forward_LL if layer_direction == "forward" else forward_LL.T)[None, None]
    if not mixed:
        return jnp.ones((1, 1, length, length), bool)
    backward_LL = forward_LL.T
    is_forward_H = jnp.arange(n_heads) < (n_heads + 1) // 2
    return jnp.where(is_forward_H[:, None, None], forward_LL, backward_LL)[None]


def padding(q_valid_BQ: jnp.ndarray, k_valid_BK: jnp.ndarray) -> jnp.ndarray:
    """[B, 1, Q, K]: both the query and the key are real (non-padding) positions."""
    return (q_valid_BQ.astype(bool)[:, None, :, None]) & (k_valid_BK.astype(bool)[:, None, None, :])


def segments(q_segment_BQ: jnp.ndarray, k_segment_BK: jnp.ndarray) -> jnp.ndarray:
    """[B, 1, Q, K]: query and key belong to the same packed segment (0 is padding)."""
    same = q_segment_BQ[:, None, :, None] == k_segment_BK[:, None, None, :]
    return same & padding(q_segment_BQ > 0, k_segment_BK > 0)


def prefix(
    causal_attention_BL: jnp.ndarray,
    n_heads: int = 1,
    mixed: bool = False,
    layer_direction: str | None = None,
) -> jnp.ndarray:
    """[B, H or 1, L, L] prefix-LM mask: causal, plus both-ways among prefix positions.

    `causal_attention_BL` is 1 over the bidirectional prefix (seqio's
    `decoder_causal_attention`). Pairs inside the prefix follow `directions` (all visible, or
    one direction per head when mixed, or per layer); every other pair is causal. An all-zero
    prefix gives exactly the causal mask.
    """
    length = causal_attention_BL.shape[-1]
    in_prefix_BL = causal_attention_BL.astype(bool)
    both_BQK = in_prefix_BL[:, None, :, None] & in_prefix_BL[:, None, None, :]
    inside = directions(length, n_heads, mixed, layer_direction)
    return jnp.where(both_BQK, inside, causal(length))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """Who may attend to whom, as structure: segment ids (0 = padding) on both sides, and
    within a segment either causal (key index <= query index), the prefix-LM pattern over
    `prefix_BQ` (self-attention only), or everything; `mixed_heads` > 0 makes the
    bidirectional pairs follow `directions` over that many heads, and `direction` "backward"
    makes them all backward (key index >= query index; a mixed-layers odd layer). A forward
    layer is simply causal (the builders below give it as `causal=True`, no prefix)."""

    q_segment_BQ: jnp.ndarray
    k_segment_BK: jnp.ndarray
    prefix_BQ: jnp.ndarray | None = None
    causal: bool = dataclasses.field(default=False, metadata={"static": True})
    mixed_heads: int = dataclasses.field(default=0, metadata={"static": True})
    direction: str | None = dataclasses.field(default=None, metadata={"static": True})

    @property
    def bidirectional(self) -> bool:
        """Some pairs are not plainly causal (no causal structure, or a prefix)."""
        return not self.causal or self.prefix_BQ is not None

    def dense(self) -> jnp.ndarray:
        """The boolean mask [B, H or 1, Q, K] this structure stands for."""
        q_len, k_len = self.q_segment_BQ.shape[-1], self.k_segment_BK.shape[-1]
        heads, mixed = max(self.mixed_heads, 1), self.mixed_heads > 0
        if self.prefix_BQ is not None:
            within = prefix(self.prefix_BQ, heads, mixed, self.direction)
        elif self.causal:
            within = causal(q_len, k_len)
        elif mixed or self.direction is not None:
            within = directions(q_len, heads, mixed, self.direction)
        else:
            within = jnp.ones((1, 1, q_len, k_len), bool)
        return within & segments(self.q_segment_BQ, self.k_segment_BK)


def decoder_self_spec(
    segment_BL: jnp.ndarray,
    causal_attention_BL: jnp.ndarray | None = None,
    n_heads: int = 1,
    mixed: bool = False,
    layer_direction: str | None = None,
) -> MaskSpec:
    """Decoder self-attention: causal (or prefix-LM when `causal_attention_BL` is given),
    restricted to the query's own packed segment; `layer_direction` as in `directions`."""
    if causal_attention_BL is None or layer_direction == "forward":
        return MaskSpec(segment_BL, segment_BL, causal=True)
    heads = n_heads if mixed and layer_direction is None else 0
    return MaskSpec(
        segment_BL,
        segment_BL,
        causal_attention_BL,
        causal=True,
        mixed_heads=heads,
        direction=layer_direction,
    )


def encoder_self_spec(
    segment_BS: jnp.ndarray,
    n_heads: int = 1,
    mixed: bool = False,
    layer_direction: str | None = None,
) -> MaskSpec:
    """Encoder self-attention: bidirectional (or mixed, or one direction per layer) within
    each packed segment."""
    if layer_direction == "forward":
        return MaskSpec(segment_BS, segment_BS, causal=True)
    heads = n_heads if mixed and layer_direction is None else 0
    return MaskSpec(segment_BS, segment_BS, mixed_heads=heads, direction=layer_direction)


def cross_spec(decoder_segment_BL: jnp.ndarray, encoder_segment_BS: jnp.ndarray) -> MaskSpec:
    """Encoder-decoder attention: each decoder position reads its own example's encoder."""
    return MaskSpec(decoder_segment_BL, encoder_segment_BS)


def decoder_self(
    segment_BL: jnp.ndarray,
    causal_attention_BL: jnp.ndarray | None = None,
    n_heads: int = 1,
    mixed: bool = False,
    layer_direction: str | None = None,
) -> jnp.ndarray:
    """Dense `decoder_self_spec`: [B, H or 1, L, L]."""
    spec = decoder_self_spec(segment_BL, causal_attention_BL, n_heads, mixed, layer_direction)
    return spec.dense()


def encoder_self(
    segment_BS: jnp.ndarray,
    n_heads: int = 1,
    mixed: bool = False,
    layer_direction: str | None = None,
) -> jnp.ndarray:
    """Dense `encoder_self_spec`: [B, H or 1, S, S]."""
    return encoder_self_spec(segment_BS, n_heads, mixed, layer_direction).dense()


def per_layer(
    build: Callable[[str | None], MaskSpec | jnp.ndarray], attention: str
) -> MaskSpec | jnp.ndarray | tuple[MaskSpec, ...]:
    """`build(layer_direction)` once, or, for "mixed_layers", one mask per direction (layer i
    of a stack uses mask i % 2): a tuple of `MaskSpec`s, or dense masks stacked on a leading
    axis [2, B, H, Q, K]."""
    if attention != "mixed_layers":
        return build(None)
    built = tuple(build(d) for d in LAYER_DIRECTIONS)
    return built if isinstance(built[0], MaskSpec) else jnp.stack(built)


def by_slot(
    q_slot_BQ: jnp.ndarray,
    k_slot_BK: jnp.ndarray,
    q_segment_BQ: jnp.ndarray,
    k_segment_BK: jnp.ndarray,
    q_prefix_BQ: jnp.ndarray | None = None,
    k_prefix_BK: jnp.ndarray | None = None,
    n_heads: int = 1,
    mixed: bool = False,
    layer_direction: str | None = None,
) -> jnp.ndarray:
    """[B, H or 1, Q, K] decoder self-attention from explicit indices (slots in the row).

    The same rule as `decoder_self`: key slot <= query slot, both ways among prefix slots
    (one direction per head when mixed, per layer with `layer_direction`), same segment.
    With `q_slot = k_slot = arange(L)` it equals `decoder_self` on the whole row.
    """
    forward_BQK = k_slot_BK[:, None, :] <= q_slot_BQ[:, :, None]
    within = forward_BQK[:, None]
    if q_prefix_BQ is not None:
        both_BQK = q_prefix_BQ.astype(bool)[:, :, None] & k_prefix_BK.astype(bool)[:, None, :]
        backward_BQK = k_slot_BK[:, None, :] >= q_slot_BQ[:, :, None]
        if layer_direction is not None:
            inside = (forward_BQK if layer_direction == "forward" else backward_BQK)[:, None]
        elif mixed:
            is_forward_H = jnp.arange(n_heads) < (n_heads + 1) // 2
            inside = jnp.where(
                is_forward_H[None, :, None, None], forward_BQK[:, None], backward_BQK[:, None]
            )
        else:
            inside = jnp.ones_like(within)
        within = jnp.where(both_BQK[:, None], inside, within)
    return within & segments(q_segment_BQ, k_segment_BK)
