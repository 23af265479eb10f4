"""Attention rank and representation collapse of a trained model (the "why decoder-only"
argument).

The argument: a causal attention matrix is lower-triangular with a strictly positive diagonal
(every query sees itself and softmax weights are positive), so it always has full rank, while
a bidirectional one is a dense row-stochastic matrix that can lose rank (the low-rank
bottleneck of softmax(QK^T) when the length exceeds the head width). These measures
quantify that, and whether token representations collapse onto each other with depth, on any run.

Per example, the measures look at one packed segment (the longest; real positions only): the
[n, n] self-attention matrix of each stack/layer/head, and the [n, D] residual-stream states.

- numerical rank: singular values above `rtol * s_max`; by default `rtol = n * eps(float32)`
  (NumPy's `matrix_rank` rule for float32 data, the precision the probabilities come in).
- numerical rank at stated tolerances (`TOLERANCES`): the same count at rtol 1e-5 and 1e-2, so
  a reader can tell a conditioning cut-off from a rank that is really lower.
- stable rank: ||A||_F^2 / ||A||_2^2, a continuous lower bound of the rank that does not depend
  on a tolerance.
- effective rank (Roy & Vetterli 2007): exp of the entropy of the singular values normalised
  to sum to 1; between 1 and the rank, smooth where the numerical rank jumps.
- full rank: numerical rank == n. "attn_rank_frac_full" is the fraction of (layer, head,
  example) matrices at full rank, i.e. the fraction of heads at full rank, averaged over
  examples.
- exactly full rank: "attn_triangular_full" is the fraction of matrices that are exactly
  lower-triangular with a strictly positive diagonal, hence nonsingular in exact arithmetic
  (determinant = product of the diagonal). Causal attention always is; yet its numerical
  rank can be lower, because triangular matrices can be extremely ill-conditioned:
  "attn_log10_cond" reports log10(s_max / s_min) (capped at 300).
- future mass: the probability mass a query puts on later keys (0 for causal attention).
- entropy: the mean over rows of each row's entropy (nats). How diffuse attention is moves
  its rank as much as the mask does (soft rows average many keys: low rank; sharp rows pick
  one key each: high rank), so every rank figure is read beside it, and `random_qk_eff_rank`
  gives the effective rank random queries and keys reach at the same entropy.
- hidden_cos: mean cosine similarity over pairs of distinct tokens (1 = fully collapsed).
- hidden_eff_rank: effective rank of the [n, D] states (uncentred).

Keys are flat: "<stack>/<metric>" averaged over layers and heads, "<stack>/layer<i>/<metric>"
per layer, "<stack>/layer<i>/head<h>/<metric>" per head; hidden metrics of "layer<i>" are of the
states entering layer i, the stack-level ones of the final-normed output.
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from scalestudy.config.errors import ScalestudyError
from scalestudy.config.experiment import ExperimentConfig, ModelConfig

DEFAULT_EXAMPLES = 16
# Relative tolerances at which numerical rank is also counted (stated in the report): the
# default n * eps(float32) is a conditioning cut-off; these are looser ones.
TOLERANCES = {"1e-5": 1e-5, "1e-2": 1e-2}
ROWS_PER_CALL = 4  # rows per device call: bounds the [layers, B, H, L, L] probabilities in memory
F32_EPS = float(np.finfo(np.float32).eps)


class AttentionRankError(ScalestudyError):
    """The measures cannot run on this model, batch or run directory."""


# ----------------------------------------------------------------------------- matrix measures


def singular_values(m: np.ndarray) -> np.ndarray:
    """Singular values (descending) of each matrix in `m` [..., n, k], computed in float64."""
    return np.linalg.svd(np.asarray(m, np.float64), compute_uv=False)


def numerical_rank(s: np.ndarray, rtol: float | None = None) -> np.ndarray:
    """Number of singular values above `rtol * s_max` per matrix, from its singular values
    `s` [..., r] (default rtol: r * float32 eps; r = n for an [n, n] attention matrix)."""
    s = np.asarray(s, np.float64)
    if rtol is None:
        rtol = s.shape[-1] * F32_EPS
    return (s > rtol * s[..., :1]).sum(axis=-1)


def effective_rank(s: np.ndarray) -> np.ndarray:
    """exp(entropy of s / sum(s)) per matrix, from singular values `s` [..., r]
    (Roy & Vetterli 2007); 0 for a zero matrix."""
    s = np.asarray(s, np.float64)
    total = s.sum(axis=-1, keepdims=True)
    p = np.divide(s, total, out=np.zeros_like(s), where=total > 0)
    plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    return np.where(total[..., 0] > 0, np.exp(-plogp.sum(axis=-1)), 0.0)


def mean_pairwise_cosine(x_NLD: np.ndarray) -> np.ndarray:
    """Mean cosine similarity over pairs of distinct rows, per leading index [N]."""
    x = np.asarray(x_NLD, np.float64)
    n = x.shape[-2]
    if n < 2:
        raise AttentionRankError(f"pairwise cosine needs at least 2 tokens, got {n}")
    unit = x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-30)
    gram_NLL = unit @ np.swapaxes(unit, -1, -2)
    off_diagonal = gram_NLL.sum(axis=(-1, -2)) - np.trace(gram_NLL, axis1=-2, axis2=-1)
    return off_diagonal / (n * (n - 1))


def longest_segment(segment_ids_L: np.ndarray) -> np.ndarray:
    """Positions of the longest non-padding segment of one row (the first on ties)."""
    segment_ids_L = np.asarray(segment_ids_L)
    ids, counts = np.unique(segment_ids_L[segment_ids_L > 0], return_counts=True)
    if ids.size == 0:
        return np.zeros(0, np.int64)
    return np.flatnonzero(segment_ids_L == ids[np.argmax(counts)])


# ----------------------------------------------------------------------------- accumulation


def stable_rank(s: np.ndarray) -> np.ndarray:
    """||A||_F^2 / ||A||_2^2 per matrix, from its singular values `s` [..., r]; 0 for a zero
    matrix."""
    s = np.asarray(s, np.float64)
    top = s[..., 0] ** 2
    return np.divide((s**2).sum(axis=-1), top, out=np.zeros_like(top), where=top > 0)


def row_entropy(attention_NHLL: np.ndarray) -> np.ndarray:
    """Mean over rows of each attention row's entropy in nats, per matrix [...]."""
    p = np.asarray(attention_NHLL, np.float64)
    return -(p * np.log(np.where(p > 0, p, 1.0))).sum(-1).mean(-1)


