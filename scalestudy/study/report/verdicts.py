"""One way to state a verdict, wherever a report states one.

A verdict compares two sides on one metric with a test over runs (the run is the unit: runs
of one seed are paired, Welch on run means otherwise, `scaling/intervals.run_difference`),
after Holm's adjustment within its family (the answer's questions are the primary family,
the per-rung comparisons the secondary one). It reads the same everywhere: `word` names the
outcome, `why` says when an interval and a rejection could look at odds, `cells` gives the
difference with the interval shown (simultaneous over the family), the adjusted p and n
(runs), and `table` lays rows of them out. `answer_rows` makes the first screen of a study's
report: one row per question (at equal parameters, compute and inference cost, and at equal
active parameters where there are mixture-of-experts runs; probe accuracy across every cell,
validation loss within each objective) with the best cell, whether it is ahead of every
other, its narrowest margin, the design's power and what is not equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scalestudy.scaling import intervals, render
from scalestudy.scaling.intervals import Interval
from scalestudy.study.record.rows import RunRow

LEVEL = 0.95

# (report key, what is held equal, the x it is read at)
QUESTIONS = (
    ("equal_params", "parameters", "total parameters"),
    ("equal_active", "active parameters", "active non-embedding parameters"),
    ("equal_compute", "compute", "training FLOPs"),
    ("equal_inference", "inference cost", "inference FLOPs per generated token"),
)


# A Holm-adjusted p within this factor of the family's alpha is "borderline" and not called
# either way: the same study on another CPU (other instructions, so other last bits of float32
# sums, which training amplifies) moved the p-values near 0.05 by up to 1.6x and flipped one
# verdict (docs/results-smoke.md, "What is reproducible"). Not calling them only removes
# rejections, so the family's error rate stays controlled.
BORDERLINE = 2.0


@dataclass(frozen=True)
class Test:
    """One test of a verdict: `cell` minus `reference` on `metric` ("acc", "loss" or a derived
    per-run number), its interval over runs, the seeds left unpaired, and what the two sides
    hold equal and what not. `size` and `budget`: the rung a matched comparison is made at.
    After `comparisons.adjust`: the Holm-adjusted `p_holm`, its `family` (name, size) and the
    interval `shown` beside it (simultaneous over the family); None before, or without a
    between-run interval."""

    cell: str
    reference: str
    metric: str
    interval: Interval
    unpaired: list[int] = field(default_factory=list)
    held_equal: list[str] = field(default_factory=list)
    not_equal: list[str] = field(default_factory=list)
    size: str | None = None
    budget: str = ""
    p_holm: float | None = None
    family: tuple[str, int] | None = None
    shown: Interval | None = None


@dataclass(frozen=True)
class Leader:
    """The cells read where their runs are (`comparisons.leader`): the best cell (`leader`,
    `higher` saying which way is better) and its `tests` against every other; the x every
    cell is read near (`at`), each cell's score and mean, the x its rung is `read` at and the
    rung's `quantities` (a record of their means). `left_out`: cells not compared, and
    `why_left_out`; `of`: the cells the question could have had. `more` and `k` name an
    in-context gain; `verdict`: the Markdown lines after the family's adjustment."""

    leader: str
    higher: bool
    tests: list[Test]
    at: float = math.nan
    scores: dict[str, Interval] = field(default_factory=dict)
    means: dict[str, float] = field(default_factory=dict)
    read: dict[str, float] = field(default_factory=dict)
    quantities: dict[str, RunRow] = field(default_factory=dict)
    left_out: list[str] = field(default_factory=list)
    why_left_out: str = ""
    of: set[str] = field(default_factory=set)
    more: str = ""
    k: int | None = None
    verdict: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Comparison:
    """What a study's report compares (`answer.compare`): runs finished of all (`n_done`,
    `n_runs`), the parameter count N is (`n_key`), the cells whose loss does not fall up the
    ladder, the matched per-rung tests (the secondary family, of `secondary` distinct tests)
    and the leaders, the primary family (of `family` distinct tests): on probe accuracy per
    question (`accuracy`: "equal_params", "equal_compute", ..., each again as
    "<question>_ladder" over the cells spanning the ladder when some have one rung, the
    `one_rung` cells), on validation loss per question and objective (`loss`) and on the
    in-context gain per task and question (`incontext`)."""

    n_done: int
    n_runs: int
    n_key: str = "params_total"
    not_scaling: list[str] = field(default_factory=list)
    matched: list[Test] = field(default_factory=list)
    one_rung: list[str] = field(default_factory=list)
    accuracy: dict[str, Leader] = field(default_factory=dict)
    loss: dict[str, dict[str, Leader]] = field(default_factory=dict)
    incontext: dict[str, dict[str, Leader]] = field(default_factory=dict)
    family: int = 0
    secondary: int = 0


