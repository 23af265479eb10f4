"""The report's verdicts between cells: for each comparison, what is held equal and what is
not, and a paired verdict with its n.

Two kinds of comparison, one family of verdicts:
- Matched comparisons (`compare`): each cell against the first cell of the study at the same
  rung and budget (its reference). A quantity counts as held equal when the two cells' means
  are within the study's `match_tolerance` of each other; every other quantity is named with
  its ratio, so a comparison that also differs in data, parameters or compute says so.
- Leaders at a common x (`leader`): at the largest total parameters (or training FLOPs) every
  cell spans, each seed's value is interpolated in log x between that seed's rungs, and the
  cell with the best mean is tested against every other cell, paired by seed. It is called
  the winner only when it is ahead of every other cell after Holm's correction. Where no x
  is spanned by every cell, the cells whose runs end lowest are left out (and named) until
  one is. The other
  quantities are interpolated at the same x, so what is not held equal is named too.

Probe accuracy is compared across all cells, validation loss only within one objective
(losses of different objectives are not comparable). Runs with the same seed are paired: the
interval is on the per-seed differences (scaling/intervals.py). All the verdicts of a report
are one family: `adjust` Holm-adjusts their p-values together. With one seed per side there
is no between-run interval: an accuracy interval shown is over examples only, and nothing is
called a winner beyond "higher accuracy / lower loss in this run".
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from typing import Any

from scalestudy.evaluate.fewshot import in_context_tasks
from scalestudy.scaling.intervals import (
    Interval,
    accuracy_difference,
    accuracy_interval,
    holm,
    paired_difference,
)
from scalestudy.scaling.io import cell_label as label  # the cell, with its variant
from scalestudy.scaling.io import has_experts
from scalestudy.study import verdicts
from scalestudy.study.recipe import recipe_differences

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


def _value(run: dict[str, Any], keys: tuple[str, ...]) -> float | None:
    for key in keys:
        if run.get(key) is not None:
            return float(run[key])
    return None


def held_equal(
    a: list[dict[str, Any]], b: list[dict[str, Any]], tolerance: float
) -> tuple[list[str], list[str]]:
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
    return same, differ + recipe_differences(a, b)


def _accuracy(run: dict[str, Any]) -> tuple[float, float] | None:
    """(accuracy, examples) over the run's evaluated tasks, zero-shot, example-weighted."""
    hits = total = 0.0
    in_context = in_context_tasks(run)  # the in-context section reads those
    for key, x in run.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "eval" and parts[2] == "acc" and x is not None:
            if parts[1] in in_context:
                continue
            n = run.get(f"eval/{parts[1]}/n") or 1.0
            hits += x * n
            total += n
    return (hits / total, total) if total else None


def _per_seed(runs: list[dict[str, Any]], metric: str) -> dict[int, float]:
    out = {}
    for r in runs:
        if metric == "acc":
            got = _accuracy(r)
            value = got[0] if got else None
        else:
            value = r.get(metric)
        if value is not None:
            out[int(r.get("seed") or 0)] = float(value)
    return out


def compare(
    runs: list[dict[str, Any]], tolerance: float = 0.03, family: bool = True
) -> list[dict[str, Any]]:
    """Every (cell vs reference) comparison at each (size, budget) among finished runs: the
    metric, its paired interval, the seeds left unpaired, what is and is not held equal, and
    (with `family`, Holm over these alone; else call `adjust` over the report's family) the
    adjusted p-value."""
    done = [r for r in runs if r.get("status") == "done"]
    order = list(dict.fromkeys(label(r) for r in done))
    groups: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in done:
        groups[(r.get("size_index") or 0, r.get("size"), r.get("budget") or "")][label(r)].append(r)
    out = []
    for (_, size, budget), cells in sorted(groups.items(), key=lambda kv: kv[0][:1] + kv[0][2:]):
        ref, *others = [c for c in order if c in cells]
        for other in others:
            a, b = cells[other], cells[ref]
            same, differ = held_equal(a, b, tolerance)
            metrics = ["acc"]
            if a[0]["objective"] == b[0]["objective"]:
                metrics.append("loss")
            for metric in metrics:
                pa, pb = _per_seed(a, metric), _per_seed(b, metric)
                if not set(pa) & set(pb):
                    continue
                if metric == "acc":
                    examples = int(min(_accuracy(r)[1] for r in a + b if _accuracy(r)))
                    interval, unpaired = accuracy_difference(pa, pb, examples)
                else:
                    interval, unpaired = paired_difference(pa, pb)
                out.append(
                    {
                        "size": size,
                        "budget": budget,
                        "cell": other,
                        "reference": ref,
                        "metric": metric,
                        "interval": interval,
                        "unpaired": unpaired,
                        "held_equal": same,
                        "not_equal": differ,
                    }
                )
    if family:
        adjust(out)
    return out


