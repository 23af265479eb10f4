"""Exact parameter counts and model FLOPs from the config alone (no weights).

Conventions:
- "embedding" parameters are the vocabulary-sized matrices: the input embedding and, when
  untied, the output projection. Everything else (including relative-position tables and
  norms) is "non-embedding".
- FLOPs count every matmul as 2 * m * n * k: the q/k/v/o projections, attention scores
  (QK^T) and values (PV), the feed-forward, and the output logits; encoder-decoders count both
  stacks and the cross-attention (whose key/value projections run over the encoder length).
  Norms, softmax, activations and the position bias are not counted (they are O(L * D) or
  O(L^2 * H), small next to the matmuls). Training = forward + backward = 3 * forward.
- Causal self-attention scores and values are counted in full (what the dense kernels
  compute) unless `model.halve_causal_attention_flops`: then the causal region is counted at
  half (the non-causal decoder's bidirectional prefix stays full).
- `flops_per_token_6n` is Kaplan's 6 * N with N the non-embedding parameters, per position
  (with mixture-of-experts layers, the active ones).
- Mixture-of-experts layers (`model.moe`) count their parameters in full ("total": every
  expert, the router and its balancing bias) and as used by one token ("active": the router,
  the bias, the shared experts and top_k routed experts). Their FLOPs per token are the
  router's (2 * D * E) and those of the shared and the top_k routed experts: what dropless
  dispatch computes, and what capacity dispatch computes at capacity factor 1 (its slots past
  the assignments, padding, are not counted).
"""

from __future__ import annotations

from typing import Any

from scalestudy.config.experiment import ExperimentConfig, ModelConfig
from scalestudy.data.objectives import feature_lengths
from scalestudy.models.masks import decoder_mode


def _attention_params(cfg: ModelConfig) -> int:
    # q, k, v [D,H,K] and o [H,K,D]; with qk_norm, the query and key scales [K]
    return 4 * cfg.d_model * cfg.n_heads * cfg.head_dim + 2 * cfg.head_dim * cfg.qk_norm


def _mlp_params(cfg: ModelConfig) -> int:
    n_in = 2 if cfg.activation.startswith("gated_") else 1
    return (n_in + 1) * cfg.d_model * cfg.d_ff


def _expert_params(cfg: ModelConfig) -> int:
    """One expert's parameters (routed or shared)."""
    n_in = 2 if cfg.activation.startswith("gated_") else 1
    return (n_in + 1) * cfg.d_model * cfg.moe.width(cfg.d_ff)


def _moe_params(cfg: ModelConfig, active: bool) -> int:
    """One MoE layer's feed-forward parameters: all, or those one token uses (`active`)."""
    m = cfg.moe
    router = cfg.d_model * m.routed_experts + m.routed_experts * (m.router == "deepseek")
    experts = m.shared_experts + (m.top_k if active else m.routed_experts)
    return router + experts * _expert_params(cfg)


def _ffn_params(cfg: ModelConfig, stack: str, depth: int, active: bool = False) -> int:
    """The feed-forward parameters of a stack of `depth` layers (dense and MoE)."""
    n_moe = len(cfg.moe.layers(stack, depth))
    return (depth - n_moe) * _mlp_params(cfg) + n_moe * _moe_params(cfg, active)


def _ffn_flops(cfg: ModelConfig, stack: str, depth: int) -> float:
    """Forward feed-forward matmul FLOPs per position of a stack of `depth` layers."""
    n_in = 2 if cfg.activation.startswith("gated_") else 1
    n_moe = len(cfg.moe.layers(stack, depth))
    dense = 2.0 * (n_in + 1) * cfg.d_model * cfg.d_ff
    m = cfg.moe
    moe = 2.0 * cfg.d_model * m.routed_experts  # the router
    moe += 2.0 * (m.shared_experts + m.top_k) * _expert_params(cfg)
    return (depth - n_moe) * dense + n_moe * moe


