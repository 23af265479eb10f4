"""Resampling runs and summarising bootstrap samples as intervals."""

from __future__ import annotations

import numpy as np


def run_counts(n_runs: int, resamples: int, seed: int) -> np.ndarray:
    """Multiplicities [R, J] of J runs in R bootstrap resamples (runs drawn with replacement)."""
    rng = np.random.default_rng(seed)
    if resamples <= 0:
        return np.zeros((0, n_runs))
    return rng.multinomial(n_runs, np.full(n_runs, 1.0 / n_runs), size=resamples).astype(float)


def interval(samples: np.ndarray, ci: float) -> tuple[list[float] | None, int]:
    """Percentile interval of the finite samples and how many samples were not finite."""
    s = np.asarray(samples, dtype=np.float64)
    ok = np.isfinite(s)
    if ok.sum() < 2:
        return None, int((~ok).sum())
    lo, hi = np.percentile(s[ok], [50.0 * (1.0 - ci), 50.0 * (1.0 + ci)])
    return [float(lo), float(hi)], int((~ok).sum())


def summarise(point: dict[str, float], samples: dict[str, np.ndarray], ci: float) -> dict:
    """{name: {"value", "ci"}} for every named quantity; 'ci' is null without resamples."""
    out = {}
    for name, value in point.items():
        entry = {"value": _clean(value)}
        if name in samples and len(samples[name]):
            entry["ci"], bad = interval(samples[name], ci)
            if bad:
                entry["ci_failed_resamples"] = bad
        else:
            entry["ci"] = None
        out[name] = entry
    return out


def _clean(v) -> float | None:
    v = float(v)
    return v if np.isfinite(v) else None