def random_qk_eff_rank(
    n: int, d_kv: int, entropy: float, causal: bool, draws: int = 8, seed: int = 0
) -> float:
    """Effective rank / n of softmax(c Q K^T) for random Gaussian Q, K [n, d_kv] (causal:
    lower-triangular), with the temperature c set by bisection so that the mean row entropy
    is `entropy` (clamped to what the mask allows): the rank a matrix of that shape and that
    diffuseness has with no training at all."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, draws, n, d_kv))
    logits = q @ np.swapaxes(k, -1, -2) / np.sqrt(d_kv)
    visible = np.tril(np.ones((n, n), bool)) if causal else np.ones((n, n), bool)

    def probs(log_c: float) -> np.ndarray:
        z = np.where(visible, np.exp(log_c) * logits, -np.inf)
        z = np.exp(z - z.max(-1, keepdims=True))
        return z / z.sum(-1, keepdims=True)

    lo, hi = -8.0, 8.0  # log temperature: entropy falls as it rises
    for _ in range(50):
        mid = (lo + hi) / 2
        if row_entropy(probs(mid)).mean() > entropy:
            lo = mid
        else:
            hi = mid
    return float(effective_rank(singular_values(probs((lo + hi) / 2))).mean() / n)


def _example(attention_NHLL: np.ndarray, hidden_NLD: np.ndarray, rtol: float | None) -> dict:
    """Measures of one example's segment (already cut to its n real positions)."""
    n = attention_NHLL.shape[-1]
    s_NHr = singular_values(attention_NHLL)
    rank_NH = numerical_rank(s_NHr, rtol)
    at_tolerance = {
        f"attn_full@{name}": (numerical_rank(s_NHr, tol) == n).astype(np.float64)
        for name, tol in TOLERANCES.items()
    }
    later_LL = np.triu(np.ones((n, n), bool), k=1)
    diagonal_NHL = np.diagonal(attention_NHLL, axis1=-2, axis2=-1)
    triangular_NH = ~np.any(attention_NHLL * later_LL != 0, axis=(-1, -2))
    cond_NH = s_NHr[..., 0] / np.maximum(s_NHr[..., -1], 1e-300 * s_NHr[..., 0])
    s_hidden = singular_values(hidden_NLD)
    return {
        "attn_rank": rank_NH,
        "attn_rank_rel": rank_NH / n,
        "attn_eff_rank": effective_rank(s_NHr),
        "attn_eff_rank_rel": effective_rank(s_NHr) / n,
        "attn_full": (rank_NH == n).astype(np.float64),
        **at_tolerance,
        "attn_stable_rank_rel": stable_rank(s_NHr) / n,
        "attn_triangular_full": (triangular_NH & np.all(diagonal_NHL > 0, axis=-1)) * 1.0,
        "attn_log10_cond": np.log10(cond_NH),
        "attn_future_mass": (attention_NHLL * later_LL).sum(-1).mean(-1),
        "attn_entropy": row_entropy(attention_NHLL),
        "hidden_cos": mean_pairwise_cosine(hidden_NLD),
        "hidden_eff_rank": effective_rank(s_hidden),
        "hidden_eff_rank_rel": effective_rank(s_hidden) / min(n, hidden_NLD.shape[-1]),
        "length": np.float64(n),
    }


