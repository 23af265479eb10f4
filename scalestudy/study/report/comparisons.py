"""The report's verdicts between cells: for each comparison, what is held equal and what is
not, and a verdict over runs with its n.

Two families of verdicts:
- Leaders (`leader`), the answer's questions and the report's PRIMARY family: each cell is
  read at its rung nearest (in log) to the largest x (total parameters, training FLOPs, ...)
  every cell spans; values are never interpolated between rungs, so what the rungs read do
  not hold equal is named with its ratio. The cell with the best mean is tested against every
  other cell, and called the winner only when it is ahead of every other one after Holm's
  correction over the primary family. Where no x is spanned by every cell, the cells whose
  runs end lowest are left out (and named) until one is.
- Matched comparisons (`compare`), the SECONDARY family: each cell against the first cell of
  the study at the same rung and budget. A quantity counts as held equal when the two cells'
  means are within the study's `match_tolerance`; every other one is named with its ratio.

Probe accuracy is compared across all cells, validation loss only within one objective
(losses of different objectives are not comparable). The run is the unit of every interval
(`scaling/intervals.run_difference`): runs of one seed are paired, Welch on run means where
two cells share fewer than two seeds; a run's accuracy is its mean over the shared examples,
with no separate examples term. `adjust` Holm-adjusts one family and widens its intervals to
the family's Bonferroni level. With one run per side there is no between-run interval: an
accuracy interval shown is over examples only, and nothing is called a winner.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace

from scalestudy.evaluate.fewshot import in_context_tasks
from scalestudy.scaling.intervals import (
    Interval,
    accuracy_difference,
    holm,
    run_difference,
    simultaneous,
)
from scalestudy.study.plan.recipe import recipe_differences
from scalestudy.study.record.rows import RunRow, has_experts
from scalestudy.study.report import verdicts
from scalestudy.study.report.verdicts import Leader, Test

# (what, the run keys to read, first present wins)
QUANTITIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("total parameters", ("params_total",)),
    ("active parameters", ("params_active",)),
    ("training FLOPs", ("flops", "planned_flops")),
    ("document tokens", ("document_tokens", "planned_document_tokens")),
    ("positions", ("positions",)),
    ("loss-bearing tokens", ("loss_tokens", "tokens")),
    ("inference FLOPs per generated token", ("inference_flops_per_token",)),
)
# Named only where a side has routed experts (dense: the non-embedding parameters).
MOE_ONLY = frozenset({"active parameters"})


def _value(run: RunRow, keys: tuple[str, ...]) -> float | None:
    for key in keys:
        if (got := run.value(key)) is not None:
            return float(got)
    return None


def held_equal(a: list[RunRow], b: list[RunRow], tolerance: float) -> tuple[list[str], list[str]]:
    """(quantities held equal, quantities that differ as 'what (a/b = r)' or 'what (unknown)')
    between the runs `a` and `b` (each averaged over its runs)."""
    same, differ = [], []
    moe = has_experts([*a, *b])
    for what, keys in QUANTITIES:
        if what in MOE_ONLY and not moe:
            continue
        va = [v for r in a if (v := _value(r, keys)) is not None]
        vb = [v for r in b if (v := _value(r, keys)) is not None]
        if not va or not vb:
            differ.append(f"{what} (unknown)")
            continue
        ma, mb = sum(va) / len(va), sum(vb) / len(vb)
        if mb and abs(ma / mb - 1) <= tolerance:
            same.append(what)
        else:
            ratio = f"{ma / mb:.2f}x" if mb else "vs 0"
            differ.append(f"{what} ({ratio})")
    recipes = ([{"recipe": r.recipe} for r in side] for side in (a, b))
    return same, differ + recipe_differences(*recipes)


def _accuracy(run: RunRow) -> tuple[float, float] | None:
    """(accuracy, examples) over the run's evaluated tasks, zero-shot, example-weighted."""
    hits = total = 0.0
    in_context = in_context_tasks(run.evals)  # the in-context section reads those
    for key, x in run.evals.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[2] == "acc" and x is not None:
            if parts[1] in in_context:
                continue
            n = run.evals.get(f"eval/{parts[1]}/n") or 1.0
            hits += x * n
            total += n
    return (hits / total, total) if total else None


