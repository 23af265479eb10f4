"""Intervals for verdicts between runs: the run is the unit, examples are nested in runs.

The unit of replication of a training run is its seed (initialisation and data order);
every run of a study scores the same evaluation examples, and a run's accuracy is its mean
over them. So a verdict is about retraining, on this evaluation set:

- `run_difference`: two variants are compared on one number per run. Runs with the same seed
  are paired (a t interval on the per-seed differences, n - 1 degrees of freedom), which
  removes what the seed does to both; with fewer than two shared seeds, Welch's interval on
  the run means (at most n_a + n_b - 2 degrees of freedom). The examples' binomial noise is
  already in each run's value, and it is shared by the runs (same items), so no examples
  term is added: the degrees of freedom never exceed what the runs give.
- `detectable` and `seeds_to_resolve`: the design's power, from the measured run spread.
- `simultaneous`: an interval widened to a family's Bonferroni level, so that one that
  excludes 0 always goes with a rejection by Holm's step-down method (`holm`).
- With one run per side there is no between-run interval; what is left is an interval over
  examples (or heads, layers), labelled so, which says nothing about another training run.
- `two_way_bootstrap` and `accuracy_interval` describe a mean over seeds x examples when
  the population of examples is the target (not a verdict's question).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy import optimize, stats


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
    se: float = 0.0  # of the mean, over runs
    df: float = 0.0  # of the t quantile: at most what the runs give
    method: str = "paired"  # "paired" by seed, "welch" on run means, or "examples"
    level: float = 0.95  # the interval's coverage (a family's Bonferroni level when widened)

    def describe(self, digits: int = 3) -> str:
        """`mean [low, high] (n = S seeds x E examples)`."""
        n = f"{self.seeds} seed{'s' if self.seeds != 1 else ''}"
        if self.method == "welch":
            n = f"{self.seeds}+ runs a side, unpaired (Welch)"
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


def _from_se(
    mean: float, se: float, df: float, level: float, **n: int | bool | str | None
) -> Interval:
    half = _t(level, df) * se
    if se > 0 and df > 0:
        p = float(2 * stats.t.sf(abs(mean) / se, df))
    else:
        p = 1.0 if mean == 0 else 0.0
    return Interval(mean, mean - half, mean + half, p, se=se, df=df, level=level, **n)


def simultaneous(iv: Interval, family: int, level: float = 0.95) -> Interval:
    """`iv` widened to Bonferroni's level 1 - (1 - level) / family: the family's intervals
    cover together with probability >= `level`, and one that excludes 0 has p < (1 - level)
    / family, which Holm's first step (and so every step) rejects."""
    if not iv.between_runs or iv.df <= 0:
        return iv
    wide = 1 - (1 - level) / max(family, 1)
    half = _t(wide, iv.df) * iv.se
    return replace(iv, low=iv.mean - half, high=iv.mean + half, level=wide)


def run_difference(
    a: Mapping[int, float], b: Mapping[int, float], level: float = 0.95, examples: int | None = None
) -> tuple[Interval, list[int]]:
    """mean(a) - mean(b) over runs (seed -> the run's value; for accuracy its mean over
    `examples` shared examples): paired by seed over the seeds both sides have when there are
    two or more (the others are returned, left out), else Welch's interval on the run means of
    both sides (nothing left out). One run on a side and no pair: `between_runs` False, no
    interval (`seeds` <= 1; an accuracy then gets its examples-only one from
    `accuracy_difference`)."""
    common = sorted(set(a) & set(b))
    if len(common) >= 2:
        d = np.array([a[s] - b[s] for s in common], dtype=float)
        se = float(d.std(ddof=1) / math.sqrt(d.size))
        got = _from_se(float(d.mean()), se, d.size - 1, level, seeds=d.size, examples=examples)
        return got, sorted(set(a) ^ set(b))
    xa, xb = (np.array(list(x.values()), dtype=float) for x in (a, b))
    if xa.size < 2 or xb.size < 2:
        mean = float(xa.mean() - xb.mean()) if xa.size and xb.size else math.nan
        # no spread to measure: seeds <= 1 keeps it out of every family (as one shared seed)
        one = Interval(mean, mean, mean, 1.0, min(xa.size, xb.size), examples, method="none")
        return one, sorted(set(a) ^ set(b))
    va, vb = xa.var(ddof=1) / xa.size, xb.var(ddof=1) / xb.size
    se = float(math.sqrt(va + vb))
    denom = va**2 / (xa.size - 1) + vb**2 / (xb.size - 1)
    # Welch-Satterthwaite, which never exceeds n_a + n_b - 2 (clipped: rounding)
    df = min((va + vb) ** 2 / denom, xa.size + xb.size - 2) if denom > 0 else xa.size + xb.size - 2
    mean = float(xa.mean() - xb.mean())
    n = min(xa.size, xb.size)
    return _from_se(mean, se, df, level, seeds=n, examples=examples, method="welch"), []


