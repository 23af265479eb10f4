"""The answer of a study's report: which cells it compares, where, and how its verdicts read.

- `compare`: probe accuracy across every cell and validation loss within each objective (losses
  of different objectives are not comparable: an MLM model predicts 15% of corrupted spans, an
  FLM model every next token), at equal parameters, compute and inference cost
  (`comparisons.leader`: each cell read at its own runs, never between rungs), again along the
  ladder where some cells have runs at one rung only, and the matched per-rung comparisons.
  The leaders' tests are the answer's primary Holm family, the matched ones the secondary.
- `method_lines`: the one sentence on the method and what each family's intervals are.
- `verdict_section`: every leader's verdict in full, with each cell's score table.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import replace

from scalestudy.scaling import render
from scalestudy.study.record.rows import RunRow, has_experts
from scalestudy.study.report import comparisons, incontext, verdicts
from scalestudy.study.report.verdicts import Comparison, Leader


def not_scaling(runs: list[RunRow]) -> list[str]:
    """Cells whose validation loss does not fall at every step up the ladder (seed means).
    Runs of an IsoFLOP budget (tagged, e.g. "C6e10") are left out: at equal compute a larger
    model reads fewer tokens, and loss against size is a valley, not a slope."""
    losses: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        if r.loss is not None and r.params_total and not r.budget:
            losses[r.cell][float(r.params_total)].append(r.loss)
    bad = []
    for cell, by_n in sorted(losses.items()):
        means = [sum(v) / len(v) for _, v in sorted(by_n.items())]
        if any(b >= a for a, b in itertools.pairwise(means)):
            bad.append(cell)
    return bad


def compare(runs: list[RunRow], n_key: str = "params_total", tolerance: float = 0.03) -> Comparison:
    """The report's comparisons: probe accuracy across cells and validation loss within each
    objective, at equal parameters and at equal compute (`comparisons.leader`; again along
    the ladder, `<question>_ladder`, where some cells have runs at one rung only), and the
    matched comparisons at each rung (`comparisons.compare`). The leaders' tests (the
    answer's questions) are the primary Holm family (`family`: how many), the matched ones
    the secondary (`secondary`); each leader's verdict as Markdown lines."""
    done = [r for r in runs if r.status == "done"]
    questions = [("equal_params", n_key)]
    if has_experts(done):  # MoE against dense at the parameters a token uses
        questions.append(("equal_active", "params_active"))
    questions += [("equal_compute", "flops"), ("equal_inference", "inference_flops_per_token")]
    rungs: dict[str, set] = defaultdict(set)
    for r in done:
        rungs[r.cell].add(r.size_index or 0)
    one_rung = sorted(c for c, sizes in rungs.items() if len(sizes) == 1)
    ladder = [r for r in done if r.cell not in one_rung]
    spans = len(rungs) - len(one_rung) >= 2
    found: list[tuple[tuple[str, ...], Leader]] = []
    for name, x_key in questions:
        found += _leaders(name, done, x_key, tolerance)
        if one_rung and spans:
            for where, got in _leaders(name + "_ladder", ladder, x_key, tolerance, done):
                left = sorted({*got.left_out, *(c for c in one_rung if c in got.of)})
                why = "their runs are at one rung only"
                found.append((where, replace(got, left_out=left, why_left_out=why)))
    in_context = incontext.compare(done, n_key, tolerance)
    found += [
        (("incontext", task, name), got)
        for task, by_question in in_context.items()
        for name, got in by_question.items()
    ]
    leaders, family = comparisons.adjust_leaders([got for _, got in found], "primary")
    matched, secondary = comparisons.adjust(
        comparisons.compare(done, tolerance, family=False), "secondary"
    )
    placed: dict[str, dict] = {"accuracy": {}, "loss": {}, "incontext": {}}
    for (kind, *where), got in zip((w for w, _ in found), leaders, strict=True):
        if kind == "accuracy":
            placed[kind][where[0]] = got
        else:
            placed[kind].setdefault(where[0], {})[where[1]] = got
    return Comparison(
        len(done),
        len(runs),
        n_key,
        not_scaling(done),
        matched,
        one_rung if spans else [],
        **placed,
        family=family,
        secondary=secondary,
    )