def borderline(p_holm: float, level: float = LEVEL) -> bool:
    """Whether an adjusted p is too near the level for its verdict to hold across hosts."""
    alpha = round(1 - level, 12)  # 1 - 0.95 is 0.05 plus a last bit
    return alpha / BORDERLINE <= p_holm < alpha * BORDERLINE


def outcome(difference: float, p_holm: float, higher_better: bool | None, level: float = LEVEL):
    """ "better", "worse" (for the first side, whose value minus the second's is `difference`),
    "borderline" (`borderline`: not called) or "not distinguishable" at `level` after Holm;
    "higher"/"lower" for a measure with no better (`higher_better` None)."""
    if borderline(p_holm, level):
        return "borderline"
    if p_holm >= 1 - level:
        return "not distinguishable"
    if higher_better is None:
        return "higher" if difference > 0 else "lower"
    return "better" if (difference > 0) == higher_better else "worse"


def word(test: Test, higher_better: bool, level: float = LEVEL) -> str:
    """The outcome of one test: which side is better, "not distinguishable", or why there is
    no verdict (one run per side)."""
    iv = test.interval
    if test.p_holm is None:
        return "no verdict: one seed" if iv.method == "examples" else "no verdict: one run per side"
    said = outcome(iv.mean, test.p_holm, higher_better, level)
    return said if said in ("not distinguishable", "borderline") else f"{test.cell} {said}"


def why_near(level: float = LEVEL) -> str:
    """Why a borderline verdict is not called, as a clause after "borderline"."""
    return (
        f"the Holm-adjusted p is within a factor {BORDERLINE:g} of {1 - level:.2g}, where "
        "another host's last-bit differences can move it across"
    )


def why(test: Test, level: float = LEVEL) -> str:
    """A word where the shown interval and the verdict could be read as disagreeing: Holm's
    later steps reject at a lower bar than the family's simultaneous interval (which then
    still touches 0). Empty where they agree."""
    iv = test.shown
    if iv is None or test.p_holm is None:
        return ""
    if borderline(test.p_holm, level):
        return f" ({why_near(level)}; not called)"
    rejected = test.p_holm < 1 - level
    excludes = iv.low > 0 or iv.high < 0
    if rejected and not excludes:
        return (
            " (Holm's step-down rejects at a lower bar than the simultaneous interval, which "
            "still touches 0)"
        )
    if excludes and not rejected:  # cannot happen with Bonferroni intervals: said if it does
        return " (the interval excludes 0 but the Holm-adjusted p does not reach the level)"
    return ""


def cells(test: Test, digits: int = 3) -> list[str]:
    """[difference [interval shown], Holm-adjusted p, n (runs)] of one test."""
    iv = test.shown or test.interval
    p = f"{test.p_holm:.2g}" if test.p_holm is not None else "none"
    n = str(iv.seeds) + (" a side (Welch)" if iv.method == "welch" else "")
    return [iv.text(digits), p, n]


@dataclass(frozen=True)
class AnswerRow:
    """One question of the answer: the best cell, the verdict against every other, and its
    closest rival's test (`closest`, after `comparisons.adjust`) with the design's power."""

    question: str
    metric: str
    best: str
    verdict: str
    closest: Test | None
    detectable: float | None = None  # smallest difference found with 80% power
    seeds_needed: str = ""  # runs a side that would resolve the observed margin

    def cells(self, digits: int = 3) -> list[str]:
        """The row as the answer table prints it."""
        if self.closest is None:
            return [self.question, self.metric, self.best, self.verdict, "", "", "", "", "", ""]
        t = self.closest
        margin, p, n = cells(t, digits)
        dd = "-" if self.detectable is None else f"{self.detectable:.{digits}f}"
        unequal = ", ".join(t.not_equal) or "nothing"
        return [
            self.question,
            self.metric,
            self.best,
            self.verdict,
            f"{t.reference}: {margin}",
            p,
            n,
            dd,
            self.seeds_needed,
            unequal,
        ]


def _power(test: Test, level: float) -> tuple[float | None, str]:
    """(the smallest difference the design detects with 80% power, two-sided, at the family's
    Bonferroni level, from the measured run spread; the runs a side that would resolve the
    observed margin) for one adjusted test; (None, "-") without a between-run interval, and
    (None, "no run spread") where every run gave the same value."""
    iv = test.interval
    if test.family is None:
        return None, "-"
    if iv.se <= 0:  # every run the same (e.g. both cells at a ceiling): no spread to size by
        return None, "no run spread"
    alpha = (1 - level) / test.family[1]
    paired = iv.method != "welch"
    # the spread of one run's value (paired: of a per-seed difference) behind the se
    sd = iv.se * math.sqrt(iv.seeds if paired else iv.seeds / 2)
    return (
        intervals.detectable(sd, iv.seeds, alpha, paired),
        intervals.seeds_more(iv.mean, sd, alpha, paired),
    )


