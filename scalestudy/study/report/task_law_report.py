"""A study's zero-shot task laws: the fits with the largest-size backtest for every cell and
task with a task loss, and the report's section on them, saying why any was not fitted.

The laws themselves live in `scaling/task_law.py`; this module decides what a study fits
and how its report reads.
"""

from __future__ import annotations

import os
from typing import Any

from scalestudy.evaluate.fewshot import in_context_results
from scalestudy.scaling import render
from scalestudy.scaling.table import RunTable, ScalingDataError
from scalestudy.scaling.task_law import fit_task_laws, task_names

# With one seed the sizes are the points: the default law of task loss in N,
# L_t = (N_c / N)^alpha + E, has three parameters and needs one point more; the backtest
# fits the same law without the largest size.
MIN_SIZES_FIT = 4
# Runs x bootstrap resamples from which the cells' task laws are fitted in parallel processes
# (the main job: 57 runs x 100); below it, one process (a tiny study's fits take under a
# second, less than starting a process).
PARALLEL_WORK = 2000
MIN_SIZES_BACKTEST = MIN_SIZES_FIT + 1
NO_TASK_LOSS = (
    "no run has a task loss (eval/<task>/task_loss) beside its accuracy: no zero-shot task "
    "was scored, or the runs were scored before the evaluator recorded task losses"
)


def zero_shot_tasks(names: list[str]) -> list[str]:
    """The task names (and `<task>/<group>`s) a study fits laws for: a task scored with
    demonstrations belongs to the in-context section, its zero-shot row included."""
    in_context = in_context_results(n.split("/")[0] for n in names)
    return [n for n in names if n.split("/")[0] not in in_context]


def study_task_laws(table: RunTable, settings: Any) -> dict[str, Any]:
    """Task laws (task loss, then a sigmoid to accuracy) of every cell and zero-shot task,
    each with the backtest of its largest size; {"skipped": why} when no task has a task
    loss."""
    tasks = zero_shot_tasks(task_names(table))
    if not tasks:
        return {"skipped": NO_TASK_LOSS}
    # A main job's bootstraps (two per cell and task: the law and its backtest) take most of
    # its report's time: fit the cells two or more at a time where there is that much work.
    heavy = len(table.run_id) * settings.bootstrap >= PARALLEL_WORK
    workers = min(os.cpu_count() or 1, 4) if heavy else 1
    try:
        return fit_task_laws(table, settings, holdout_largest=True, tasks=tasks, workers=workers)
    except ScalingDataError as e:
        return {"skipped": str(e)}


def _f3(x: Any) -> str:
    return render.num(x, ".3f")


def _g3(x: Any) -> str:
    return render.num(x, ".3g")


def _step(part: dict[str, Any]) -> str:
    params = "; ".join(
        f"{k} = {_g3(p['value'])}{render.bracket(p.get('ci'), _g3)}"
        for k, p in part["params"].items()
    )
    flags = " / ".join(part["flags"])
    text = f"{part['formula']}: {params}" + (f" **flagged**: {flags}" if flags else "")
    return text.replace("|", "/")


def _backtest_rows(cells: dict[str, dict]) -> tuple[list[list[str]], list[float], int]:
    """Backtest table rows, the errors, and how many observed values fell inside the
    predicted interval."""
    rows, errors, inside = [], [], 0
    for cell, tasks in cells.items():
        for task, fit in tasks.items():
            bt = fit.get("backtest") or {}
            if "skipped" in fit or "skipped" in bt or not bt:
                continue
            errors.append(bt["error"])
            ci = bt["error_ci"]
            covered = ci is not None and ci[0] <= 0.0 <= ci[1]
            inside += covered
            rows.append(
                [
                    cell,
                    task,
                    f"{bt['N']:.3g}",
                    _f3(bt["observed"]) + render.bracket(bt.get("observed_ci"), _f3),
                    _f3(bt["predicted"]) + render.bracket(bt["predicted_ci"], _f3),
                    f"{bt['error']:+.3f}{render.bracket(ci, _f3)}"
                    + ("" if bt.get("run_df") else " (law only)"),
                    "yes" if covered else "no",
                ]
            )
    return rows, errors, inside


def _not_fitted(cells: dict[str, dict]) -> list[str]:
    """One line per cell and reason: the fits and backtests that could not be made."""
    reasons: dict[tuple[str, str, str], list[str]] = {}
    for cell, tasks in cells.items():
        for task, fit in tasks.items():
            bt = fit.get("backtest") or {}
            if "skipped" in fit:
                key = (cell, "task law", fit["skipped"].split(": ", 1)[-1])
            elif "skipped" in bt:
                key = (cell, "backtest", bt["skipped"])
            else:
                continue
            reasons.setdefault(key, []).append(task)
    return [
        f"- {cell}, {what} of {', '.join(tasks)}: {why}"
        for (cell, what, why), tasks in reasons.items()
    ]


def section(fits: dict[str, Any]) -> list[str]:
    """The report's "Zero-shot task laws" section (Markdown lines; none without fits)."""
    laws = fits.get("task_laws")
    if not fits.get("cells") and not laws:
        return []
    lines = ["## Zero-shot task laws", ""]
    if not laws or "skipped" in laws:
        reason = laws["skipped"] if laws else NO_TASK_LOSS
        return [*lines, f"Task laws were not fitted: {reason}.", ""]
    settings = fits.get("settings", {})
    ci, resamples = settings.get("ci", 0.95), laws.get("bootstrap", settings.get("bootstrap"))
    lines += [
        "Two steps per cell and task (Bhagia et al. 2024, model ladders; Llama 3): the task "
        "loss L_t, the correct answer's negative log-likelihood in nats per UTF-8 byte "
        "averaged over the task's examples (`eval/<task>/task_loss`), as a law in N (in N "
        "and D when the study varies both), then accuracy as a sigmoid of L_t (b fixed at "
        "chance). A task's groups (each synthetic probe) get laws of their own. "
        f"{ci:.0%} intervals come from {resamples} bootstrap resamples of "
        f"runs that refit both steps. With one seed a law needs {MIN_SIZES_FIT} sizes and "
        f"its backtest {MIN_SIZES_BACKTEST} (the largest is held out).",
        "",
    ]
    rows, errors, inside = _backtest_rows(laws["cells"])
    if rows:
        mean_abs = sum(abs(e) for e in errors) / len(errors)
        lines += [
            "**Backtest**: each law fitted on every size but the largest, that size's "
            "accuracy predicted; error = predicted - observed. "
            f"Mean absolute error {mean_abs:.3f} over {len(errors)} backtest(s); the "
            f"error's interval holds 0 in {inside} of them. The run is the unit: the interval "
            "holds the law's uncertainty (a bootstrap over runs) and the held-out runs' own "
            "run-to-run variation (pooled over the fitted sizes trained more than once); "
            "'law only' marks a ladder with no repeated size, whose interval is too narrow.",
            "",
            *render.table(
                ["cell", "task", "held-out N", "observed", "predicted", "error", "0 in interval"],
                rows,
            ),
            "",
        ]
    fitted = [
        [cell, task, _step(fit["task_loss"]), _step(fit["accuracy"])]
        for cell, tasks in laws["cells"].items()
        for task, fit in tasks.items()
        if "skipped" not in fit
    ]
    if fitted:
        lines += [
            "**Fits** (all sizes):",
            "",
            *render.table(["cell", "task", "task-loss law", "accuracy from task loss"], fitted),
            "",
        ]
    missing = _not_fitted(laws["cells"])
    if missing:
        lines += ["**Not fitted**:", "", *missing, ""]
    return lines