def _leaders(
    name: str,
    rows: list[RunRow],
    x_key: str,
    tolerance: float,
    everyone: list[RunRow] | None = None,
) -> list[tuple[tuple[str, ...], Leader]]:
    """Probe accuracy across the cells of `rows` (where: ("accuracy", `name`)) and loss within
    each objective (("loss", `name`, objective)): the leaders found, each with where it goes
    in the `Comparison`. `of` on each: the cells of `everyone` (default `rows`) that the
    question could have had."""
    found = []
    everyone = rows if everyone is None else everyone
    if got := comparisons.leader(rows, x_key, "acc", tolerance):
        found.append((("accuracy", name), replace(got, of={r.cell for r in everyone})))
    for obj in sorted({r.objective for r in rows}):
        of = {r.cell for r in everyone if r.objective == obj}
        mine = [r for r in rows if r.objective == obj]
        dropped = len(of) > len({r.cell for r in mine})
        if (dropped or everyone is rows) and (
            got := comparisons.leader(mine, x_key, "loss", tolerance)
        ):
            found.append((("loss", name, obj), replace(got, of=of)))
    return found


def score_table(found: Leader, what: str) -> list[str]:
    rows = []
    for cell, iv in found.scores.items():
        n = f"{iv.seeds} seed{'s' if iv.seeds != 1 else ''}"
        n += f" x {iv.examples} examples" if iv.examples else ""
        span = f"[{iv.low:.3f}, {iv.high:.3f}]" if iv.seeds > 1 else "none (one run)"
        rows.append([cell, f"{iv.mean:.3f}", span, n])
    return render.table(["cell", what, "95% interval over runs (unadjusted)", "n"], rows)


def verdict_section(cmp: Comparison, n_what: str) -> list[str]:
    """Every leader's verdict in full (the answer's primary family), per question."""
    lines = []
    for name, held, x_what in verdicts.QUESTIONS:
        x_what = n_what if name == "equal_params" else x_what
        for key, where in ((name, ""), (name + "_ladder", "; the cells spanning the ladder")):
            title = f"Equal {held}"
            if (c := cmp.accuracy.get(key)) is not None:
                lines += [
                    f"**{title}** (probe accuracy near {c.at:.3g} {x_what}, the largest "
                    f"value every cell spans{where}; each cell read at its own runs, at its "
                    "rung nearest in log, never between rungs): " + c.verdict[0],
                    *c.verdict[1:],
                    "",
                    *score_table(c, "probe accuracy"),
                    "",
                ]
            for obj, c in cmp.loss.get(key, {}).items():
                lines += [
                    f"- {title.lower()}, validation loss within `{obj}` (near {c.at:.3g} "
                    f"{x_what}{where}; lower is better): " + c.verdict[0],
                    *c.verdict[1:],
                ]
            if cmp.loss.get(key):
                lines.append("")
    return lines


METHOD = (
    "Method: every verdict takes the training run as the unit of replication: a run's "
    "accuracy is its mean over the shared evaluation examples (examples are nested in runs, "
    "so no separate examples term), cells are paired by seed where both have it (a t interval "
    "on the per-seed differences, n - 1 degrees of freedom) and compared by Welch's t on run "
    "means otherwise, so the degrees of freedom never exceed what the runs give; the claim is "
    "about retraining, on this evaluation set."
)


def method_lines(cmp: Comparison) -> list[str]:
    """`How to read`'s paragraph on the intervals: the unit, the families, the levels."""
    return [
        METHOD,
        "",
        f"Two families. The primary family is the answer's {cmp.family} distinct tests "
        "(the verdicts below the answer state the same tests; one stated twice counts once): "
        "their p-values are Holm-adjusted among themselves only, and each interval printed "
        "beside them is simultaneous over the family (Bonferroni, 95% together), so an "
        "interval that excludes 0 always goes with a rejection; where Holm's later steps "
        "reject though the interval still touches 0, the line says so. The secondary family "
        f"is the {cmp.secondary} matched per-rung comparisons, Holm-adjusted and "
        "simultaneous among themselves, labelled as such. A cell's own interval (the score "
        "tables) is an unadjusted 95% t interval over its runs. A cell is called the winner "
        "only when it is ahead of every other cell after the adjustment. Each comparison names "
        "what is held equal and what is not. With one run per cell there is no between-run "
        'interval and no winner, only which cell did better in this run. "Not '
        'distinguishable" is not "equal": the answer\'s detectable column gives the '
        "smallest difference these runs could find. A test whose Holm-adjusted p is within a "
        f'factor {verdicts.BORDERLINE:g} of 0.05 (from 0.025 to 0.1) is "borderline" and not '
        "called either way: the same study on another host moved such p-values by up to 1.6x, "
        'enough to cross 0.05 (docs/results-smoke.md, "What is reproducible").',
        "",
    ]