def _per_seed(runs: list[RunRow], metric: str) -> dict[int, float]:
    values = ((r, _metric(r, metric)) for r in runs)
    return {int(r.seed or 0): float(v) for r, v in values if v is not None}


def _metric(run: RunRow, metric: str) -> float | None:
    if metric == "acc":
        got = _accuracy(run)
        return got[0] if got else None
    return run.value(metric)


def compare(runs: list[RunRow], tolerance: float = 0.03, family: bool = True) -> list[Test]:
    """Every (cell vs reference) comparison at each (size, budget) among finished runs: the
    metric, its paired interval, the seeds left unpaired, what is and is not held equal, and
    (with `family`, Holm over these alone; else call `adjust` over the report's family) the
    adjusted p-value."""
    done = [r for r in runs if r.status == "done"]
    order = list(dict.fromkeys(r.cell for r in done))
    groups: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in done:
        groups[(r.size_index or 0, r.size, r.budget or "")][r.cell].append(r)
    out = []
    for (_, size, budget), cells in sorted(groups.items(), key=lambda kv: kv[0][:1] + kv[0][2:]):
        ref, *others = [c for c in order if c in cells]
        for other in others:
            a, b = cells[other], cells[ref]
            same, differ = held_equal(a, b, tolerance)
            metrics = ["acc"]
            if a[0].objective == b[0].objective:
                metrics.append("loss")
            for metric in metrics:
                pa, pb = _per_seed(a, metric), _per_seed(b, metric)
                if not pa or not pb:
                    continue
                if metric == "acc":
                    examples = int(min(_accuracy(r)[1] for r in a + b if _accuracy(r)))
                    interval, unpaired = accuracy_difference(pa, pb, examples)
                else:
                    interval, unpaired = run_difference(pa, pb)
                test = Test(other, ref, metric, interval, unpaired, same, differ, size, budget)
                out.append(test)
    if family:
        out, _ = adjust(out, "secondary")
    return out


def adjust(tests: list[Test], name: str = "primary", level: float = 0.95) -> tuple[list[Test], int]:
    """Holm-adjust, as one family (`name`), the tests that have a between-run interval (two or
    more runs a side): each gets `p_holm`, `family` (name, size) and `shown`, its interval
    widened to the family's Bonferroni level (`intervals.simultaneous`), so that a shown
    interval excluding 0 always goes with a rejection. A hypothesis stated twice (the same two
    cells on the same metric and the same per-run values, e.g. at equal parameters and at
    equal compute on a one-rung ladder) counts once. Returns the tests, adjusted, in their
    order, and the family's size."""
    distinct: dict[tuple, list[int]] = defaultdict(list)
    for i, c in enumerate(tests):
        iv = c.interval
        if iv.between_runs and iv.seeds > 1:
            pair = frozenset((c.cell, c.reference))
            key = (pair, c.metric, round(abs(iv.mean), 12), round(iv.p_value, 12), iv.seeds)
            distinct[key].append(i)
    groups = list(distinct.values())
    out = list(tests)
    for group, p in zip(groups, holm([tests[g[0]].interval.p_value for g in groups]), strict=True):
        for i in group:
            wide = simultaneous(tests[i].interval, len(groups), level)
            out[i] = replace(tests[i], p_holm=p, family=(name, len(groups)), shown=wide)
    return out, len(groups)