def _power(effect: float, n: int, alpha: float, paired: bool) -> float:
    """Two-sided power of the t test (noncentral t) for a true difference of `effect` run
    standard deviations, `n` runs a side."""
    df = n - 1 if paired else 2 * n - 2
    nc = abs(effect) / math.sqrt(1 / n if paired else 2 / n)
    crit = float(stats.t.ppf(1 - alpha / 2, df))
    # the far tail's share can come back NaN from scipy where it is ~0
    far = float(np.nan_to_num(stats.nct.cdf(-crit, df, nc)))
    return float(np.nan_to_num(stats.nct.sf(crit, df, nc), nan=1.0)) + far


@functools.lru_cache(maxsize=4096)
def _detectable_effect(n: int, alpha: float, paired: bool, power: float) -> float:
    """The smallest true difference, in run standard deviations, detected with `power`."""
    hi = 1.0
    while _power(hi, n, alpha, paired) < power:
        hi *= 2
    return float(optimize.brentq(lambda e: _power(e, n, alpha, paired) - power, 0.0, hi))


def detectable(sd: float, n: int, alpha: float, paired: bool = True, power: float = 0.8) -> float:
    """The smallest true difference a two-sided t test at `alpha` detects with `power`, given
    the run spread `sd` (of per-seed differences when `paired`, else of one side's runs) and
    `n` runs per side; inf with fewer than 2 runs."""
    if n < 2:
        return math.inf
    return sd * _detectable_effect(n, alpha, paired, power) if sd > 0 else 0.0


def seeds_to_resolve(
    margin: float,
    sd: float,
    alpha: float,
    paired: bool = True,
    power: float = 0.8,
    most: int = 1000,
) -> int | None:
    """Runs per side at which a true difference of `margin` is detected with `power` (the
    same test and spread as `detectable`); None when more than `most` would be needed."""
    if not sd > 0:
        return 2
    if detectable(sd, most, alpha, paired, power) > abs(margin):
        return None
    lo, hi = 1, most  # the detectable difference falls with n: the first n that reaches it
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (
            (lo, mid) if detectable(sd, mid, alpha, paired, power) <= abs(margin) else (mid, hi)
        )
    return hi


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
    """Difference of run accuracies (each a run's mean over the same `examples` examples):
    `run_difference`, the run as the unit. With one shared seed and no two runs a side: an
    interval over examples alone, (p_a (1 - p_a) + p_b (1 - p_b)) / E, labelled so
    (`between_runs` False): it says nothing about retraining and no verdict is made on it."""
    got, unpaired = run_difference(a, b, level, examples)
    common = sorted(set(a) & set(b))
    if got.seeds > 1 or len(common) != 1:
        return got, unpaired
    s = common[0]
    se = math.sqrt(max(a[s] * (1 - a[s]) + b[s] * (1 - b[s]), 0.0) / max(examples, 1))
    d = a[s] - b[s]
    p = float(2 * stats.norm.sf(abs(d) / se)) if se > 0 else 1.0
    half = float(stats.norm.ppf(0.5 + level / 2)) * se
    one = Interval(d, d - half, d + half, p, 1, examples, False, se, 0.0, "examples", level)
    return one, unpaired


def seeds_more(margin: float, sd: float, alpha: float, paired: bool = True) -> str:
    """`seeds_to_resolve` as the report writes it."""
    n = seeds_to_resolve(margin, sd, alpha, paired)
    return "> 1000" if n is None else str(n)


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
