"""Transformer building blocks (Flax NNX), T5.1.1 conventions.

Shape letters: B batch, L query length, S key length, D model, H heads, K head dim,
F feed-forward, V vocab, N relative-position buckets.

Every parameter carries its logical axis names as `out_sharding` metadata (mapped to mesh
axes only by `train/sharding.py`); parameters are stored in `param_dtype` and cast to the
compute dtype where used. Masks come from `models/masks.py`; this module never decides who
may attend to whom.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import spmd as flax_spmd
from flax.linen import spmd as linen_spmd
from jax.ad_checkpoint import checkpoint_name

from scalestudy.config.experiment import ModelConfig
from scalestudy.models import attention
from scalestudy.models.attention import NEG_INF, dropout
from scalestudy.models.masks import MaskSpec

__all__ = ["NEG_INF", "dropout"]  # re-exported for the stacks

# Names of activations a remat policy may keep (models/decoder.py REMAT_POLICIES).
QKV = "attention_qkv"  # query, key and value projections
ATTENTION_OUT = "attention_out"  # attention output before the output projection
MLP_HIDDEN = "mlp_hidden"  # the feed-forward input projections, before the activation


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Constrain an activation's sharding by logical axis names (no-op without active rules)."""
    if not flax_spmd.get_logical_axis_rules() or jax.sharding.get_abstract_mesh().empty:
        return x
    return linen_spmd.with_logical_constraint(x, names)


def _mix(x: jax.Array) -> jax.Array:
    """A 32-bit integer finaliser (xorshift-multiply): a well-spread hash of `x`."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major index, built elementwise so it shards like the output."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, dim) * jnp.uint32(stride)
        stride *= shape[dim]
    return index


def _unit_interval(bits: jax.Array) -> jax.Array:
    return ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1)


class ParamInit:
    """Independent standard-normal draws for each parameter, from one seed.

    A counter-based hash of (seed, parameter number, element index) with a Box-Muller
    transform, instead of one threefry call per parameter, whose compile time dominated
    compiling a tiny model on CPU (docs/models.md). The draw is
    elementwise in the element index, so it is the same under any sharding.
    """

    GOLDEN = 0x9E3779B9

    def __init__(self, seed_2: jax.Array):
        self.seed_2 = jnp.asarray(seed_2, jnp.uint32)
        self.count = 0

    @classmethod
    def from_key(cls, key: jax.Array) -> ParamInit:
        """From a JAX PRNG key (typed or raw uint32)."""
        if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)
        words = jnp.asarray(key).reshape(-1).astype(jnp.uint32)
        return cls(jnp.stack([words[0], words[-1]]))

    def _salt(self) -> jax.Array:
        self.count += 1
        step = jnp.uint32((self.count * self.GOLDEN) & 0xFFFFFFFF)
        return _mix(self.seed_2[0] ^ _mix(self.seed_2[1] + step))

    def normal(self, shape: tuple[int, ...]) -> jax.Array:
        """A float32 standard-normal array."""
        bits = _mix(_flat_index(shape) ^ self._salt())
        other = _mix(bits ^ jnp.uint32(self.GOLDEN))
        radius = jnp.sqrt(-2.0 * jnp.log(_unit_interval(bits)))
        return radius * jnp.cos((2.0 * math.pi) * _unit_interval(other))

    def split(self, n: int) -> jax.Array:
        """[n, 2] seeds for `n` independent initialisers (e.g. one per layer)."""
        salt = self._salt()
        index = jnp.arange(n, dtype=jnp.uint32)
        return jnp.stack([_mix(index ^ salt), _mix(index + self.seed_2[1] ^ salt)], axis=-1)


def param(
    init: ParamInit,
    shape: Sequence[int],
    axes: tuple[str | None, ...],
    std: float,
    dtype: str,
) -> nnx.Param:
    """A normally initialised parameter annotated with logical axes (std 0 means ones)."""
    if std == 0.0:
        value = jnp.ones(shape, dtype)
    else:
        value = (std * init.normal(tuple(shape))).astype(dtype)
    return nnx.Param(value, out_sharding=axes)


def project(spec: str, x: jax.Array, w: jax.Array, out_dtype: Any = None) -> jax.Array:
    """`jnp.einsum(spec, x, w)` ("inputs,weight->outputs"), whose weight gradient contracts
    (inputs, cotangent) in that order.

    Used where the cotangent is elementwise work over a wide output (the feed-forward
    activation's derivative, the softmax's over the vocabulary). The same products and sums
    as autodiff's gradient, in another order."""
    return _project(spec, out_dtype, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _project(spec: str, out_dtype: Any, x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)


def _project_fwd(spec: str, out_dtype: Any, x: jax.Array, w: jax.Array) -> tuple:
    return _project(spec, out_dtype, x, w), (x, w)


def _project_bwd(spec: str, out_dtype: Any, res: tuple, g: jax.Array) -> tuple:
    x, w = res
    ins, out = spec.split("->")
    x_axes, w_axes = ins.split(",")
    dx = jnp.einsum(f"{out},{w_axes}->{x_axes}", g, w, preferred_element_type=out_dtype)
    # Inputs first: with the cotangent first, XLA:CPU fuses the elementwise work into a
    # strided, transposed write of the wide [B*L, wide] cotangent; this order transposes the
    # narrower inputs instead (docs/performance.md#profile).
    dw = jnp.einsum(f"{x_axes},{out}->{w_axes}", x, g, preferred_element_type=out_dtype)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_project.defvjp(_project_fwd, _project_bwd)


class RMSNorm(nnx.Module):
    """T5 layer norm: scale only, no mean subtraction, no bias; computed in float32."""

    def __init__(self, cfg: ModelConfig, init: ParamInit):
        self.scale = param(init, (cfg.d_model,), ("embed",), 0.0, cfg.param_dtype)
        self.dtype = cfg.dtype

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        x = _rms_normalize(x_BLD)
        return (x * self.scale[...].astype(jnp.float32)).astype(self.dtype)


def _rms_normalize(x: jax.Array) -> jax.Array:
    """`x` in float32 divided by its root mean square over the last axis (T5's epsilon)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


class Embed(nnx.Module):
    """Token embedding table [V, D]; also the output projection when tied."""

    def __init__(self, cfg: ModelConfig, init: ParamInit):
        self.table = param(
            init, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), 1.0, cfg.param_dtype
        )
        self.dtype = cfg.dtype

    def __call__(self, tokens_BL: jax.Array) -> jax.Array:
        return jnp.take(self.table[...], tokens_BL, axis=0).astype(self.dtype)

    def attend(self, x_BLD: jax.Array) -> jax.Array:
        """Logits against the embedding table, in float32."""
        table_VD = self.table[...].astype(self.dtype)
        return project("BLD,VD->BLV", x_BLD, table_VD, jnp.float32)


def rope(x_BLHK: jax.Array, positions_BL: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotary position embedding over the head dimension (halves rotated together)."""
    half = x_BLHK.shape[-1] // 2
    freq_K = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle_BLK = positions_BL.astype(jnp.float32)[..., None] * freq_K
    sin, cos = jnp.sin(angle_BLK)[:, :, None], jnp.cos(angle_BLK)[:, :, None]
    x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHK.dtype)