def _row(question: str, metric: str, got: Leader, level: float) -> AnswerRow:
    """One answer row: the leader, whether it is ahead of every other cell, and the test
    with the largest adjusted p (its narrowest margin)."""
    best, tests = got.leader, got.tests
    if not tests:
        return AnswerRow(question, metric, best, "no other cell shares a seed", None)
    ahead = [t for t in tests if word(t, got.higher, level).endswith(" better")]
    closest = max(tests, key=lambda t: 2.0 if t.p_holm is None else t.p_holm)
    if len(ahead) == len(tests):
        verdict = f"**ahead of all {len(tests)}**"
    elif any(t.p_holm is not None for t in tests):
        near = [t for t in tests if word(t, got.higher, level) == "borderline"]
        behind = [t.reference for t in tests if t not in ahead and t not in near]
        parts = [f"ahead of {', '.join(t.reference for t in ahead)}"] if ahead else []
        if near:
            parts.append(f"borderline against {', '.join(t.reference for t in near)}")
        if behind:
            parts.append(f"not distinguishable from {', '.join(behind)}")
        verdict = "; ".join(parts)
    else:
        verdict = "no verdict: one seed"
    verdict += why(closest, level)
    if got.left_out:
        verdict += f" (left out: {', '.join(got.left_out)})"
    return AnswerRow(question, metric, best, verdict, closest, *_power(closest, level))


def answer_rows(cmp: Comparison, n_what: str, level: float = LEVEL) -> list[AnswerRow]:
    """The answer's rows over `answer.compare`'s leaders (after its primary family's
    adjustment): per question, probe accuracy, validation loss within each objective and the
    in-context gain, then the same along the ladder where some cells sit at fewer rungs."""
    rows = []
    for key, held, x_what in QUESTIONS:
        x_what = n_what if key == "equal_params" else x_what
        for suffix, where in (("", ""), ("_ladder", "; cells spanning the ladder")):
            name = key + suffix
            if suffix == "" and cmp.one_rung:  # why every cell meets at one rung
                where = f"; every cell, at the rung of the one-rung {', '.join(cmp.one_rung)}"
            if got := cmp.accuracy.get(name):
                q = f"equal {held} ({got.at:.3g} {x_what}{where})"
                rows.append(_row(q, "probe accuracy", got, level))
            for obj, got in cmp.loss.get(name, {}).items():
                # a loss row names the one-rung cells only where its objective has one
                mine = where if suffix or set(cmp.one_rung) & set(got.of) else ""
                q = f"equal {held} ({got.at:.3g} {x_what}{mine})"
                rows.append(_row(q, f"val loss, {obj}", got, level))
            for task, by_question in cmp.incontext.items():
                if got := by_question.get(name):
                    metric = f"{got.k}-shot gain, {task}"
                    q = f"equal {held} ({got.at:.3g} {x_what}{where})"
                    rows.append(_row(q, metric, got, level))
    return rows


HEAD = [
    "at",
    "metric",
    "best",
    "verdict",
    "narrowest margin [simultaneous interval]",
    "Holm p",
    "n (runs)",
    "detectable (80% power)",
    "seeds to resolve",
    "not equal (best / rival)",
]


def answer(cmp: Comparison, n_what: str, level: float = LEVEL) -> list[str]:
    """The report's first screen: a verdict table over `answer.compare`'s leaders."""
    rows = answer_rows(cmp, n_what, level)
    if not rows:
        return []
    m = cmp.family
    wide = 1 - (1 - level) / max(m, 1)
    return [
        "## The answer",
        "",
        f"Each row: the best cell at one matching, tested against every other cell with the "
        f"run as the unit (paired by seed; Welch on run means where cells share fewer than two "
        f"seeds). The rows are the report's primary family of {m} tests: p is Holm-adjusted "
        f"among them only, and each interval is simultaneous over them ({wide:.4g} each, "
        f"Bonferroni: {level:.0%} together), so an interval that excludes 0 goes with a "
        "rejection. The margin is the best cell minus its closest rival (accuracy and "
        "in-context gain: higher is better; loss: lower). Detectable: the smallest true "
        "difference the design finds with 80% power (two-sided, at the family's Bonferroni "
        "level, the measured run spread, these runs); seeds to resolve: runs a side that "
        "would find the observed margin so. Cells are read at their runs, never between "
        "rungs: what the rungs read do not hold equal is named. Losses compare only cells of "
        "one objective; probe accuracy (zero-shot) compares every cell.",
        "",
        *render.table(HEAD, [r.cells() for r in rows]),
        "",
    ]