def _relpos_params(cfg: ModelConfig, mode: str) -> int:
    if cfg.position != "relative_bias":
        return 0
    factor = 2 if mode == "prefix" else 1  # see layers.RelativePositionBias
    return factor * cfg.rel_buckets * cfg.n_heads


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Exact parameter counts: total, embedding (vocab-sized matrices) and non-embedding, and
    the active ones (those one token uses: less than total only with MoE layers)."""
    d = cfg.d_model
    embedding = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    attn = _attention_params(cfg)
    n, enc = cfg.n_layers, cfg.encoder_layers
    if cfg.is_encoder_decoder:
        encoder = enc * (attn + 2 * d) + d + _relpos_params(cfg, "bidirectional")
        decoder = n * (2 * attn + 3 * d) + d + _relpos_params(cfg, "causal")
        stacks = encoder + decoder
        ffn = [("encoder", enc), ("decoder", n)]
    else:
        stacks = n * (attn + 2 * d) + d + _relpos_params(cfg, decoder_mode(cfg))
        ffn = [("decoder", n)]
    total = stacks + sum(_ffn_params(cfg, name, depth) for name, depth in ffn)
    active = stacks + sum(_ffn_params(cfg, name, depth, True) for name, depth in ffn)
    return {
        "total": embedding + total,
        "embedding": embedding,
        "non_embedding": total,
        "active": embedding + active,
        "active_non_embedding": active,
    }


def _self_attention_pairs(length: int, prefix: int, causal: bool, halve: bool) -> float:
    """Query-key pairs counted for one self-attention layer of `length` positions."""
    if not causal or not halve:
        return float(length * length)
    # Bidirectional prefix block in full, the causal remainder at half.
    return prefix * prefix + (length * length - prefix * prefix) / 2


def forward_flops(cfg: ModelConfig, decoder_length: int, encoder_length: int = 0, prefix: int = 0):
    """Forward matmul FLOPs of one example (decoder `decoder_length` positions, encoder
    `encoder_length`, bidirectional decoder prefix `prefix` for the non-causal decoder)."""
    d, hk = cfg.d_model, cfg.n_heads * cfg.head_dim
    halve = cfg.halve_causal_attention_flops

    def self_attention(n: int, pairs: float) -> float:
        return 2.0 * n * d * hk * 4 + 2.0 * 2 * hk * pairs  # projections; scores + values

    length = decoder_length
    dec_prefix = prefix if cfg.arch == "noncausal_decoder" else 0
    pairs = _self_attention_pairs(length, dec_prefix, True, halve)
    total = cfg.n_layers * self_attention(length, pairs) + 2.0 * length * d * cfg.vocab_size
    total += length * _ffn_flops(cfg, "decoder", cfg.n_layers)
    if cfg.is_encoder_decoder:
        s = encoder_length
        total += s * _ffn_flops(cfg, "encoder", cfg.encoder_layers)
        enc_layer = self_attention(s, float(s * s))
        # q and o over decoder positions, k and v over encoder positions, L x S scores/values.
        cross = 2.0 * length * d * hk * 2 + 2.0 * s * d * hk * 2 + 2.0 * 2 * hk * length * s
        total += cfg.encoder_layers * enc_layer + cfg.n_layers * cross
    return total


def decode_flops(cfg: ModelConfig, new: int, context: int, encoder: int = 0) -> float:
    """Forward matmul FLOPs needed to run `new` decoder positions against `context` cached
    ones (keys: context + new, in full), cross-attending to `encoder` encoder positions whose
    keys and values are cached, with logits at one position (the next token)."""
    d, hk = cfg.d_model, cfg.n_heads * cfg.head_dim
    layer = 2.0 * new * d * hk * 4 + 2.0 * 2 * hk * new * (context + new)
    if encoder:
        layer += 2.0 * new * d * hk * 2 + 2.0 * 2 * hk * new * encoder
    ffn = new * _ffn_flops(cfg, "decoder", cfg.n_layers)
    return cfg.n_layers * layer + ffn + 2.0 * d * cfg.vocab_size


def encoding_flops(cfg: ModelConfig, length: int) -> float:
    """Forward matmul FLOPs of encoding `length` positions (bidirectionally) and projecting
    them to every decoder layer's cross-attention keys and values."""
    d, hk = cfg.d_model, cfg.n_heads * cfg.head_dim
    layer = 2.0 * length * d * hk * 4 + 2.0 * 2 * hk * length * length
    ffn = length * _ffn_flops(cfg, "encoder", cfg.encoder_layers)
    return cfg.encoder_layers * layer + ffn + cfg.n_layers * 2.0 * length * d * hk * 2