def _head_norm(x_BLHK: jax.Array, scale_K: jax.Array, factor: float) -> jax.Array:
    """RMS normalisation over each head's K features (float32), times the learnt scale and a
    constant `factor` (1/sqrt(K) for queries: T5 folds it into the query initialisation,
    which a normalised query no longer carries)."""
    x = _rms_normalize(x_BLHK)
    return (x * (factor * scale_K.astype(jnp.float32))).astype(x_BLHK.dtype)


class KV(NamedTuple):
    """One attention layer's decoding cache: keys and values [B, S, H, K] of S slots (after
    RoPE). `start` is the first slot a call writes its new keys and values into (self-
    attention); None marks fixed keys and values (cross-attention to a cached encoder output)."""

    k_BSHK: jax.Array
    v_BSHK: jax.Array
    start: jax.Array | None = None


class Attention(nnx.Module):
    """Multi-head dot-product attention without biases; the mask and position bias come in.

    As in T5 there is no 1/sqrt(K) logit scaling: it is folded into the query initialisation.
    The core (`attention.attend`) runs on the backend `cfg.attention_impl` picks; attention
    dropout in training and recording the probabilities use the reference path. The same
    module serves training and decoding: given a `KV` cache it attends to the cached slots.
    """

    def __init__(self, cfg: ModelConfig, init: ParamInit):
        d, h, k = cfg.d_model, cfg.n_heads, cfg.head_dim
        pd = cfg.param_dtype
        self.q = param(init, (d, h, k), ("embed", "heads", "kv"), (d * k) ** -0.5, pd)
        self.k = param(init, (d, h, k), ("embed", "heads", "kv"), d**-0.5, pd)
        self.v = param(init, (d, h, k), ("embed", "heads", "kv"), d**-0.5, pd)
        self.o = param(init, (h, k, d), ("heads", "kv", "embed"), (h * k) ** -0.5, pd)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_scale = param(init, (k,), ("kv",), 0.0, pd)
            self.k_scale = param(init, (k,), ("kv",), 0.0, pd)
        self.dtype = cfg.dtype
        self.rope = cfg.position == "rope"
        self.dropout = cfg.dropout
        self.impl = cfg.attention_impl
        self.logits = cfg.attention_logits

    def project_kv(self, kv_BSD: jax.Array) -> KV:
        """Keys and values of `kv_BSD` (no RoPE), as fixed cache entries (cross-attention)."""
        dt = self.dtype
        k_BSHK = jnp.einsum("BSD,DHK->BSHK", kv_BSD, self.k[...].astype(dt))
        v_BSHK = jnp.einsum("BSD,DHK->BSHK", kv_BSD, self.v[...].astype(dt))
        if self.qk_norm:
            k_BSHK = _head_norm(k_BSHK, self.k_scale[...], 1.0)
        return KV(k_BSHK, v_BSHK)

    def __call__(
        self,
        x_BLD: jax.Array,
        kv_BSD: jax.Array | None,
        mask: MaskSpec | jax.Array,
        bias_HLS: jax.Array | None = None,
        q_positions_BL: jax.Array | None = None,
        k_positions_BS: jax.Array | None = None,
        rng: jax.Array | None = None,
        deterministic: bool = True,
        record: bool = False,
        cache: KV | None = None,
    ) -> tuple[jax.Array, KV | None]:
        """Output [B, L, D] and the cache with this call's keys and values written (None
        without a cache). `mask` is a `masks.MaskSpec` or a dense boolean [B, H or 1, L, S]
        over the keys (the cache's slots when cached); `bias_HLS` is [H, L, S]. With `record`
        (static), the float32 probabilities [B, H, L, S] after masking and softmax (before
        dropout) are sown as `nnx.Intermediate` "probs_BHLS" (read them with `nnx.capture`)."""
        dt = self.dtype
        q_BLHK = jnp.einsum("BLD,DHK->BLHK", x_BLD, self.q[...].astype(dt))
        if self.qk_norm:
            q_BLHK = _head_norm(q_BLHK, self.q_scale[...], q_BLHK.shape[-1] ** -0.5)
        q_BLHK = constrain(q_BLHK, ("batch", "length", "heads", "kv"))
        fixed = cache is not None and cache.start is None
        k_BSHK, v_BSHK = cache[:2] if fixed else self.project_kv(kv_BSD)[:2]
        if self.rope and q_positions_BL is not None:
            q_BLHK = rope(q_BLHK, q_positions_BL)
            k_BSHK = rope(k_BSHK, k_positions_BS)
        q_BLHK, k_BSHK, v_BSHK = (checkpoint_name(a, QKV) for a in (q_BLHK, k_BSHK, v_BSHK))
        if cache is not None and not fixed:
            write = lambda buf, new: jax.lax.dynamic_update_slice_in_dim(buf, new, cache.start, 1)
            cache = KV(write(cache.k_BSHK, k_BSHK), write(cache.v_BSHK, v_BSHK), cache.start)
            k_BSHK, v_BSHK = cache.k_BSHK, cache.v_BSHK
        if record or (self.dropout > 0 and not deterministic):
            out_BLHK = attention.reference(
                q_BLHK,
                k_BSHK,
                v_BSHK,
                mask,
                bias_HLS,
                dropout_rate=self.dropout,
                rng=rng,
                deterministic=deterministic,
                return_probs=record,
                logits=self.logits,
            )
            if record:
                out_BLHK, probs_BHLS = out_BLHK
                self.sow(nnx.Intermediate, "probs_BHLS", probs_BHLS)
        else:
            # A forced fused backend may not take a decoding step (one query, an odd number
            # of slots, a dense mask): when cached, "auto" uses it where it can.
            impl = self.impl if cache is None or self.impl == "xla" else "auto"
            out_BLHK = attention.attend(
                q_BLHK, k_BSHK, v_BSHK, mask, bias_HLS, impl=impl, logits=self.logits
            )
        out_BLHK = checkpoint_name(out_BLHK, ATTENTION_OUT)
        out_BLD = jnp.einsum("BLHK,HKD->BLD", out_BLHK, self.o[...].astype(dt))
        return out_BLD, cache


