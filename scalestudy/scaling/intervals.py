"""Intervals for verdicts between runs: paired seeds, examples x seeds, many comparisons.

The unit of replication of a training run is its seed (initialisation and data order);
every seed of a study scores the same evaluation examples. So:

- Two variants trained with the same seeds are compared on their per-seed differences (a
  paired t interval), which removes what the seed does to both; for accuracies the examples'
  variance is added (`accuracy_difference`).
- An accuracy averaged over seeds and examples varies with both: `two_way_bootstrap`
  resamples seeds and examples independently (the crossed design's two sources), and
  `accuracy_interval` is the closed form from per-seed accuracies alone (what a registry
  holds): var = s^2_seeds / S + p (1 - p) / E, with a t quantile on S - 1 degrees of
  freedom; the examples are shared, so their term does not shrink with more seeds, and
  p (1 - p) also holds the per-answer noise already in s^2_seeds, so it is conservative.
- With one seed there is no between-run interval; what is left is an interval over
  examples (or heads, layers), which says nothing about another training run.
- Many verdicts at once are held to a family-wise error rate by Holm's step-down method.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats


@dataclass(frozen=True)
class Interval:
    """An estimate with its interval: `between_runs` is False when the interval comes from
    examples alone (one seed), which says nothing about retraining."""

    mean: float
    low: float
    high: float
    p_value: float  # two-sided, against 0 (for differences)
    seeds: int
    examples: int | None = None
    between_runs: bool = True

    def describe(self, digits: int = 3) -> str:
        """`mean [low, high] (n = S seeds x E examples)`."""
        n = f"{self.seeds} seed{'s' if self.seeds != 1 else ''}"
        if self.examples:
            n += f" x {self.examples} examples"
        return f"{span(self.mean, self.low, self.high, digits)} (n = {n})"

    def text(self, digits: int = 3, scale: float = 1.0) -> str:
        """`mean [low, high]` (times `scale`), marked when the interval is over examples only."""
        got = span(scale * self.mean, scale * self.low, scale * self.high, digits)
        return got + ("" if self.between_runs else " (examples only)")


def span(mean: float, low: float, high: float, digits: int = 3) -> str:
    """`+mean [+low, +high]`: how every report writes an estimate with its interval."""
    return f"{mean:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]"


def _t(level: float, df: float) -> float:
    return float(stats.t.ppf(0.5 + level / 2, df)) if df > 0 else math.inf


def _from_se(mean: float, se: float, df: float, level: float, **n: int | bool | None) -> Interval:
    half = _t(level, df) * se
    if se > 0 and df > 0:
        p = float(2 * stats.t.sf(abs(mean) / se, df))
    else:
        p = 1.0 if mean == 0 else 0.0
    return Interval(mean, mean - half, mean + half, p, **n)


def paired_difference(
    a: Mapping[int, float], b: Mapping[int, float], level: float = 0.95
) -> tuple[Interval, list[int]]:
    """Interval on mean(a[s] - b[s]) over the seeds both have; returns it and the seeds that
    only one side has (left out: they have no partner)."""
    common = sorted(set(a) & set(b))
    unpaired = sorted(set(a) ^ set(b))
    if not common:
        raise ValueError("no seed is shared by the two sides; a paired comparison needs one")
    d = np.array([a[s] - b[s] for s in common], dtype=float)
    se = float(d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else 0.0
    return _from_se(float(d.mean()), se, d.size - 1, level, seeds=d.size), unpaired


def accuracy_interval(per_seed: Sequence[float], examples: int, level: float = 0.95) -> Interval:
    """Mean accuracy over seeds that all scored the same `examples` examples, with both
    sources of variance: between seeds (s^2 / S) and between examples (p (1 - p) / E).
    With one seed the interval is over examples only (`between_runs` False)."""
    acc = np.asarray(per_seed, dtype=float)
    mean = float(acc.mean())
    var = max(mean * (1 - mean), 0.0) / max(examples, 1)
    if acc.size == 1:
        se = math.sqrt(var)
        half = float(stats.norm.ppf(0.5 + level / 2)) * se
        return Interval(mean, mean - half, mean + half, 1.0, 1, examples, between_runs=False)
    var += float(acc.var(ddof=1)) / acc.size
    return _from_se(mean, math.sqrt(var), acc.size - 1, level, seeds=acc.size, examples=examples)


def accuracy_difference(
    a: Mapping[int, float], b: Mapping[int, float], examples: int, level: float = 0.95
) -> tuple[Interval, list[int]]:
    """Paired difference of accuracies (same seeds, same `examples` examples) with both
    sources of variance: between seeds (the per-seed differences' spread / S) and between
    examples ((p_a (1 - p_a) + p_b (1 - p_b)) / E, conservative: the two models' answers to
    one example are treated as independent, per-example scores not being at hand), with
    Satterthwaite's degrees of freedom. With one shared seed: examples only, not a between-run
    interval."""
    got, unpaired = paired_difference(a, b, level)
    common = sorted(set(a) & set(b))
    E = max(examples, 1)
    v_examples = sum(a[s] * (1 - a[s]) + b[s] * (1 - b[s]) for s in common) / len(common) / E
    if got.seeds == 1:
        se = math.sqrt(max(v_examples, 0.0))
        p = float(2 * stats.norm.sf(abs(got.mean) / se)) if se > 0 else 1.0
        half = float(stats.norm.ppf(0.5 + level / 2)) * se
        one = Interval(got.mean, got.mean - half, got.mean + half, p, 1, examples, False)
        return one, unpaired
    d = np.array([a[s] - b[s] for s in common], dtype=float)
    v_seeds = float(d.var(ddof=1)) / d.size
    denom = v_seeds**2 / (d.size - 1) + v_examples**2 / max(E - 1, 1)
    df = (v_seeds + v_examples) ** 2 / denom if denom > 0 else d.size - 1
    se = math.sqrt(v_seeds + v_examples)
    return _from_se(got.mean, se, df, level, seeds=d.size, examples=examples), unpaired


def two_way_bootstrap(
    correct_SE: np.ndarray, n_boot: int = 1000, level: float = 0.95, seed: int = 0
) -> Interval:
    """Mean of a seeds x examples score matrix (e.g. 0/1 correct) with an interval that
    resamples seeds and examples independently; the bootstrap standard error is used with a
    t quantile (Satterthwaite's degrees of freedom). One seed: examples only."""
    x = np.asarray(correct_SE, dtype=float)
    S, E = x.shape
    rng = np.random.default_rng(seed)
    w_seeds = (
        rng.multinomial(S, np.full(S, 1.0 / S), size=n_boot) if S > 1 else np.ones((n_boot, 1))
    )
    w_examples = rng.multinomial(E, np.full(E, 1.0 / E), size=n_boot)
    means = np.einsum("bs,se,be->b", w_seeds, x, w_examples) / (S * E)
    se = float(means.std(ddof=1))
    mean = float(x.mean())
    if S == 1:
        half = float(stats.norm.ppf(0.5 + level / 2)) * se
        return Interval(mean, mean - half, mean + half, 1.0, 1, E, between_runs=False)
    # Satterthwaite's degrees of freedom for the two variance components: few seeds give
    # few degrees of freedom only when the seed component matters.
    v_seeds = float(x.mean(axis=1).var(ddof=1)) / S
    v_examples = float(x.mean(axis=0).var(ddof=1)) / E
    denom = v_seeds**2 / (S - 1) + v_examples**2 / (E - 1)
    df = (v_seeds + v_examples) ** 2 / denom if denom > 0 else S - 1
    return _from_se(mean, se, df, level, seeds=S, examples=E)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error control), in the input order."""
    p = np.asarray(p_values, dtype=float)
    m = p.size
    order = np.argsort(p)
    adjusted = np.empty(m)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adjusted[i] = running
    return adjusted.tolist()
