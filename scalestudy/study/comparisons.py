"""The report's matched comparisons: for each pair of cells at one size and budget, what is
held equal and what is not, and a paired verdict with its n.

Each cell is compared with the first cell of the study at the same rung and budget (its
reference). A quantity counts as held equal when the two cells' means are within the
study's `match_tolerance` of each other; every other quantity is named with its ratio, so a
comparison that also differs in data, parameters or compute says so. Probe accuracy is
compared across all cells, validation loss only within one objective (losses of different
objectives are not comparable). Runs with the same seed are paired: the interval is on the
per-seed differences (scaling/intervals.py). The verdicts of the section are one family:
their p-values are Holm-adjusted. With one seed per side there is no between-run interval;
the accuracy interval shown is over examples only and gets no verdict.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from scalestudy.scaling.intervals import Interval, accuracy_difference, holm, paired_difference

# (what, the run keys to read, first present wins)
QUANTITIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("total parameters", ("params_total",)),
    ("training FLOPs", ("flops", "planned_flops")),
    ("document tokens", ("document_tokens", "planned_document_tokens")),
    ("positions", ("positions",)),
    ("loss-bearing tokens", ("loss_tokens", "tokens")),
    ("inference FLOPs per generated token", ("inference_flops_per_token",)),
)


def label(run: dict[str, Any]) -> str:
    """The run's cell, with its variant when it has one ("arch/objective[/variant]")."""
    parts = str(run.get("name") or "").split(".")[1:]  # study.arch.objective[.variant]...
    variant = parts[2] if len(parts) > 2 and parts[2] != run.get("size") else ""
    cell = f"{run['arch']}/{run['objective']}"
    return f"{cell}/{variant}" if variant else cell


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
    for what, keys in QUANTITIES:
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
    return same, differ


def _accuracy(run: dict[str, Any]) -> tuple[float, float] | None:
    """(accuracy, examples) over the run's evaluated tasks, example-weighted."""
    hits = total = 0.0
    for key, x in run.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "eval" and parts[2] == "acc" and x is not None:
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


def compare(runs: list[dict[str, Any]], tolerance: float = 0.03) -> list[dict[str, Any]]:
    """Every (cell vs reference) comparison at each (size, budget) among finished runs: the
    metric, its paired interval, the seeds left unpaired, what is and is not held equal, and
    (after Holm over the family) the adjusted p-value."""
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
    tested = [c for c in out if c["interval"].between_runs and c["interval"].seeds > 1]
    for c, p in zip(tested, holm([c["interval"].p_value for c in tested]), strict=True):
        c["p_holm"] = p
    return out


def _verdict(c: dict[str, Any], level: float) -> str:
    iv: Interval = c["interval"]
    if "p_holm" not in c:
        if iv.between_runs:  # one seed, loss: no interval at all
            return "one seed per side: no between-run interval, so no verdict"
        return (
            "one seed per side: this interval is over examples only, not a between-run "
            "interval (it says nothing about retraining), so no verdict"
        )
    higher_better = c["metric"] == "acc"
    if c["p_holm"] >= 1 - level:
        verdict = "not distinguishable"
    else:
        better = (iv.mean > 0) == higher_better
        verdict = f"{c['cell']} {'better' if better else 'worse'}"
    return f"Holm-adjusted p = {c['p_holm']:.3g}: {verdict}"


def lines(runs: list[dict[str, Any]], tolerance: float = 0.03, level: float = 0.95) -> list[str]:
    """The report section (Markdown lines); empty when no two cells share a size."""
    found = compare(runs, tolerance)
    if not found:
        return []
    n_tested = sum("p_holm" in c for c in found)
    out = [
        "## Matched comparisons",
        "",
        "Each cell against the study's first cell at the same size and budget: the difference "
        "(cell minus reference) with its 95% interval over per-seed differences (runs of one "
        "seed are paired), n beside it, and what the two cells hold equal (within "
        f"{tolerance:.0%}) and what they do not. The {n_tested} verdicts below are one "
        "family: their p-values are Holm-adjusted.",
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