_ACTIVATIONS = {"gelu": lambda x: jax.nn.gelu(x, approximate=True), "silu": jax.nn.silu}


def activation(name: str) -> tuple[bool, Any]:
    """(gated, activation function) of a `model.activation` name."""
    base = name.removeprefix("gated_")
    return name.startswith("gated_"), jax.nn.relu if base == "relu" else _ACTIVATIONS[base]


class MLP(nnx.Module):
    """Feed-forward block: gated (T5.1.1 gated-GELU: wi_0 activated times wi_1) or plain;
    `width` (default `d_ff`) is its hidden width."""

    def __init__(self, cfg: ModelConfig, init: ParamInit, width: int | None = None):
        d, f, pd = cfg.d_model, width or cfg.d_ff, cfg.param_dtype
        self.gated, self.act = activation(cfg.activation)
        self.wi_0 = param(init, (d, f), ("embed", "mlp"), d**-0.5, pd)
        if self.gated:
            self.wi_1 = param(init, (d, f), ("embed", "mlp"), d**-0.5, pd)
        self.wo = param(init, (f, d), ("mlp", "embed"), f**-0.5, pd)
        self.dtype = cfg.dtype
        self.dropout = cfg.dropout

    def __call__(
        self, x_BLD: jax.Array, rng: jax.Array | None = None, deterministic: bool = True
    ) -> jax.Array:
        dt = self.dtype
        up = lambda w: checkpoint_name(project("BLD,DF->BLF", x_BLD, w[...].astype(dt)), MLP_HIDDEN)
        h_BLF = self.act(up(self.wi_0))
        if self.gated:
            h_BLF = h_BLF * up(self.wi_1)
        h_BLF = constrain(h_BLF, ("batch", "length", "mlp"))
        h_BLF = dropout(h_BLF, self.dropout, rng, deterministic)
        return jnp.einsum("BLF,FD->BLD", h_BLF, self.wo[...].astype(dt))


