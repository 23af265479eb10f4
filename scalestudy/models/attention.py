"""The attention core: (q, k, v, mask structure, shared bias) -> output, with backends.

Shape letters as in `layers.py`. One entry point, `attend`, with the backend chosen by
`model.attention_impl`:

- "xla": the reference einsum path (float32 [B, H, L, S] logits, bias added, masked, softmax).
  Accepts every mask and bias, attention dropout and returning the probabilities. Causal
  self-attention (no prefix) of two blocks or more (blocks of 256 query rows; 32 on a CPU,
  `CAUSAL_BLOCK_ROWS`) runs block by block: query block i
  attends to keys [0, (i + 1) * block) only, the same result as the full product (the keys
  skipped are masked there, weight exactly 0) from (n + 1) / 2n of its logits for n blocks.
  `model.attention_logits: compute` (the default) keeps the logits in the compute dtype until
  the softmax (as T5X's and MaxText's default `float32_logits=False` and nanodo do);
  "float32" accumulates and keeps them in float32, as cuDNN does.
- "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN flash attention on
  NVIDIA GPUs (bfloat16/float16). Causal structure uses cuDNN's causal mask; segments, the
  prefix and mixed heads go in as a boolean mask (which JAX turns into an additive bias); the
  relative-position bias is passed as one [1, H, L, S] tensor.
- "splash": the Pallas splash-attention kernel on TPU, with segment ids and a causal or full
  per-head mask. It takes no additive bias, no per-row prefix and no backward mask, so
  relative-bias, prefix-LM (non-causal decoder), mixed-head and mixed-layer encoder models
  are refused with a message.
- "auto": cuDNN on GPU and splash on TPU where the call is supported, otherwise the reference.

`emulate()` runs the GPU/TPU backends on any platform (cuDNN's call through
`jax.nn.dot_product_attention`'s XLA implementation, splash in Pallas interpret mode), so their
argument mapping is tested on CPU against the reference.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax.core import spmd as flax_spmd
from flax.linen import spmd as linen_spmd

from scalestudy.config.errors import ConfigError
from scalestudy.models.masks import MaskSpec, segments

NEG_INF = -1e10  # finite, so a fully masked (padding) row gives a uniform softmax, not NaN
IMPLS = ("auto", "xla", "cudnn", "splash")
# Query rows per block of the reference's causal path (0: no blocks), by platform. 32 on a
# CPU: a block's [B, H, 32, S] logits stay in cache where the full product's do not
# (docs/performance.md, "On a CPU the blocks are 32 query rows").
CAUSAL_BLOCK_ROWS = {"cpu": 32}
DEFAULT_CAUSAL_BLOCK_ROWS = 256
_CAUSAL_BLOCK: list[int | None] = [None]  # set by `causal_block`; None: by platform
_PLATFORM_OF = {"cudnn": "gpu", "splash": "tpu"}
_EMULATE = [False]


class AttentionError(ConfigError):
    """The attention backend asked for cannot run this call on this platform."""


@contextlib.contextmanager
def emulate(on: bool = True) -> Iterator[None]:
    """Run "cudnn" and "splash" on any platform (for tests on CPU); see the module doc."""
    before, _EMULATE[0] = _EMULATE[0], on
    try:
        yield
    finally:
        _EMULATE[0] = before


@contextlib.contextmanager
def causal_block(rows: int | None) -> Iterator[None]:
    """Query rows per block on the reference's causal path inside the block (0: one full
    product; None: the platform's), for benchmarks and tests; the result does not depend on
    it beyond float rounding."""
    before, _CAUSAL_BLOCK[0] = _CAUSAL_BLOCK[0], rows
    try:
        yield
    finally:
        _CAUSAL_BLOCK[0] = before


def causal_block_rows() -> int:
    """The query rows per block in force on the platform compiled for (part of a compiled
    program's identity)."""
    if _CAUSAL_BLOCK[0] is not None:
        return _CAUSAL_BLOCK[0]
    return CAUSAL_BLOCK_ROWS.get(platform(), DEFAULT_CAUSAL_BLOCK_ROWS)


def platform() -> str:
    """The platform being compiled for: the active mesh's devices, else the default backend
    (so ahead-of-time compiles against a TPU topology choose TPU backends)."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()


def dropout(x: jax.Array, rate: float, rng: jax.Array | None, deterministic: bool) -> jax.Array:
    """Inverted dropout; identity when deterministic or rate is 0."""
    if deterministic or rate == 0.0:
        return x
    if rng is None:
        raise ValueError("dropout > 0 with deterministic=False needs an rng")
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def _dense(mask: MaskSpec | jax.Array) -> jax.Array:
    return mask.dense() if isinstance(mask, MaskSpec) else mask


def reference(
    q_BLHK: jax.Array,
    k_BSHK: jax.Array,
    v_BSHK: jax.Array,
    mask: MaskSpec | jax.Array,
    bias_HLS: jax.Array | None = None,
    *,
    dropout_rate: float = 0.0,
    rng: jax.Array | None = None,
    deterministic: bool = True,
    return_probs: bool = False,
    logits: str = "compute",
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The reference path; with `return_probs`, also the float32 probabilities [B, H, L, S]
    after masking and softmax (before dropout). No 1/sqrt(K) scaling (T5). `logits`
    "compute" rounds the logits to the compute dtype before the float32 softmax."""
    # "compute": logits in the compute dtype halve their memory traffic, at bfloat16's 8-bit
    # mantissa (docs/performance.md#on-a-gpu); the softmax still runs in float32.
    wide = jnp.float32 if logits == "float32" else None
    logits_BHLS = jnp.einsum("BLHK,BSHK->BHLS", q_BLHK, k_BSHK, preferred_element_type=wide)
    logits_BHLS = logits_BHLS.astype(jnp.float32)
    if bias_HLS is not None:  # [H, L, S] (shared by the batch) or [B, H, L, S]
        if bias_HLS.ndim == 3 and platform() == "cpu":
            bias_HLS = broadcast_rows(bias_HLS, logits_BHLS.shape[0])
        logits_BHLS = logits_BHLS + bias_HLS
    logits_BHLS = jnp.where(_dense(mask), logits_BHLS, NEG_INF)
    probs_f32_BHLS = jax.nn.softmax(logits_BHLS, axis=-1)
    probs_BHLS = dropout(probs_f32_BHLS.astype(q_BLHK.dtype), dropout_rate, rng, deterministic)
    out_BLHK = jnp.einsum("BHLS,BSHK->BLHK", probs_BHLS, v_BSHK)
    return (out_BLHK, probs_f32_BHLS) if return_probs else out_BLHK


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def broadcast_rows(x: jax.Array, rows: int) -> jax.Array:
    """`x` broadcast to [rows, *x.shape]; its gradient sums the rows in up to 4 groups, then
    adds the groups (the same sum as over the rows at once)."""
    return jnp.broadcast_to(x, (rows, *x.shape))


def _broadcast_rows_fwd(x: jax.Array, rows: int) -> tuple[jax.Array, None]:
    return broadcast_rows(x, rows), None


def _broadcast_rows_bwd(rows: int, _: None, g: jax.Array) -> tuple[jax.Array]:
    # Sum over the second axis of [groups, rows / groups, ...]: XLA:CPU reduces over a leading
    # axis far slower, which cost the relative-position bias's gradient a large share of a
    # small model's step (docs/performance.md#small-models-on-cpu).
    groups = math.gcd(rows, 4)
    sums = jnp.sum(g.reshape(groups, rows // groups, *g.shape[1:]), axis=1)
    total = sums[0]
    for i in range(1, groups):
        total = total + sums[i]
    return (total,)


broadcast_rows.defvjp(_broadcast_rows_fwd, _broadcast_rows_bwd)


def blocks(q_BLHK: jax.Array, k_BSHK: jax.Array, mask: MaskSpec | jax.Array) -> int:
    """How many query blocks the reference's causal path splits this call into (0: none):
    causal self-attention without a prefix, over at least two whole blocks."""
    rows = causal_block_rows()
    q_len, k_len = q_BLHK.shape[1], k_BSHK.shape[1]
    plain = isinstance(mask, MaskSpec) and mask.causal and not mask.bidirectional
    if not (plain and rows and q_len == k_len and q_len % rows == 0 and q_len >= 2 * rows):
        return 0
    return q_len // rows


def causal_blocks(
    q_BLHK: jax.Array,
    k_BSHK: jax.Array,
    v_BSHK: jax.Array,
    mask: MaskSpec,
    bias_HLS: jax.Array | None,
    n: int,
    logits: str = "compute",
) -> jax.Array:
    """The reference for causal self-attention, one query block at a time over the keys at
    or below its diagonal block."""
    rows = q_BLHK.shape[1] // n
    outs = []
    for i in range(n):
        lo, hi = i * rows, (i + 1) * rows
        visible_QK = jnp.arange(hi)[None, :] <= lo + jnp.arange(rows)[:, None]
        mask_BHQK = visible_QK[None, None] & segments(
            mask.q_segment_BQ[:, lo:hi], mask.k_segment_BK[:, :hi]
        )
        bias = None if bias_HLS is None else bias_HLS[..., lo:hi, :hi]
        outs.append(
            reference(
                q_BLHK[:, lo:hi], k_BSHK[:, :hi], v_BSHK[:, :hi], mask_BHQK, bias, logits=logits
            )
        )
    return jnp.concatenate(outs, axis=1)


def cudnn(
    q_BLHK: jax.Array,
    k_BSHK: jax.Array,
    v_BSHK: jax.Array,
    mask: MaskSpec | jax.Array,
    bias_HLS: jax.Array | None = None,
) -> jax.Array:
    """`jax.nn.dot_product_attention` with cuDNN (its XLA implementation under `emulate`)."""
    is_causal = isinstance(mask, MaskSpec) and mask.causal and not mask.bidirectional
    # The causal part goes to the kernel's own mask; only the segments remain as a mask.
    if is_causal:
        mask_BHLS = segments(mask.q_segment_BQ, mask.k_segment_BK)
    else:
        mask_BHLS = _dense(mask)
    bias = None
    if bias_HLS is not None:
        bias = (bias_HLS[None] if bias_HLS.ndim == 3 else bias_HLS).astype(q_BLHK.dtype)
    return jax.nn.dot_product_attention(
        q_BLHK,
        k_BSHK,
        v_BSHK,
        bias,
        mask_BHLS,
        scale=1.0,
        is_causal=is_causal,
        implementation="xla" if _EMULATE[0] else "cudnn",
    )


def _block(n: int) -> int:
    return next(b for b in (512, 256, 128) if n % b == 0)


def _splash_local(q_BHLK, k_BHSK, v_BHSK, q_segment_BL, k_segment_BS, causal: bool):
    """Splash on one shard: per-head masks built for the local heads and lengths."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    heads, q_len, k_len = q_BHLK.shape[1], q_BHLK.shape[2], k_BHSK.shape[2]
    head_mask = sm.CausalMask((q_len, k_len)) if causal else sm.FullMask((q_len, k_len))
    bq, bk = _block(q_len), _block(k_len)
    sizes = sk.BlockSizes(
        block_q=bq,
        block_kv=bk,
        block_kv_compute=bk,
        block_q_dkv=bq,
        block_kv_dkv=bk,
        block_kv_dkv_compute=bk,
        block_q_dq=bq,
        block_kv_dq=bk,
    )
    kernel = sk.make_splash_mha(
        sm.MultiHeadMask([head_mask] * heads),
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=1,
        interpret=_EMULATE[0],
    )

    def one(q_HLK, k_HSK, v_HSK, q_seg_L, k_seg_S):
        return kernel(q_HLK, k_HSK, v_HSK, segment_ids=sk.SegmentIds(q_seg_L, k_seg_S))

    return jax.vmap(one)(q_BHLK, k_BHSK, v_BHSK, q_segment_BL, k_segment_BS)


def splash(q_BLHK: jax.Array, k_BSHK: jax.Array, v_BSHK: jax.Array, mask: MaskSpec) -> jax.Array:
    """The Pallas splash kernel (TPU; interpret mode under `emulate`), one call per batch row;
    under a mesh, run per shard (batch and heads split as the logical rules say).

    Padding (segment 0) queries attend to padding keys here, where the reference gives them a
    uniform row; their outputs carry no loss, so logits at real positions and gradients agree.
    """
    q_BHLK, k_BHSK, v_BHSK = (jnp.swapaxes(x, 1, 2) for x in (q_BLHK, k_BSHK, v_BSHK))
    segs = (mask.q_segment_BQ.astype(jnp.int32), mask.k_segment_BK.astype(jnp.int32))

    def local(q, k, v, qs, ks):
        return _splash_local(q, k, v, qs, ks, mask.causal)

    mesh, rules = jax.sharding.get_abstract_mesh(), flax_spmd.get_logical_axis_rules()
    if not mesh.empty and rules:
        spec_BHLK = linen_spmd.logical_to_mesh_axes(("batch", "heads", "length", "kv"), rules)
        spec_BL = linen_spmd.logical_to_mesh_axes(("batch", "length"), rules)
        local = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(spec_BHLK,) * 3 + (spec_BL,) * 2,
            out_specs=spec_BHLK,
            check_vma=False,
        )
    return jnp.swapaxes(local(q_BHLK, k_BHSK, v_BHSK, *segs), 1, 2)


def unsupported(
    backend: str,
    q_BLHK: jax.Array,
    k_BSHK: jax.Array,
    mask: MaskSpec | jax.Array,
    bias_HLS: jax.Array | None,
) -> str | None:
    """Why `backend` cannot run this call here (None when it can)."""
    if backend == "xla":
        return None
    where = platform()
    if not _EMULATE[0] and where != _PLATFORM_OF[backend]:
        return f"it needs a {_PLATFORM_OF[backend].upper()} and this run's platform is {where}"
    q_len, k_len, head_dim = q_BLHK.shape[1], k_BSHK.shape[1], q_BLHK.shape[-1]
    if backend == "cudnn":
        if not _EMULATE[0] and q_BLHK.dtype not in (jnp.bfloat16, jnp.float16):
            return f"cuDNN flash attention needs bfloat16 or float16 (got {q_BLHK.dtype})"
        if head_dim % 8 or head_dim > 256:
            return f"cuDNN needs a head width that is a multiple of 8 and <= 256 (got {head_dim})"
        if bias_HLS is not None and (q_len % 2 or k_len % 2):
            return f"cuDNN with a bias needs even lengths (got {q_len}, {k_len})"
        return None
    if bias_HLS is not None:
        return "splash takes no additive bias (model.position='relative_bias')"
    if not isinstance(mask, MaskSpec):
        return "splash needs the mask as structure (MaskSpec), not a dense array"
    if mask.prefix_BQ is not None:
        return "splash cannot express the per-row prefix-LM mask (arch noncausal_decoder)"
    if mask.mixed_heads:
        return "splash has no per-head mixed directions (model.attention='mixed')"
    if mask.direction == "backward":
        return "splash has no backward mask (model.attention='mixed_layers', odd layers)"
    if q_len % 128 or k_len % 128:
        return f"splash needs lengths that are multiples of 128 (got {q_len}, {k_len})"
    return None


def choose(
    impl: str,
    q_BLHK: jax.Array,
    k_BSHK: jax.Array,
    mask: MaskSpec | jax.Array,
    bias_HLS: jax.Array | None = None,
) -> str:
    """The backend that runs this call: `impl` itself (or AttentionError saying why it
    cannot), or for "auto" the platform's fused backend when it can, else "xla"."""
    if impl not in IMPLS:
        raise AttentionError(f"model.attention_impl={impl!r}; accepted: {', '.join(IMPLS)}")
    if impl == "auto":
        fused = {"gpu": "cudnn", "tpu": "splash"}.get(platform())
        if fused is None or unsupported(fused, q_BLHK, k_BSHK, mask, bias_HLS):
            return "xla"
        return fused
    why = unsupported(impl, q_BLHK, k_BSHK, mask, bias_HLS)
    if why:
        raise AttentionError(
            f"model.attention_impl={impl!r} cannot run this attention: {why}; use "
            "attention_impl 'auto' (falls back to the reference) or 'xla'"
        )
    return impl


def attend(
    q_BLHK: jax.Array,
    k_BSHK: jax.Array,
    v_BSHK: jax.Array,
    mask: MaskSpec | jax.Array,
    bias_HLS: jax.Array | None = None,
    *,
    impl: str = "auto",
    logits: str = "compute",
) -> jax.Array:
    """Attention output [B, L, H, K] (compute dtype), no logit scaling (T5 folds 1/sqrt(K)
    into the query). `mask` is a `MaskSpec` or a dense boolean [B, H or 1, L, S] (True =
    visible); `bias_HLS` an additive float bias [H, L, S] shared by the batch (or
    [B, H, L, S]). For dropout on the probabilities or the probabilities themselves, use
    `reference`. `logits` applies to the reference ("xla") path (see the module doc)."""
    backend = choose(impl, q_BLHK, k_BSHK, mask, bias_HLS)
    if backend == "cudnn":
        return cudnn(q_BLHK, k_BSHK, v_BSHK, mask, bias_HLS)
    if backend == "splash":
        return splash(q_BLHK, k_BSHK, v_BSHK, mask)
    n = blocks(q_BLHK, k_BSHK, mask)
    if n:
        return causal_blocks(q_BLHK, k_BSHK, v_BSHK, mask, bias_HLS, n, logits)
    return reference(q_BLHK, k_BSHK, v_BSHK, mask, bias_HLS, logits=logits)