def adjust(tests: list[dict[str, Any]]) -> int:
    """Holm-adjust, as one family, the tests that have a between-run interval (two or more
    paired seeds): each gets `p_holm`. A hypothesis stated twice (the same two cells on the
    same metric and the same per-seed values, e.g. at equal parameters and at equal compute
    on a one-rung ladder, or a leader's test that is also a matched comparison) counts once.
    Returns the family's size (distinct hypotheses)."""
    tested = [c for c in tests if c["interval"].between_runs and c["interval"].seeds > 1]
    distinct: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for c in tested:
        iv = c["interval"]
        pair = frozenset((c["cell"], c["reference"]))
        key = (pair, c["metric"], round(abs(iv.mean), 12), round(iv.p_value, 12), iv.seeds)
        distinct[key].append(c)
    groups = list(distinct.values())
    for group, p in zip(groups, holm([g[0]["interval"].p_value for g in groups]), strict=True):
        for c in group:
            c["p_holm"] = p
    return len(groups)


def _verdict(c: dict[str, Any], level: float) -> str:
    iv: Interval = c["interval"]
    if "p_holm" not in c:
        if iv.between_runs:  # one seed, loss: no interval at all
            return "one seed per side: no between-run interval, so no verdict"
        return (
            "one seed per side: this interval is over examples only, not a between-run "
            "interval (it says nothing about retraining), so no verdict"
        )
    return f"Holm-adjusted p = {c['p_holm']:.3g}: {verdicts.word(c, c['metric'] == 'acc', level)}"


def lines(
    runs: list[dict[str, Any]],
    tolerance: float = 0.03,
    level: float = 0.95,
    found: list[dict[str, Any]] | None = None,
    family: int | None = None,
) -> list[str]:
    """The report section (Markdown lines); empty when no two cells share a size. `found`:
    `compare`'s comparisons, already adjusted over a family of `family` verdicts."""
    found = compare(runs, tolerance) if found is None else found
    if not found:
        return []
    n_tested = sum("p_holm" in c for c in found) if family is None else family
    out = [
        "## Matched comparisons",
        "",
        "Each cell against the study's first cell at the same size and budget: the difference "
        "(cell minus reference) with its 95% interval over per-seed differences (runs of one "
        "seed are paired), n beside it, and what the two cells hold equal (within "
        f"{tolerance:.0%}) and what they do not. The verdicts below belong to a family of "
        f"{n_tested}: their p-values are Holm-adjusted.",
        "",
    ]
    for c in found:
        what = "probe accuracy" if c["metric"] == "acc" else "validation loss"
        at = f"{c['size']}" + (f" {c['budget']}" if c["budget"] else "")
        out.append(
            f"- **{c['cell']}** vs {c['reference']} at {at}, {what}: "
            f"{c['interval'].describe()}; {_verdict(c, level)}."
        )
        out.append(f"  Held equal: {', '.join(c['held_equal']) or 'nothing'}.")
        if c["not_equal"]:
            out.append(
                f"  Not equal ({c['cell']} / {c['reference']}): {', '.join(c['not_equal'])}."
            )
        if c["unpaired"]:
            out.append(
                f"  Seeds {c['unpaired']} have no partner on the other side and are left out."
            )
    return [*out, ""]


# ----------------------------------------------------------------------------- leaders