def adjust_leaders(
    leaders: list[Leader], name: str = "primary", level: float = 0.95
) -> tuple[list[Leader], int]:
    """`adjust` over every test of `leaders` as one family; returns the leaders, in their
    order, with their tests adjusted and their verdict lines (`leader_lines`), and the
    family's size."""
    tests, size = adjust([t for got in leaders for t in got.tests], name, level)
    out = []
    for got in leaders:
        mine, tests = tests[: len(got.tests)], tests[len(got.tests) :]
        got = replace(got, tests=mine)
        out.append(replace(got, verdict=leader_lines(got, level)))
    return out, size


def shown(c: Test) -> str:
    """A test's interval as printed beside its verdict: simultaneous at its family's level once
    adjusted (and said so), else the unadjusted 95% one, labelled."""
    iv = c.shown or c.interval
    if c.family is None:
        return iv.describe() + (", unadjusted 95%" if iv.between_runs and iv.seeds > 1 else "")
    name, m = c.family
    return f"{iv.describe()}, {iv.level:.4g} simultaneous over the {name} family of {m}"


def _verdict(c: Test, level: float) -> str:
    iv = c.interval
    if c.p_holm is None:
        if iv.between_runs:  # one seed, loss: no interval at all
            return "one seed per side: no between-run interval, so no verdict"
        return (
            "one seed per side: this interval is over examples only, not a between-run "
            "interval (it says nothing about retraining), so no verdict"
        )
    said = verdicts.word(c, c.metric == "acc", level)
    return f"Holm-adjusted p = {c.p_holm:.3g}: {said}{verdicts.why(c, level)}"


def lines(
    runs: list[RunRow],
    tolerance: float = 0.03,
    level: float = 0.95,
    found: list[Test] | None = None,
    family: int | None = None,
) -> list[str]:
    """The report section (Markdown lines); empty when no two cells share a size. `found`:
    `compare`'s comparisons, already adjusted over a family of `family` verdicts."""
    found = compare(runs, tolerance) if found is None else found
    if not found:
        return []
    n_tested = sum(c.p_holm is not None for c in found) if family is None else family
    out = [
        "## Matched comparisons",
        "",
        "Each cell against the study's first cell at the same size and budget: the difference "
        "(cell minus reference) over runs (paired by seed; Welch on run means where the cells "
        "share fewer than two seeds), n beside it, and what the two cells hold equal (within "
        f"{tolerance:.0%}) and what they do not. The verdicts below are the report's "
        f"secondary family of {n_tested}: their p-values are Holm-adjusted among themselves "
        "(not with the answer's), and each interval is simultaneous over that family "
        "(Bonferroni), so one that excludes 0 goes with a rejection.",
        "",
    ]
    for c in found:
        what = "probe accuracy" if c.metric == "acc" else "validation loss"
        at = f"{c.size}" + (f" {c.budget}" if c.budget else "")
        out.append(
            f"- **{c.cell}** vs {c.reference} at {at}, {what}: {shown(c)}; {_verdict(c, level)}."
        )
        out.append(f"  Held equal: {', '.join(c.held_equal) or 'nothing'}.")
        if c.not_equal:
            out.append(f"  Not equal ({c.cell} / {c.reference}): {', '.join(c.not_equal)}.")
        if c.unpaired:
            out.append(f"  Seeds {c.unpaired} have no partner on the other side and are left out.")
    return [*out, ""]


# ----------------------------------------------------------------------------- leaders


