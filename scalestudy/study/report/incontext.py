"""In-context learning in a study's report: accuracy against the number of demonstrations per
cell, and the in-context gain compared across cells.

A task scored with demonstrations (`eval.num_fewshot`, results `<task>.<K>shot/acc` beside the
zero-shot `<task>/acc`) gives every run a curve over K. A run's **in-context gain** is its
accuracy at the largest K minus its zero-shot accuracy: one number per run, so the run is the
unit of every interval (`intervals.run_difference`: paired by seed, Welch on run means
otherwise; no examples term, since the scored items are shared and their noise is in each
run's gain). Cells are compared on it as on probe accuracy (`comparisons.leader`, at equal
parameters and at equal compute), and the tests join the answer's primary Holm family. The
claim under test (decoder-only models gain more from demonstrations than encoder-decoders or
prefix LMs) is answered by whichever cell leads, with its interval.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import replace

from scalestudy.scaling import render
from scalestudy.study.record.rows import RunRow
from scalestudy.study.report import comparisons
from scalestudy.study.report.verdicts import Leader

_SHOTS = re.compile(r"^eval/(?P<task>.+)\.(?P<k>\d+)shot/acc$")


def curves(run: RunRow) -> dict[str, dict[int, float]]:
    """task -> {K: accuracy} of one run, for tasks scored with demonstrations (K = 0 is the
    zero-shot row)."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for key, value in run.evals.items():
        if value is not None and (m := _SHOTS.match(key)):
            out[m["task"]][int(m["k"])] = float(value)
    for task, by_k in out.items():
        if (zero := run.evals.get(f"eval/{task}/acc")) is not None:
            by_k[0] = float(zero)
    return dict(out)


def gain_key(task: str) -> str:
    return f"incontext_gain/{task}"


def with_gains(runs: list[RunRow]) -> tuple[list[RunRow], dict[str, int]]:
    """The runs with `incontext_gain/<task>` (accuracy at the task's largest K minus K = 0)
    set where both were scored, and task -> that K."""
    largest: dict[str, int] = {}
    for run in runs:
        for task, by_k in curves(run).items():
            if 0 in by_k and len(by_k) > 1:
                largest[task] = max(largest.get(task, 0), max(by_k))
    out = []
    for run in runs:
        gains = dict(run.derived)
        for task, by_k in curves(run).items():
            if task in largest and 0 in by_k and largest[task] in by_k:
                gains[gain_key(task)] = by_k[largest[task]] - by_k[0]
        out.append(run.replace(derived=gains))
    return out, largest


def compare(runs: list[RunRow], n_key: str, tolerance: float) -> dict[str, dict[str, Leader]]:
    """task -> {"equal_params" | "equal_compute": leader on the in-context gain} (before
    Holm's adjustment, which the report makes over the answer's primary family), and again
    as "<question>_ladder" over the cells that span the ladder where some cells have runs at
    one rung only (as the answer's other metrics: the bottom rung is not the only reading)."""
    done, largest = with_gains([r for r in runs if r.status == "done"])
    rungs: dict[str, set] = defaultdict(set)
    for r in done:
        rungs[r.cell].add(r.size_index or 0)
    one_rung = {c for c, sizes in rungs.items() if len(sizes) == 1}
    ladder = [r for r in done if r.cell not in one_rung]
    readings = [("", done)]
    if one_rung and len(rungs) - len(one_rung) >= 2:
        readings.append(("_ladder", ladder))
    out: dict[str, dict[str, Leader]] = {}
    for task, k in sorted(largest.items()):
        for suffix, rows in readings:
            for name, x_key in (("equal_params", n_key), ("equal_compute", "flops")):
                got = comparisons.leader(rows, x_key, gain_key(task), tolerance, higher=True)
                if got:
                    got = replace(got, more=f"larger {k}-shot gain", k=k)
                    if suffix:
                        left = sorted({*got.left_out, *one_rung})
                        got = replace(
                            got, left_out=left, why_left_out="their runs are at one rung only"
                        )
                    out.setdefault(task, {})[name + suffix] = got
    return out


