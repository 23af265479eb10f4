"""Statistics of the decoder-only report: per-group summaries over seeds, paired differences
between groups trained with the same seeds, and Holm's correction over a report's verdicts.

The unit of replication is the seed: two groups trained with the same seed share the data
order and initialisation stream, so their difference is taken seed by seed (a paired
t-interval over seeds). Probe accuracy has a second source of variance, the examples (every
seed scores the same ones): its interval adds the binomial variance of the two accuracies over
the examples to the seed spread of the paired differences. That ignores the positive
correlation of two models' correctness on the same examples, so it is conservative.
"""

from __future__ import annotations

import math
from typing import Any

from scipy import stats

from scalestudy.study import report


def t95(df: int) -> float:
    """The two-sided 95% quantile of Student's t with `df` degrees of freedom."""
    return float(stats.t.ppf(0.975, df))


def loss_stats(rows: list[dict]) -> dict[str, Any]:
    """Mean validation loss over seeds, its sample variance and the 95% t half-width."""
    xs = [r["loss"] for r in rows if r.get("loss") is not None]
    n = len(xs)
    mean = sum(xs) / n if n else math.nan
    var = sum((x - mean) ** 2 for x in xs) / (n - 1) if n > 1 else None
    half = t95(n - 1) * math.sqrt(var / n) if var is not None else None
    return {"mean": mean, "var": var, "n": n, "half": half}


def acc_stats(rows: list[dict]) -> dict[str, Any]:
    """Mean probe accuracy over seeds and its 95% half-width (binomial over the examples plus
    the seed spread); `examples` is the number of examples each seed scored."""
    points = [pa for pa in (report.probe_accuracy(r) for r in rows) if pa]
    if not points:
        return {"mean": math.nan, "half": None, "n": 0, "examples": 0}
    n = len(points)
    mean = sum(acc for acc, _ in points) / n
    examples = min(count for _, count in points)
    var = max(mean * (1 - mean), 1e-12) / max(examples, 1)
    if n > 1:  # the spread between seeds, as the variance of their mean
        var += sum((acc - mean) ** 2 for acc, _ in points) / (n - 1) / n
    return {"mean": mean, "half": report.Z95 * math.sqrt(var), "n": n, "examples": examples}


def _by_seed(rows: list[dict], value) -> dict[int, float]:
    out = {}
    for r in rows:
        x = value(r)
        if x is not None:
            out[r.get("seed", 0)] = x
    return out


def _t_test(ds: list[float], extra_var: float = 0.0) -> tuple[float, float | None, float | None]:
    """Mean of `ds`, its 95% half-width and two-sided p-value (t over len(ds) - 1 degrees of
    freedom, with `extra_var` added to the variance of the mean); no interval below 2."""
    n = len(ds)
    d = sum(ds) / n
    if n < 2:
        return d, None, None
    var = sum((x - d) ** 2 for x in ds) / (n - 1) / n + extra_var
    if var == 0.0:
        return d, 0.0, 0.0 if d != 0.0 else 1.0
    se = math.sqrt(var)
    p = float(2 * stats.t.sf(abs(d) / se, n - 1))
    return d, t95(n - 1) * se, p


def paired_difference(a_rows: list[dict], b_rows: list[dict], kind: str) -> dict[str, Any]:
    """a - b on `kind` ("loss" or "acc"), seed by seed over the seeds both groups have.

    Returns the mean difference `d`, its 95% `half` width and `p` value (None with fewer than
    two common seeds), `seeds` (common seeds) and `examples` (acc: examples per seed); for acc
    when neither group has any, `none` says so instead."""
    if kind == "loss":
        a = _by_seed(a_rows, lambda r: r.get("loss"))
        b = _by_seed(b_rows, lambda r: r.get("loss"))
        examples, extra = 0, 0.0
    else:
        first = lambda r: report.probe_accuracy(r) or (None, 0)
        a = _by_seed(a_rows, lambda r: first(r)[0])
        b = _by_seed(b_rows, lambda r: first(r)[0])
        counts = [first(r)[1] for r in (*a_rows, *b_rows) if first(r)[0] is not None]
        if not counts:  # neither group scored zero-shot (e.g. bmlm: validation loss only)
            return {"d": math.nan, "half": None, "p": None, "seeds": 0, "examples": 0,
                    "none": "no accuracy"}  # fmt: skip
        examples = min(counts) if counts else 0
        extra = 0.0
        if examples and a and b:
            pa, pb = sum(a.values()) / len(a), sum(b.values()) / len(b)
            extra = (pa * (1 - pa) + pb * (1 - pb)) / examples
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return {"d": math.nan, "half": None, "p": None, "seeds": 0, "examples": examples}
    d, half, p = _t_test([a[s] - b[s] for s in seeds], extra)
    return {"d": d, "half": half, "p": p, "seeds": len(seeds), "examples": examples}


def holm(pvalues: list[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values (None stays None: no test was possible)."""
    tested = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    m = len(tested)
    out: list[float | None] = [None] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out


def verdict(name: str, ref: str, est: dict, what: str, lower: bool, p_holm: float | None) -> str:
    """One sentence: which is better on `what`, with the interval, n and the Holm-adjusted p,
    or not distinguishable (Holm-adjusted p >= 0.05)."""
    if est.get("none"):
        return f"{name} vs {ref}, {what}: {est['none']} (compared on validation loss only)."
    d, half = est["d"], est["half"]
    n = f"n = {est['seeds']} seed(s)" + (
        f" x {est['examples']} examples" if est.get("examples") else ""
    )
    if half is None or p_holm is None:
        return (
            f"{name} vs {ref}, {what}: difference {d:+.4f} ({n}), no between-run interval "
            "(needs at least two seeds common to both)."
        )
    span = (
        f"difference {d:+.4f}, 95% interval [{d - half:+.4f}, {d + half:+.4f}], {n}, "
        f"Holm-adjusted p = {p_holm:.3g}"
    )
    if p_holm >= 0.05:
        return f"{name} vs {ref}, {what}: not distinguishable ({span})."
    better = (d < 0) == lower
    return f"{name} is {'better' if better else 'worse'} than {ref} on {what} ({span})."
