"""The report's BLiMP section: accuracy by cell and size, per field, and the BLiMP paper's
reference models beside the largest run of each cell.

BLiMP (`evaluate/blimp.py`) records, per run, `eval/blimp/acc` and `eval/blimp/n` over all
scored pairs, `eval/blimp/<UID>/acc` per paradigm and `eval/blimp/field/<field>/acc` and
`eval/blimp/term/<term>/acc` per tag. Intervals are Wilson 95% intervals over the scored
pairs of one run: they say how well the pairs pin the accuracy, not how much a second seed
would move it. The trend test is the zero-shot section's (log-odds of a correct pair per decade
of training compute), applied to the BLiMP pairs alone.
"""

from __future__ import annotations

from pathlib import Path

from scalestudy.config.errors import ScalestudyError
from scalestudy.evaluate import blimp
from scalestudy.scaling import render
from scalestudy.scaling.zeroshot_plots import (
    TREND_TEXT,
    TaskScore,
    accuracy_trend,
    trend_cells,
    trend_head,
    wilson,
)
from scalestudy.study.record.rows import RunRow

TASK = "blimp"


def reference_dir(tasks: tuple, data_dir: str | None) -> Path | None:
    """The BLiMP directory a study's task list names (`blimp` under the evaluation data
    directory, or `blimp:PATH`), or None when the study has no BLiMP task."""
    for spec in tasks:
        head, sep, tail = str(spec).partition(":")
        if head != TASK:
            continue
        if sep:
            path = Path(tail)
            return path if path.is_dir() else path.parent
        return Path(data_dir) / TASK if data_dir else None
    return None


def _scored(runs: list[RunRow]) -> list[RunRow]:
    return [
        r
        for r in runs
        if r.evals.get(f"eval/{TASK}/acc") is not None and r.evals.get(f"eval/{TASK}/n")
    ]


def _params(run: RunRow) -> float:
    return float(run.params_non_embedding or run.params_total or 0.0)


def _fields(runs: list[RunRow]) -> list[str]:
    prefix = f"eval/{TASK}/field/"
    return sorted(
        {k[len(prefix) : -len("/acc")] for r in runs for k in r.evals if k.startswith(prefix)}
    )


def section(runs: list[RunRow], reference: Path | None) -> list[str]:
    """Markdown lines of the BLiMP section for finished `runs` (none without BLiMP results)."""
    scored = sorted(_scored(runs), key=lambda r: (r.cell, _params(r), r.seed or 0))
    if not scored:
        return []
    fields = _fields(scored)
    lines = [
        "## BLiMP",
        "",
        "Each minimal pair is scored by the log-likelihood of each sentence read whole, with no "
        "context; a pair is right when the acceptable sentence is the more probable. Chance is "
        "0.5. Brackets: Wilson 95% intervals over the run's scored pairs (one run: not a "
        "between-seed interval).",
        "",
    ]
    rows = []
    for r in scored:
        acc, n = float(r.evals[f"eval/{TASK}/acc"]), int(r.evals[f"eval/{TASK}/n"])
        lo, hi = wilson(acc * n, n)
        per_field = [r.evals.get(f"eval/{TASK}/field/{f}/acc") for f in fields]
        rows.append(
            [r.cell, r.size, r.seed, f"{_params(r):.3g}", n]
            + [f"{acc:.3f} [{lo:.3f}, {hi:.3f}]"]
            + ["-" if a is None else f"{a:.3f}" for a in per_field]
        )
    head = ["cell", "size", "seed", "N non-emb", "pairs", "overall [95%]", *fields]
    lines += [
        *render.table(head, rows),
        "",
        *_trend_lines(scored),
        *_reference_lines(scored, reference),
    ]
    return lines


def _trend_lines(scored: list[RunRow]) -> list[str]:
    scores = [
        TaskScore(
            task=TASK,
            cell=r.cell,
            size=str(r.size),
            flops=float(r.flops),
            params=_params(r),
            acc=float(r.evals[f"eval/{TASK}/acc"]),
            n=int(r.evals[f"eval/{TASK}/n"]),
            chance=0.5,
            run=str(r.run_id or f"{r.size}/{r.seed}"),
        )
        for r in scored
        if r.flops
    ]
    trend = accuracy_trend(scores)
    if not trend:
        return []
    lines = [
        "BLiMP pairs only. " + TREND_TEXT,
        "",
        *render.table(trend_head("pairs"), [trend_cells(c, t, digits=3) for c, t in trend.items()]),
    ]
    return [*lines, ""]


def _reference_lines(scored: list[RunRow], reference: Path | None) -> list[str]:
    """Per linguistics term and overall, the largest run of each cell beside the BLiMP
    paper's 5-gram, LSTM, Transformer-XL and GPT-2 (means over the paradigms we scored)."""
    if reference is None:
        return []
    largest: dict[str, RunRow] = {}
    for r in scored:
        largest[r.cell] = r  # sorted by size within a cell: the last is the largest
    tables = []
    for cell, run in largest.items():
        try:
            rows = blimp.compare_with_reference(run.evals, reference, TASK)
        except (ScalestudyError, OSError) as e:
            return [f"The BLiMP paper's models could not be read from {reference}: {e}", ""]
        rows = [row for row in rows if row["level"] != "paradigm"]
        tables.append((cell, run, rows))
    models = blimp.REFERENCE_MODELS
    lines = [
        "The BLiMP paper's models (Warstadt et al. 2020: a 5-gram model, an LSTM, "
        "Transformer-XL and GPT-2, trained on far more text) beside the largest run of each "
        "cell, per linguistics term and overall (each a mean over its paradigms).",
        "",
    ]
    head = ["term", *(f"{c} {r.size}" for c, r, _ in tables), *models]
    rows = []
    ours_by = [{(row["level"], row["name"]): row["ours"] for row in t[2]} for t in tables]
    for row in tables[0][2]:
        key = (row["level"], row["name"])
        ours = ["-" if key not in o else f"{o[key]:.3f}" for o in ours_by]
        theirs = [f"{row[m]:.3f}" for m in models]
        name = f"**{row['name']}**" if row["level"] == "overall" else row["name"]
        rows.append([name, *ours, *theirs])
    return [*lines, *render.table(head, rows), ""]