def _summarise(stack: str, examples: list[dict]) -> dict[str, float]:
    """Flat keys for one stack from its per-example measures."""
    mean = {k: np.mean([e[k] for e in examples], axis=0) for k in examples[0]}
    out = {f"{stack}/n_examples": float(len(examples)), f"{stack}/length": float(mean["length"])}
    attn = (
        "attn_rank",
        "attn_rank_rel",
        "attn_eff_rank",
        "attn_eff_rank_rel",
        "attn_log10_cond",
        "attn_triangular_full",
        "attn_future_mass",
        "attn_stable_rank_rel",
        "attn_entropy",
        *(f"attn_full@{name}" for name in TOLERANCES),
    )
    for k in attn:
        out[f"{stack}/{k}"] = float(mean[k].mean())
    out[f"{stack}/attn_rank_frac_full"] = float(mean["attn_full"].mean())
    out[f"{stack}/hidden_cos"] = float(mean["hidden_cos"][-1])
    out[f"{stack}/hidden_eff_rank"] = float(mean["hidden_eff_rank"][-1])
    n_layers, n_heads = mean["attn_rank"].shape
    for i in range(n_layers):
        layer = f"{stack}/layer{i}"
        for k in attn:
            out[f"{layer}/{k}"] = float(mean[k][i].mean())
        out[f"{layer}/attn_rank_frac_full"] = float(mean["attn_full"][i].mean())
        out[f"{layer}/hidden_cos"] = float(mean["hidden_cos"][i])
        out[f"{layer}/hidden_eff_rank"] = float(mean["hidden_eff_rank"][i])
        for h in range(n_heads):
            out[f"{layer}/head{h}/attn_rank"] = float(mean["attn_rank"][i, h])
            out[f"{layer}/head{h}/attn_eff_rank"] = float(mean["attn_eff_rank"][i, h])
    return out