def prompt_flops(cfg: ModelConfig, length: int) -> float:
    """Forward FLOPs of reading a `length`-token prompt from scratch up to the first next-token
    logits (`Model.prefill`): decoder-only models read `0, prompt`; the encoder-decoder
    encodes the prompt and runs its decoder on `0`."""
    if cfg.is_encoder_decoder:
        return encoding_flops(cfg, length) + decode_flops(cfg, 1, 0, length)
    return decode_flops(cfg, length + 1, 0)


def reply_step_flops(cfg: ModelConfig, length: int, step: int) -> float:
    """Forward FLOPs of decoding reply token `step + 1` (step 0, 1, ...) after a
    `length`-token prompt read by `Model.prefill` (keys and values cached)."""
    if cfg.is_encoder_decoder:
        return decode_flops(cfg, 1, 1 + step, length)
    return decode_flops(cfg, 1, length + 1 + step)


def flops(cfg: ExperimentConfig) -> dict[str, Any]:
    """Training FLOPs (forward + backward) per example and per position for `cfg`'s lengths."""
    m, obj = cfg.model, cfg.objective
    if m.is_encoder_decoder:
        (enc_len, dec_len), prefix = feature_lengths(obj, encoder_decoder=True), 0
    else:
        dec_len, enc_len = obj.decoder_length, 0
        prefix = obj.inputs_length if obj.name != "flm" else 0
    forward = forward_flops(m, dec_len, enc_len, prefix)
    positions = dec_len + enc_len
    per_example = 3.0 * forward
    return {
        "flops_per_example": per_example,
        "forward_flops_per_example": forward,
        "positions_per_example": positions,
        "flops_per_token": per_example / positions,
        "flops_per_token_6n": 6.0 * count_params(m)["active_non_embedding"],
        "causal_attention_halved": m.halve_causal_attention_flops,
    }


def _shapes(cfg: ModelConfig) -> dict[str, str]:
    """'path/to/param' -> 'shape  (logical axes)' from abstract evaluation."""
    import jax

    from scalestudy.models.api import build_model

    model = build_model(cfg)
    abstract = model.abstract_params()
    flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
    axes = jax.tree.leaves(model.param_axes(), is_leaf=lambda x: isinstance(x, tuple))
    out = {}
    for (path, leaf), names in zip(flat, axes, strict=True):
        key = "/".join(str(getattr(p, "key", p)) for p in path)
        out[key] = f"{tuple(leaf.shape)} {names}"
    counted = sum(int(_prod(leaf.shape)) for _, leaf in flat)
    if counted != count_params(cfg)["total"]:
        raise AssertionError(f"count_params disagrees with the model ({counted} parameters)")
    return out


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def describe(cfg: ExperimentConfig) -> dict[str, Any]:
    """Counts, FLOPs and parameter shapes of `cfg`'s model (what `scalestudy describe` shows)."""
    m = cfg.model
    counts = count_params(m)
    f = flops(cfg)
    active = {}
    if m.moe.enabled:
        active = {
            "params_active": counts["active"],
            "params_active_non_embedding": counts["active_non_embedding"],
        }
    return {
        "arch": m.arch,
        "objective": cfg.objective.name,
        "params_total": counts["total"],
        "params_embedding": counts["embedding"],
        "params_non_embedding": counts["non_embedding"],
        **active,
        "flops_per_token_6n": f["flops_per_token_6n"],
        "flops_per_token": f["flops_per_token"],
        "flops_per_example": f["flops_per_example"],
        "positions_per_example": f["positions_per_example"],
        "causal_attention_halved": f["causal_attention_halved"],
        "shapes": _shapes(m),
    }