def leader(
    runs: list[RunRow],
    x_key: str,
    metric: str,
    tolerance: float = 0.03,
    higher: bool | None = None,
) -> Leader | None:
    """The cells' `metric` ("acc", "loss", or any run key: a per-run number, `higher` saying
    which way is better) where the runs are: each cell is read at its rung (runs within
    `tolerance` in `x_key`) nearest in log to the largest x every cell spans, never between
    rungs; the cell with the best mean (the leader) and its test against every other cell
    (leader minus other, runs as the unit, with what the rungs read hold equal and what not:
    an x that differs is named with its ratio). `read`: cell -> the x its rung is at. None
    when fewer than two cells have values. Verdicts come after `adjust` (`leader_lines`)."""
    by_cell: dict[str, list[RunRow]] = defaultdict(list)
    for r in runs:
        if r.status == "done" and r.value(x_key) and _metric(r, metric) is not None:
            by_cell[r.cell].append(r)
    x, left_out = _common_x(by_cell, x_key)
    if x is None:
        return None
    per_seed, at, read = _read_rungs(by_cell, x_key, x, tolerance, metric)
    higher = metric == "acc" if higher is None else higher
    mean = {c: sum(v.values()) / len(v) for c, v in per_seed.items()}
    ranked = sorted(mean, key=lambda c: -mean[c] if higher else mean[c])
    examples = 0
    if metric == "acc":
        examples = int(min(_accuracy(r)[1] for rows in by_cell.values() for r in rows))
    best = ranked[0]
    tests = [
        _leader_test(best, other, per_seed, at, metric, examples, tolerance) for other in ranked[1:]
    ]
    return Leader(
        leader=best,
        higher=higher,
        tests=tests,
        at=x,
        scores={c: _score(per_seed[c], examples) for c in ranked},
        means=mean,
        read=read,
        quantities=at,  # cell -> its rung's mean of each of QUANTITIES
        left_out=sorted(left_out),
    )


def _read_rungs(
    by_cell: dict[str, list[RunRow]], x_key: str, x: float, tolerance: float, metric: str
) -> tuple[dict[str, dict[int, float]], dict[str, RunRow], dict[str, float]]:
    """Each cell read at its rung nearest `x`: (cell -> seed -> `metric`, cell -> its rung's
    quantities, cell -> the rung's mean `x_key`)."""
    per_seed: dict[str, dict[int, float]] = {}
    at: dict[str, RunRow] = {}
    read: dict[str, float] = {}
    for cell, rows in by_cell.items():
        rung = _nearest_rung(rows, x_key, x, tolerance)
        seeds: dict[int, list[float]] = defaultdict(list)
        for r in rung:  # several runs of one seed on one rung (e.g. budgets): their mean
            seeds[int(r.seed or 0)].append(_metric(r, metric))
        per_seed[cell] = {s: sum(v) / len(v) for s, v in seeds.items()}
        at[cell] = _quantities(rung)
        read[cell] = sum(float(r.value(x_key)) for r in rung) / len(rung)
    return per_seed, at, read


def _leader_test(
    best: str,
    other: str,
    per_seed: dict[str, dict[int, float]],
    at: dict[str, RunRow],
    metric: str,
    examples: int,
    tolerance: float,
) -> Test:
    """The leader `best` against `other`: the difference's interval, and what the two rungs
    read hold equal and what not."""
    if metric == "acc":
        interval, unpaired = accuracy_difference(per_seed[best], per_seed[other], examples)
    else:
        interval, unpaired = run_difference(per_seed[best], per_seed[other])
    same, differ = held_equal([at[best]], [at[other]], tolerance)
    return Test(best, other, metric, interval, unpaired, same, differ)


def _common_x(by_cell: dict[str, list[RunRow]], x_key: str) -> tuple[float | None, list]:
    """The largest x every cell spans; where none is, the cells whose runs end lowest are left
    out (returned) until one is. None with fewer than two cells left."""
    left_out = []
    while len(by_cell) >= 2:
        lo = max(min(float(r.value(x_key)) for r in rows) for rows in by_cell.values())
        x = min(max(float(r.value(x_key)) for r in rows) for rows in by_cell.values())
        if lo <= x:
            return x, left_out
        low = min(by_cell, key=lambda c: max(float(r.value(x_key)) for r in by_cell[c]))
        left_out.append(low)
        del by_cell[low]
    return None, left_out