def measure_intermediates(
    intermediates: dict[str, dict[str, Any]], rtol: float | None = None
) -> dict[str, list[dict]]:
    """Per stack, the per-example measures of `Model.intermediates` output (rows whose
    longest segment has fewer than 2 real positions are skipped)."""
    per_stack: dict[str, list[dict]] = defaultdict(list)
    for stack, inter in intermediates.items():
        attention = np.asarray(inter["attention"])  # [N, B, H, L, L]
        hidden = np.asarray(inter["hidden"])  # [N + 1, B, L, D]
        segments = np.asarray(inter["segment_ids"])
        for b in range(segments.shape[0]):
            idx = longest_segment(segments[b])
            if idx.size < 2:
                continue
            a_NHLL = attention[:, b][:, :, idx][:, :, :, idx]
            per_stack[stack].append(_example(a_NHLL, hidden[:, b][:, idx], rtol))
    return per_stack


# ----------------------------------------------------------------------------- entry points


def jit_intermediates(model: Any) -> Callable:
    """`jax.jit(model.intermediates)`, shared by models of equal config (a model is a pure
    function of its config), so repeated measurements compile once."""
    return _jit_intermediates(model.cfg)


@functools.lru_cache(maxsize=4)
def _jit_intermediates(cfg: ModelConfig) -> Callable:
    from scalestudy.models.api import build_model

    return jax.jit(build_model(cfg).intermediates)


def measure_params(
    cfg: ExperimentConfig,
    model: Any,
    params: Any,
    batch: dict[str, np.ndarray],
    *,
    rtol: float | None = None,
) -> dict[str, float]:
    """Attention-rank and collapse measures of `params` on `batch` (flat keys, see module doc).

    `model` is `models.api.build_model(cfg.model)`; rows are processed `ROWS_PER_CALL` at a
    time so the attention probabilities of a large model fit in memory.
    """
    if model.cfg != cfg.model:
        raise AttentionRankError(
            "measure_params: `model` was not built from `cfg.model`; pass both of one run"
        )
    intermediates = jit_intermediates(model)
    rows = len(next(iter(batch.values())))
    per_stack: dict[str, list[dict]] = defaultdict(list)
    for start in range(0, rows, ROWS_PER_CALL):
        chunk = {k: np.asarray(v)[start : start + ROWS_PER_CALL] for k, v in batch.items()}
        inter = jax.device_get(intermediates(params, chunk))
        for stack, examples in measure_intermediates(inter, rtol).items():
            per_stack[stack].extend(examples)
    if not per_stack:
        raise AttentionRankError(
            f"no row of the batch ({rows} rows) has a segment with at least 2 real positions"
        )
    out: dict[str, float] = {}
    for stack in sorted(per_stack):
        out.update(_summarise(stack, per_stack[stack]))
    return out


def measure_run(
    workdir: Path,
    step: int | None = None,
    n_examples: int = DEFAULT_EXAMPLES,
    out: str | Path | None = None,
) -> dict[str, float]:
    """Measures of a run's checkpoint (default: the latest) on `n_examples` validation rows;
    also written to `<workdir>/attention_rank.json` (or to the JSON file `out`)."""
    from scalestudy.data.pipeline import make_iterator
    from scalestudy.models.api import build_model
    from scalestudy.train.rundir import layout as rundir
    from scalestudy.train.rundir.saved_run import restore_params

    if n_examples < 1:
        raise AttentionRankError(f"n_examples must be >= 1, got {n_examples}")
    workdir = Path(workdir)
    cfg, params, step = restore_params(workdir, step)
    iterator = make_iterator(cfg, "validation")
    batches, rows = [], 0
    while rows < n_examples:
        batches.append(next(iterator))
        rows += len(batches[-1]["decoder_input_tokens"])
    batch = {k: np.concatenate([b[k] for b in batches])[:n_examples] for k in batches[0]}
    results = {"step": step, **measure_params(cfg, build_model(cfg.model), params, batch)}
    text = json.dumps(results, indent=1, sort_keys=True) + "\n"
    rundir.record_results(
        workdir,
        results,
        lambda: rundir.write_atomic(rundir.attention_rank_path(workdir), text),
        out,
    )
    return results
