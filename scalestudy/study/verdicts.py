"""One way to state a verdict, wherever a report states one.

A verdict compares two sides on one metric with a paired test over runs (the run is the unit:
runs of one seed are paired and the interval is over the per-seed differences,
`scaling/intervals.py`), after Holm's adjustment over the report's whole family of tests. It
reads the same everywhere: `word` names the outcome, `cells` gives the difference, its 95%
interval, the adjusted p and n (runs), and `table` lays rows of them out. `answer` is the
first screen of a study's report: one row per question (at equal parameters, compute and
inference cost, and at equal active parameters where there are mixture-of-experts runs; probe
accuracy across every cell, validation loss within each objective) with the best cell,
whether it is ahead of every other, and its narrowest margin.
"""

from __future__ import annotations

from typing import Any

from scalestudy.scaling.intervals import Interval

LEVEL = 0.95

# (report key, what is held equal, the x it is read at)
QUESTIONS = (
    ("equal_params", "parameters", "total parameters"),
    ("equal_active", "active parameters", "active non-embedding parameters"),
    ("equal_compute", "compute", "training FLOPs"),
    ("equal_inference", "inference cost", "inference FLOPs per generated token"),
)


def outcome(difference: float, p_holm: float, higher_better: bool | None, level: float = LEVEL):
    """ "better", "worse" (for the first side, whose value minus the second's is `difference`),
    or "not distinguishable" at `level` after Holm; "higher"/"lower" for a measure with no
    better (`higher_better` None)."""
    if p_holm >= 1 - level:
        return "not distinguishable"
    if higher_better is None:
        return "higher" if difference > 0 else "lower"
    return "better" if (difference > 0) == higher_better else "worse"


def word(test: dict[str, Any], higher_better: bool, level: float = LEVEL) -> str:
    """The outcome of one paired test: which side is better, "not distinguishable", or why
    there is no verdict (one run per side)."""
    iv: Interval = test["interval"]
    if "p_holm" not in test:
        return "no verdict: one run per side" if iv.between_runs else "no verdict: one seed"
    said = outcome(iv.mean, test["p_holm"], higher_better, level)
    return said if said == "not distinguishable" else f"{test['cell']} {said}"


def cells(test: dict[str, Any], digits: int = 3) -> list[str]:
    """[difference [95% interval], Holm-adjusted p, n (runs)] of one paired test."""
    iv: Interval = test["interval"]
    p = f"{test['p_holm']:.2g}" if "p_holm" in test else "none"
    return [iv.text(digits), p, str(iv.seeds)]


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table."""
    return [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def _row(question: str, metric: str, got: dict[str, Any], level: float) -> list[str]:
    """One answer row: the leader, whether it is ahead of every other cell, and the test
    with the largest adjusted p (its narrowest margin)."""
    best, tests = got["leader"], got["tests"]
    if not tests:
        return [question, metric, best, "no other cell shares a seed", "", "", ""]
    ahead = [t for t in tests if word(t, got["higher"], level).endswith(" better")]
    closest = max(tests, key=lambda t: t.get("p_holm", 2.0))
    if len(ahead) == len(tests):
        verdict = f"**ahead of all {len(tests)}**"
    elif any("p_holm" in t for t in tests):
        behind = [t["reference"] for t in tests if t not in ahead]
        verdict = f"not distinguishable from {', '.join(behind)}"
        if ahead:
            verdict = f"ahead of {', '.join(t['reference'] for t in ahead)}; {verdict}"
    else:
        verdict = "no verdict: one seed"
    if got.get("left_out"):
        verdict += f" (left out: {', '.join(got['left_out'])})"
    return [
        question,
        metric,
        best,
        verdict,
        f"{closest['reference']}: " + cells(closest)[0],
        *cells(closest)[1:],
    ]


def answer(cmp: dict[str, Any], n_what: str, level: float = LEVEL) -> list[str]:
    """The report's first screen: a verdict table over `report.compare`'s leaders."""
    rows = []
    for key, held, x_what in QUESTIONS:
        x_what = n_what if key == "equal_params" else x_what
        if got := cmp.get(key):
            rows.append(
                _row(f"equal {held} ({got['at']:.3g} {x_what})", "probe accuracy", got, level)
            )
        for obj, got in cmp.get(key + "_loss", {}).items():
            rows.append(
                _row(f"equal {held} ({got['at']:.3g} {x_what})", f"val loss, {obj}", got, level)
            )
        for task, by_question in cmp.get("incontext", {}).items():
            if got := by_question.get(key):
                metric = f"{got['k']}-shot gain, {task}"
                rows.append(_row(f"equal {held} ({got['at']:.3g} {x_what})", metric, got, level))
    if not rows:
        return []
    head = ["at", "metric", "best", "verdict", "narrowest margin [95%]", "Holm p", "n (runs)"]
    return [
        "## The answer",
        "",
        f"Each row: the best cell at one matching, tested against every other cell with runs "
        f"as the unit (paired by seed, Holm-adjusted over the report's {cmp['family']} tests, "
        "95% intervals); the margin shown is the best cell minus its closest rival (accuracy "
        "and in-context gain: higher is better; loss: lower). Losses compare only cells of "
        "one objective; probe accuracy (zero-shot) compares every cell. The sections below "
        "give every test with what it holds equal and what it does not.",
        "",
        *table(head, rows),
        "",
    ]
