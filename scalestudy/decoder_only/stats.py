"""Statistics of the decoder-only report: per-group summaries over seeds, paired differences
between groups trained with the same seeds, and Holm's correction over a report's verdicts.

The unit of replication is the run: two groups trained with the same seed share the data
order and initialisation stream, so their difference is taken seed by seed (a paired
t-interval over seeds; Welch on run means without two shared seeds;
`intervals.run_difference`). A run's probe accuracy is its mean over the shared examples, so
their noise is already in the runs' spread and no examples term is added.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from scipy import stats

from scalestudy.scaling import intervals
from scalestudy.study.record.rows import RunRow
from scalestudy.study.report import page as report
from scalestudy.study.report import verdicts


@dataclass(frozen=True)
class Estimate:
    """a - b over the seeds both sides have: the mean difference `d`, its 95% `half` width and
    `p` value (None without a between-run interval: fewer than two common seeds), `seeds`
    (common seeds) and `examples` (accuracy: the examples every run scores); `none` says why
    there is no difference at all (e.g. neither side was scored zero-shot)."""

    d: float
    half: float | None
    p: float | None
    seeds: int
    examples: int
    none: str = ""

    def as_dict(self) -> dict[str, float | int | str | None]:
        """The estimate as decoder_only.json holds it (`none` only where set)."""
        out = {"d": self.d, "half": self.half, "p": self.p, "seeds": self.seeds}
        out["examples"] = self.examples
        return out | ({"none": self.none} if self.none else {})


@dataclass(frozen=True)
class PairedTest:
    """One test of the decoder-only report: `name` minus `ref` on `what` (`lower`: whether
    lower is better; None: a measure with no better), and its estimate."""

    name: str
    ref: str
    what: str
    lower: bool | None
    est: Estimate

    def as_dict(self) -> dict[str, Any]:
        """The test as decoder_only.json holds it."""
        return {
            "name": self.name,
            "ref": self.ref,
            "what": self.what,
            "lower": self.lower,
            "est": self.est.as_dict(),
        }


def as_json(value: Any) -> Any:
    """What a JSON results file holds for a value JSON has no type for: a record's `as_dict`,
    else the number (numpy scalars)."""
    return value.as_dict() if hasattr(value, "as_dict") else float(value)


def t95(df: int) -> float:
    """The two-sided 95% quantile of Student's t with `df` degrees of freedom."""
    return float(stats.t.ppf(0.975, df))


def loss_stats(rows: list[RunRow]) -> dict[str, Any]:
    """Mean validation loss over seeds, its sample variance and the 95% t half-width."""
    xs = [r.loss for r in rows if r.loss is not None]
    n = len(xs)
    mean = sum(xs) / n if n else math.nan
    var = sum((x - mean) ** 2 for x in xs) / (n - 1) if n > 1 else None
    half = t95(n - 1) * math.sqrt(var / n) if var is not None else None
    return {"mean": mean, "var": var, "n": n, "half": half}


def _by_seed(rows: list[RunRow], value) -> dict[int, float]:
    out = {}
    for r in rows:
        x = value(r)
        if x is not None:
            out[r.seed or 0] = x
    return out


def _accuracy(row: RunRow) -> float | None:
    got = report.probe_accuracy(row)
    return got[0] if got else None


def paired_difference(a_rows: list[RunRow], b_rows: list[RunRow], kind: str) -> Estimate:
    """a - b on `kind` ("loss" or "acc"), seed by seed over the seeds both groups have
    (`scaling.intervals.run_difference`: the run is the unit, for accuracy too).

    For acc when neither group was scored zero-shot, the estimate's `none` says so."""
    if kind == "loss":
        return seed_difference(
            _by_seed(a_rows, lambda r: r.loss), _by_seed(b_rows, lambda r: r.loss)
        )
    a, b = _by_seed(a_rows, _accuracy), _by_seed(b_rows, _accuracy)
    counts = [got[1] for r in (*a_rows, *b_rows) if (got := report.probe_accuracy(r))]
    if not counts:  # neither group scored zero-shot (e.g. bmlm: validation loss only)
        return Estimate(math.nan, None, None, 0, 0, none="no accuracy")
    return seed_difference(a, b, int(min(counts)))


def seed_difference(
    a: dict[int, float], b: dict[int, float], examples: int | None = None
) -> Estimate:
    """a - b seed by seed over the seeds both have (`paired_difference`'s estimate); with
    `examples`, `a` and `b` are accuracies over that many shared examples."""
    examples_ = examples or 0
    seeds = set(a) & set(b)
    if not seeds:
        return Estimate(math.nan, None, None, 0, examples_)
    if examples is None:
        got, _ = intervals.paired_difference(a, b)
    else:
        got, _ = intervals.accuracy_difference(a, b, examples)
    between_runs = got.seeds > 1 and got.between_runs
    return Estimate(
        d=got.mean,
        half=(got.high - got.low) / 2 if between_runs else None,
        p=got.p_value if between_runs else None,
        seeds=got.seeds,
        examples=examples_,
    )


def holm(pvalues: list[float | None]) -> list[float | None]:
    """Holm's adjusted p-values over the tests that could be made (None stays None)."""
    tested = [i for i, p in enumerate(pvalues) if p is not None]
    adjusted = intervals.holm([pvalues[i] for i in tested]) if tested else []
    out: list[float | None] = [None] * len(pvalues)
    for i, p in zip(tested, adjusted):
        out[i] = p
    return out


def verdict(
    name: str, ref: str, est: Estimate, what: str, lower: bool | None, p_holm: float | None
) -> str:
    """One sentence: which is better on `what` (`lower`: whether lower is better; None: a
    measure with no better, said as higher or lower), with the interval, n and the
    Holm-adjusted p, or not distinguishable (Holm-adjusted p >= 0.05)."""
    if est.none:
        return f"{name} vs {ref}, {what}: {est.none} (compared on validation loss only)."
    d, half = est.d, est.half
    n = f"n = {est.seeds} seed(s)" + (f" x {est.examples} examples" if est.examples else "")
    if half is None or p_holm is None:
        return (
            f"{name} vs {ref}, {what}: difference {d:+.4f} ({n}), no between-run interval "
            "(needs at least two seeds common to both)."
        )
    span = (
        f"difference {intervals.span(d, d - half, d + half, 4)} (95%, unadjusted), {n}, "
        f"Holm-adjusted p = {p_holm:.3g}"
    )
    said = verdicts.outcome(d, p_holm, None if lower is None else not lower)
    if said == "borderline":
        return f"{name} vs {ref}, {what}: borderline, not called ({span}; {verdicts.why_near()})."
    if said == "not distinguishable":
        if abs(d) > half:  # the interval is not adjusted for the family the p is
            span += "; the unadjusted interval excludes 0, the Holm-adjusted p does not reject"
        return f"{name} vs {ref}, {what}: not distinguishable ({span})."
    return f"{name} is {said} than {ref} on {what} ({span})."