def relative_bucket(
    rel_BLS: jax.Array, *, bidirectional: bool, n_buckets: int, max_distance: int
) -> jax.Array:
    """T5's bucketing of `rel = key_position - query_position`.

    Unidirectional: only the past (rel <= 0) is distinguished, with all `n_buckets`; the future
    falls into bucket 0. Bidirectional: half the buckets for the past, half for the future.
    Within a direction, half the buckets are exact distances, the rest log-spaced up to
    `max_distance`.
    """
    distance = -rel_BLS  # > 0 for keys in the past
    bucket = jnp.zeros_like(rel_BLS)
    if bidirectional:
        n_buckets //= 2
        bucket = bucket + (distance < 0).astype(rel_BLS.dtype) * n_buckets
        distance = jnp.abs(distance)
    else:
        distance = jnp.maximum(distance, 0)
    n_exact = n_buckets // 2
    log_ratio = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / n_exact) / math.log(
        max_distance / n_exact
    )
    large = n_exact + (log_ratio * (n_buckets - n_exact)).astype(rel_BLS.dtype)
    large = jnp.minimum(large, n_buckets - 1)
    return bucket + jnp.where(distance < n_exact, distance, large)


class RelativePositionBias(nnx.Module):
    """One bucketed bias table per stack, shared by all its layers (as in T5).

    mode "causal": unidirectional buckets (causal decoders). mode "bidirectional": T5's
    encoder buckets. mode "prefix" (non-causal decoder): the causal buckets for the past plus a
    mirrored set of `n_buckets` for the future (reachable only inside the prefix), so pairs in
    the bidirectional prefix are told apart by direction, and with an empty prefix the model is
    exactly a causal decoder.
    """

    TABLE_FACTOR: ClassVar[dict[str, int]] = {"causal": 1, "bidirectional": 1, "prefix": 2}

    def __init__(self, cfg: ModelConfig, mode: str, init: ParamInit):
        self.mode = mode
        self.n_buckets = cfg.rel_buckets
        self.max_distance = cfg.rel_max_distance
        rows = self.TABLE_FACTOR[mode] * cfg.rel_buckets
        self.table = param(
            init, (rows, cfg.n_heads), ("relpos_buckets", "heads"), rows**-0.5, cfg.param_dtype
        )

    def __call__(self, q_index_L: jax.Array, k_index_S: jax.Array) -> jax.Array:
        """[H, L, S] float32 bias from sequence indices, shared by every batch row.

        Positions restart at 0 in each packed segment and run contiguously, so within a
        segment `key position - query position` equals the index offset; pairs across
        segments are masked. The bias is therefore computed once from indices (e.g.
        `arange(L)`; a decoding step passes its own index), not per row. Positions that are
        not contiguous within a segment are not seen here (see README, models)."""
        rel_LS = k_index_S[None, :] - q_index_L[:, None]
        kw = {"n_buckets": self.n_buckets, "max_distance": self.max_distance}
        if self.mode == "bidirectional":
            bucket_LS = relative_bucket(rel_LS, bidirectional=True, **kw)
        else:
            bucket_LS = relative_bucket(rel_LS, bidirectional=False, **kw)
            if self.mode == "prefix":
                future_LS = self.n_buckets + relative_bucket(-rel_LS, bidirectional=False, **kw)
                bucket_LS = jnp.where(rel_LS > 0, future_LS, bucket_LS)
        # The table is tiny: replicate it; the [H, L, S] result is split over heads like the
        # attention logits it is added to.
        table_NH = constrain(self.table[...].astype(jnp.float32), (None, None))
        bias_LSH = jnp.take(table_NH, bucket_LS, axis=0)
        return constrain(jnp.transpose(bias_LSH, (2, 0, 1)), ("heads", None, None))