def _nearest_rung(rows: list[RunRow], x_key: str, x: float, tolerance: float) -> list[RunRow]:
    """The runs of one cell at its x value nearest `x` in log (runs within `tolerance` of each
    other in x are one rung: seeds and budgets of one size)."""
    rungs: list[list[RunRow]] = []
    for r in sorted(rows, key=lambda r: float(r.value(x_key))):
        if rungs and float(r.value(x_key)) <= float(rungs[-1][0].value(x_key)) * (1 + tolerance):
            rungs[-1].append(r)
        else:
            rungs.append([r])

    def distance(rung: list[RunRow]) -> float:
        return abs(math.log(sum(float(r.value(x_key)) for r in rung) / len(rung) / x))

    return min(rungs, key=distance)


def _quantities(rows: list[RunRow]) -> RunRow:
    """Each of QUANTITIES as the mean over `rows` (one rung), as a record (with the most
    routed experts of `rows`) for `held_equal`."""
    means: dict[str, float] = {}
    for _, keys in QUANTITIES:
        if values := [v for r in rows if (v := _value(r, keys)) is not None]:
            means[keys[0]] = sum(values) / len(values)
    return RunRow("", experts=max((r.experts or 1) for r in rows), **means)


def _score(values: dict[int, float], examples: int) -> Interval:
    """A cell's mean over runs with its unadjusted 95% t interval over runs (for accuracy, each
    run's mean over the shared `examples`: the run is the unit, no examples term)."""
    got, _ = run_difference(values, dict.fromkeys(values, 0.0), examples=examples or None)
    return got


def leader_lines(found: Leader, level: float = 0.95) -> list[str]:
    """The verdict on a `leader` result (after `adjust`): a headline sentence, then one line
    per paired test with its interval, n, Holm-adjusted p and what is held equal."""
    best, tests = found.leader, found.tests
    more = found.more or ("higher accuracy" if found.higher else "lower loss")
    if not tests:
        return [f"no cell shares a seed with {best}, so nothing is compared."]
    tested = [t for t in tests if t.p_holm is not None]
    said = {id(t): verdicts.outcome(t.interval.mean, t.p_holm, found.higher, level) for t in tested}
    ahead = [t for t in tested if said[id(t)] == "better"]
    near = [t.reference for t in tested if said[id(t)] == "borderline"]
    if not tested:
        head = (
            f"one seed: {best} had the {more} in this run; with no between-run interval no "
            "winner is named."
        )
    elif len(ahead) == len(tests):
        head = f"**{best}** is ahead of every other cell (Holm-adjusted p < {1 - level:.2g})."
    else:
        behind = [t.reference for t in tests if t not in ahead and t.reference not in near]
        against = [f"is not distinguishable from {', '.join(behind)}"] if behind else []
        if near:  # verdicts.borderline: too near the level to hold across hosts
            against.append(f"is borderline against {', '.join(near)} (not called)")
        head = (
            f"no winner: {best} has the {'highest' if found.higher else 'lowest'} mean but "
            f"{' and '.join(against)}."
        )
    out = [head]
    if found.left_out:
        why = found.why_left_out or "their runs end below this x"
        out.append(f"  - Left out ({why}): {', '.join(found.left_out)}.")
    for t in tests:
        iv = t.interval
        if t.p_holm is not None:
            p = f"Holm-adjusted p = {t.p_holm:.3g}"
        elif iv.between_runs:
            p = "one seed per side: no between-run interval"
        else:
            p = "one seed per side: an interval over examples only, not between runs"
        line = f"  - {best} minus {t.reference}: {shown(t)}; {p}{verdicts.why(t, level)}."
        line += f" Held equal: {', '.join(t.held_equal) or 'nothing'}."
        if t.not_equal:
            line += f" Not equal ({best} / {t.reference}): {', '.join(t.not_equal)}."
        if t.unpaired:
            line += f" Seeds {t.unpaired} have no partner and are left out."
        out.append(line)
    return out