def interpolate(points: list[tuple[float, float]], x: float, log_y: bool = False) -> float | None:
    """y at `x` from (x, y) points, linear in log x between the two around it (and in log y
    with `log_y`); None outside their range."""
    pts = sorted(p for p in points if p[0] > 0 and (p[1] > 0 or not log_y))
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if x0 <= x <= x1:
            w = 0.0 if x1 == x0 else (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            if log_y:
                return math.exp((1 - w) * math.log(y0) + w * math.log(y1))
            return (1 - w) * y0 + w * y1
    if pts and math.isclose(pts[-1][0], x):
        return pts[-1][1]
    return None


def _metric(run: dict[str, Any], metric: str) -> float | None:
    if metric == "acc":
        got = _accuracy(run)
        return got[0] if got else None
    return run.get(metric)


def leader(
    runs: list[dict[str, Any]],
    x_key: str,
    metric: str,
    tolerance: float = 0.03,
    higher: bool | None = None,
) -> dict[str, Any] | None:
    """The cells' `metric` ("acc", "loss", or any run key: a per-run number, `higher` saying
    which way is better) at the largest `x_key` every cell spans, each seed's value
    interpolated in log x between that seed's runs; the cell with the best mean (the leader)
    and its paired test against every other cell (leader minus other, with what is held equal
    at that x). None when fewer than two cells have values. Verdicts come after `adjust`
    (`leader_lines`)."""
    by_cell: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        if r.get("status") == "done" and r.get(x_key) and _metric(r, metric) is not None:
            by_cell[label(r)].append(r)
    left_out = []
    while len(by_cell) >= 2:
        lo = max(min(float(r[x_key]) for r in rows) for rows in by_cell.values())
        x = min(max(float(r[x_key]) for r in rows) for rows in by_cell.values())
        if lo <= x:
            break
        # No x that every cell spans: leave out the cell whose runs end lowest (named).
        low = min(by_cell, key=lambda c: max(float(r[x_key]) for r in by_cell[c]))
        left_out.append(low)
        del by_cell[low]
    if len(by_cell) < 2:
        return None
    per_seed: dict[str, dict[int, float]] = {}
    for cell, rows in by_cell.items():
        seeds: dict[int, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in rows:  # several runs of one seed at one x (e.g. budgets): their mean
            seeds[int(r.get("seed") or 0)][float(r[x_key])].append(_metric(r, metric))
        got = {}
        for s, by_x in seeds.items():
            pts = [(px, sum(vs) / len(vs)) for px, vs in by_x.items()]
            if (v := interpolate(pts, x)) is not None:
                got[s] = v
        if got:
            per_seed[cell] = got
    if len(per_seed) < 2:
        return None
    higher = metric == "acc" if higher is None else higher
    mean = {c: sum(v.values()) / len(v) for c, v in per_seed.items()}
    ranked = sorted(mean, key=lambda c: -mean[c] if higher else mean[c])
    examples = 0
    if metric == "acc":
        examples = int(min(_accuracy(r)[1] for rows in by_cell.values() for r in rows))
    scores = {c: _score(per_seed[c], metric, examples) for c in ranked}
    at = {c: _quantities_at(by_cell[c], x_key, x) for c in ranked}
    best, tests = ranked[0], []
    for other in ranked[1:]:
        if metric == "acc":
            interval, unpaired = _paired(
                accuracy_difference, per_seed[best], per_seed[other], examples
            )
        else:
            interval, unpaired = _paired(paired_difference, per_seed[best], per_seed[other])
        if interval is None:
            continue
        same, differ = held_equal([at[best]], [at[other]], tolerance)
        tests.append(
            {
                "cell": best,
                "reference": other,
                "metric": metric,
                "interval": interval,
                "unpaired": unpaired,
                "held_equal": same,
                "not_equal": differ,
            }
        )
    return {
        "at": x,
        "leader": best,
        "scores": scores,
        "tests": tests,
        "higher": higher,
        "left_out": sorted(left_out),
    }


def _paired(fn, a: dict[int, float], b: dict[int, float], *args):
    if not set(a) & set(b):
        return None, sorted(set(a) ^ set(b))
    return fn(a, b, *args)


def _score(values: dict[int, float], metric: str, examples: int) -> Interval:
    """A cell's mean over seeds with its 95% interval (seeds and, for accuracy, examples)."""
    if metric == "acc":
        return accuracy_interval(list(values.values()), examples)
    got, _ = paired_difference(values, dict.fromkeys(values, 0.0))
    return got


def _quantities_at(rows: list[dict[str, Any]], x_key: str, x: float) -> dict[str, float]:
    """Each of QUANTITIES at `x` (seed means per x, interpolated in log-log), as a run dict
    (with the most routed experts of `rows`)."""
    out: dict[str, float] = {"experts": max((r.get("experts") or 1) for r in rows)}
    for _, keys in QUANTITIES:
        points: dict[float, list[float]] = defaultdict(list)
        for r in rows:
            if (v := _value(r, keys)) is not None:
                points[float(r[x_key])].append(v)
        pts = [(px, sum(vs) / len(vs)) for px, vs in points.items()]
        if (v := interpolate(pts, x, log_y=True)) is not None:
            out[keys[0]] = v
    return out


def leader_lines(found: dict[str, Any], level: float = 0.95) -> list[str]:
    """The verdict on a `leader` result (after `adjust`): a headline sentence, then one line
    per paired test with its interval, n, Holm-adjusted p and what is held equal."""
    best, tests = found["leader"], found["tests"]
    more = found.get("more") or ("higher accuracy" if found["higher"] else "lower loss")
    if not tests:
        return [f"no cell shares a seed with {best}, so nothing is compared."]
    tested = [t for t in tests if "p_holm" in t]
    ahead = [
        t for t in tested if t["p_holm"] < 1 - level and (t["interval"].mean > 0) == found["higher"]
    ]
    if not tested:
        head = (
            f"one seed: {best} had the {more} in this run; with no between-run interval no "
            "winner is named."
        )
    elif len(ahead) == len(tests):
        head = f"**{best}** is ahead of every other cell (Holm-adjusted p < {1 - level:.2g})."
    else:
        behind = [t["reference"] for t in tests if t not in ahead]
        head = (
            f"no winner: {best} has the {'highest' if found['higher'] else 'lowest'} mean but "
            f"is not distinguishable from {', '.join(behind)}."
        )
    out = [head]
    if found.get("left_out"):
        out.append(f"  - Left out (their runs end below this x): {', '.join(found['left_out'])}.")
    for t in tests:
        iv: Interval = t["interval"]
        if "p_holm" in t:
            p = f"Holm-adjusted p = {t['p_holm']:.3g}"
        elif iv.between_runs:
            p = "one seed per side: no between-run interval"
        else:
            p = "one seed per side: an interval over examples only, not between runs"
        line = f"  - {best} minus {t['reference']}: {iv.describe()}; {p}."
        line += f" Held equal: {', '.join(t['held_equal']) or 'nothing'}."
        if t["not_equal"]:
            line += f" Not equal ({best} / {t['reference']}): {', '.join(t['not_equal'])}."
        if t["unpaired"]:
            line += f" Seeds {t['unpaired']} have no partner and are left out."
        out.append(line)
    return out