def _mean(values: list[float]) -> str:
    return f"{sum(values) / len(values):.3f}" if values else ""


def curve_table(runs: list[RunRow], task: str) -> list[str]:
    """Mean accuracy over runs per cell and size (rows) and K (columns), with runs per row."""
    rows: dict[tuple[str, str], dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        if run.status != "done" or task not in (got := curves(run)):
            continue
        for k, acc in got[task].items():
            rows[(run.cell, str(run.size or ""))][k].append(acc)
    shots = sorted({k for by_k in rows.values() for k in by_k})
    body = [
        [cell, size, *(_mean(by_k.get(k, [])) for k in shots), str(len(by_k.get(0, [])))]
        for (cell, size), by_k in sorted(rows.items())
    ]
    return render.table(["cell", "size", *(f"K={k}" for k in shots), "runs"], body)


def shots_lines(runs: list[RunRow], task: str) -> list[str]:
    """The demonstrations each cell's prompts really held (`<task>.<K>shot/shots`, the mean
    over examples, averaged over runs): one line when every prompt held all K, else a table
    of the K where some did not (a budget or training's rows dropped some from the front)."""
    pattern = re.compile(rf"^eval/{re.escape(task)}\.(\d+)shot/shots$")
    rows: dict[tuple[str, str], dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        if run.status != "done":
            continue
        for key, value in run.evals.items():
            if value is not None and (m := pattern.match(key)):
                rows[(run.cell, str(run.size or ""))][int(m[1])].append(float(value))
    if not rows:
        return []
    short = sorted({k for by_k in rows.values() for k, v in by_k.items() if min(v) < k})
    if not short:
        return ["Every prompt held all K demonstrations it was scored with.", ""]
    body = [
        [cell, size, *(_mean(by_k.get(k, [])) for k in short)]
        for (cell, size), by_k in sorted(rows.items())
    ]
    head = "Demonstrations really shown (mean per example) where some prompts held fewer than K:"
    return [head, "", *render.table(["cell", "size", *(f"K={k}" for k in short)], body), ""]


def lines(found: dict[str, dict[str, Leader]], runs: list[RunRow]) -> list[str]:
    """The report's in-context section: per task scored with demonstrations, the curve table
    and the verdicts (after `comparisons.adjust` and `comparisons.leader_lines`), or why
    there are none."""
    done = [r for r in runs if r.status == "done"]
    tasks = sorted({t for r in done for t, by_k in curves(r).items() if len(by_k) > 1})
    if not tasks:
        return []
    out = [
        "## In-context learning",
        "",
        "Accuracy against K, the demonstrations before each question (mean over runs). A "
        "run's in-context gain is its accuracy at the largest K minus its zero-shot accuracy; "
        "the cells are compared on it with runs as the unit (paired by seed, Welch on run "
        "means otherwise), in the answer's primary Holm family.",
        "",
    ]
    for task in tasks:
        by_question = found.get(task, {})
        out += [f"**`{task}`**", "", *curve_table(runs, task), "", *shots_lines(runs, task)]
        if not by_question:
            out.append(
                "- No comparison of the gain: no two cells have runs at one parameter count "
                "or one training compute (within the report's tolerance)."
            )
        for name, title in (
            ("equal_params", "Equal parameters"),
            ("equal_compute", "Equal compute"),
            ("equal_params_ladder", "Equal parameters, the cells spanning the ladder"),
            ("equal_compute_ladder", "Equal compute, the cells spanning the ladder"),
        ):
            if got := by_question.get(name):
                verdict = got.verdict or comparisons.leader_lines(got)
                out += [
                    f"- {title} ({got.k}-shot gain at {got.at:.3g}): " + verdict[0],
                    *verdict[1:],
                ]
        out.append("")
    return out
