"""Figures of task laws (`task_law.fit_task_laws`): one figure per cell, a row per task.

Each row shows the two steps: task loss against N with the fitted law, and accuracy against
task loss with the sigmoid; where the largest size was held out, its predicted accuracy (with
the bootstrap interval) beside the observed one. No fitting here.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from scalestudy.scaling import figstyle as fs
from scalestudy.scaling.forms import get_form
from scalestudy.scaling.table import RunTable
from scalestudy.scaling.task_law import sigmoid


def fitted_tasks(fits: dict, cell: str | None = None) -> list[tuple[str, str, dict]]:
    """(cell, task, fit) of every fitted task law (of `cell` only when given)."""
    return [
        (c, task, fit)
        for c, tasks in fits.get("task_laws", {}).get("cells", {}).items()
        if cell is None or c == cell
        for task, fit in tasks.items()
        if "skipped" not in fit
    ]


def _task_loss_panel(ax, sub: RunTable, task: str, fit: dict, metric: str, style: dict) -> None:
    idx = [sub.run_id.index(r) for r in fit["runs"]]
    L = sub.extra[f"eval/{task}/{metric}"][idx]
    form = get_form(fit["task_loss"]["form"])
    cols = {"N": sub.N[idx], "D": sub.D[idx], "C": sub.C[idx]}
    theta = np.array([fit["task_loss"]["theta"]])
    ax.scatter(cols["N"], L, label="observed", edgecolor="k", lw=0.3, **style)
    label = fit["task_loss"]["formula"]
    if list(form.inputs) == ["N"]:  # a law in N alone: draw it as a curve across the sizes
        n = np.geomspace(cols["N"].min() / 1.5, cols["N"].max() * 1.5, 100)
        ax.plot(n, np.exp(form.predict(theta, np.log(n)[None])[0][0]), "k-", lw=1, label=label)
    else:  # a law in several inputs: its value at each run
        x = np.log(np.stack([cols[v] for v in form.inputs]))
        pred = np.exp(form.predict(theta, x)[0][0])
        ax.scatter(cols["N"], pred, marker="x", color="k", label=label)
    bt = fit.get("backtest")
    if bt and "skipped" not in bt:
        ax.scatter(
            [bt["N"]],
            [bt["task_loss_predicted"]],
            marker="D",
            color="r",
            label="backtest: predicted from the smaller sizes",
        )
    flagged = " (flagged)" if fit["task_loss"]["flags"] else ""
    fs.axes(ax, "parameters N", f"task loss ({metric})")
    ax.set_title(f"{task}: task loss{flagged}", fontsize=9)
    fs.legend(ax, 6)


def _accuracy_panel(ax, sub: RunTable, task: str, fit: dict, m: dict, style: dict) -> None:
    idx = [sub.run_id.index(r) for r in fit["runs"]]
    L = sub.extra[f"eval/{task}/{m['task_loss']}"][idx]
    acc = sub.extra[f"eval/{task}/{m['accuracy']}"][idx]
    p = np.array([fit["accuracy"]["params"][k]["value"] for k in ("L0", "k", "a", "b")])
    bt = fit.get("backtest") or {}
    lo = min(L.min(), bt.get("task_loss_predicted", np.inf))
    hi = max(L.max(), bt.get("task_loss_predicted", -np.inf))
    grid = np.linspace(lo - 0.1 * (hi - lo), hi + 0.1 * (hi - lo), 200)
    ax.scatter(L, acc, edgecolor="k", lw=0.3, label="runs", **style)
    ax.plot(grid, sigmoid(grid, p), color="k", lw=1.0, label="sigmoid fit")
    chance = fit["accuracy"].get("chance_fixed")
    if chance is not None:
        ax.axhline(chance, color="0.5", ls=":", lw=1, label=f"chance {chance:.3g}")
    if bt and "skipped" not in bt:
        x, ci = bt["task_loss_predicted"], bt["predicted_ci"]
        if ci is not None:  # drawn from its ends: a percentile interval need not hold the point
            ax.vlines(x, ci[0], ci[1], color="r", lw=1.0, gid="backtest_interval")
        ax.scatter(
            [x],
            [bt["predicted"]],
            marker="D",
            color="r",
            label=f"backtest: predicted at N = {bt['N']:.3g} (error {bt['error']:+.3f})",
        )
        ax.scatter(
            [bt["task_loss_observed"]],
            [bt["observed"]],
            marker="*",
            s=120,
            color="r",
            label="held-out largest size, observed",
        )
    flagged = " (flagged)" if fit["accuracy"]["flags"] else ""
    fs.axes(ax, f"task loss ({m['task_loss']})", f"accuracy ({m['accuracy']})", logy=False)
    ax.set_xscale("linear")
    ax.set_title(f"{task}: accuracy from task loss{flagged}", fontsize=9)
    fs.legend(ax, 6)


def fig_task_law(t: RunTable, fits: dict, cell: str | None = None):
    """Task laws of one cell (default: the first with a fitted task), a row per task: task
    loss with its law by N, and accuracy against task loss with the sigmoid and the backtest.
    None when no task law of the cell was fitted."""
    fitted = fitted_tasks(fits, cell)
    if not fitted:
        return None
    cell = fitted[0][0]
    fitted = [f for f in fitted if f[0] == cell]
    m = fits["task_laws"]["metrics"]
    fig, axs = plt.subplots(len(fitted), 2, figsize=(10, 3.6 * len(fitted)), squeeze=False)
    sub = t.subset(cell)
    style = fs.cell_style(cell)
    for (ax_l, ax_a), (_, task, fit) in zip(axs, fitted, strict=True):
        _task_loss_panel(ax_l, sub, task, fit, m["task_loss"], style)
        _accuracy_panel(ax_a, sub, task, fit, m, style)
    fig.suptitle(f"task laws: {cell}", fontsize=11)
    fig.tight_layout(rect=(0.0, 0.0, 1.0, 1.0 - 0.25 / len(fitted)))  # room for the title
    return fig


def task_law_figures(t: RunTable, fits: dict, out_dir: Path) -> list[Path]:
    """`task_law_<cell>` (PNG + SVG) for every cell with a fitted task law; the files."""
    paths: list[Path] = []
    for cell in dict.fromkeys(c for c, _, _ in fitted_tasks(fits)):
        fig = fig_task_law(t, fits, cell)
        paths += fs.save(fig, Path(out_dir), "task_law_" + cell.replace("/", "_"))
    return paths
