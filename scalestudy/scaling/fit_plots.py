"""Figures from a table of runs and its fits (PNG and SVG); no fitting here. Every cell has
one distinct colour and marker in all figures (architecture and objective when known:
scaling/figstyle.py); fitted curves carry their bootstrap band, the region beyond the data is
shaded, and flagged fits say so in the legend.

Each `fig_*` function draws one figure and returns it (None when there is nothing to draw);
`make_all_plots` saves them.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from scalestudy.scaling import figstyle as fs
from scalestudy.scaling.figstyle import cell_style, cell_styles  # noqa: F401 (public names)
from scalestudy.scaling.fit_text import loss_at_compute
from scalestudy.scaling.plot_allocation import fig_allocation, fig_isoflops
from scalestudy.scaling.table import RunTable
from scalestudy.scaling.task_law_plots import task_law_figures


def fig_loss_vs_compute(t: RunTable, fits: dict):
    """Runs, curves, the Kaplan frontier fit and Chinchilla's compute-optimal loss per cell."""
    fig, ax = plt.subplots(figsize=(8.5, 5.2), layout="constrained")
    styles, ci = fs.cell_styles(t.cells()), fs.ci_level(fits)
    c_max = float(np.nanmax(t.C))
    c_grid = np.geomspace(np.nanmin(t.C) / 3, c_max * 30, 100)
    drawn = set()
    for cell in t.cells():
        sub, st = t.subset(cell), styles[cell]
        for r in sub.run_id:
            if r in sub.curves:
                c = sub.curves[r]
                ax.plot(c["C"], c["loss"], color=st["color"], alpha=0.25, lw=0.8)
        kaplan, f = fs.first_fit(fits, cell, ("kaplan_c", "kaplan_c_noE"))
        drawn_fits = [(kaplan, f), ("chinchilla3", fs.get_fit(fits, cell, "chinchilla3"))]
        label = fs.cell_label(cell, drawn_fits)
        ax.scatter(sub.C, sub.loss, label=label, edgecolor="k", lw=0.4, **st)
        fitted = fs.fitted_grid(sub.C)  # bands only where the cell's runs are
        if f:
            y, _ = fs.form_curves(kaplan, f, c_grid)
            fs.split_line(ax, c_grid, y, c_max, color=st["color"], lw=1.5)
            ys = fs.form_curves(kaplan, f, fitted)[1]
            fs.band(ax, fitted, ys, st["color"], ci, f"band:{cell}:{kaplan}")
            drawn.add("kaplan_c")
        if f := fs.get_fit(fits, cell, "chinchilla3"):
            k = fits["cells"][cell]["flops_per_nd"]["k"]
            theta = np.array([f["theta"], *f.get("theta_samples", [])], dtype=np.float64)
            lc = loss_at_compute("chinchilla3", theta, c_grid, k)
            fs.split_line(ax, c_grid, lc[0], c_max, color=st["color"], ls="--", lw=1.5)
            band = loss_at_compute("chinchilla3", theta, fitted, k)[1:]
            fs.band(ax, fitted, band, st["color"], ci, f"band:{cell}:chinchilla3")
            drawn.add("chinchilla3")
    if "kaplan_c" in drawn:
        ax.plot([], [], "k-", label="L(C) frontier fit (Kaplan)")
    if "chinchilla3" in drawn:
        ax.plot([], [], "k--", label="compute-optimal L from L(N, D) (Chinchilla 3)")
    if drawn:
        fs.mark_extrapolation(ax, c_max, c_grid[-1])
    fs.axes(ax, "training compute C (FLOPs)", fs.loss_label(t))
    fs.legend(ax)
    ax.set_title(f"Loss vs compute (bands: {ci:.0%} bootstrap)" if drawn else "Loss vs compute")
    return fig


def fig_loss_vs_size(t: RunTable, fits: dict):
    """L(N) and L(D) with the fitted kaplan_n / kaplan_d curves (or their forms without E)
    and their bands."""
    fig, axs = plt.subplots(1, 2, figsize=(13, 4.8), layout="constrained")
    styles, ci = fs.cell_styles(t.cells()), fs.ci_level(fits)
    for ax, var, family, label in (
        (axs[0], "N", "kaplan_n", "parameters N"),
        (axs[1], "D", "kaplan_d", "training tokens D"),
    ):
        x_max, x_end = -np.inf, -np.inf
        names, along = set(), False  # along: a law whose other input varies with this one
        for cell in t.cells():
            sub, st = t.subset(cell), styles[cell]
            x = getattr(sub, var)
            if np.isnan(x).all():
                continue
            law, f = fs.first_fit(fits, cell, (family, f"{family}_noE"))
            if f:
                names.add(law)
                along = along or bool(f.get("along"))
            entry = fs.cell_label(cell, [(law, f)])
            ax.scatter(x, sub.loss, label=entry, edgecolor="k", lw=0.4, **st)
            if f:
                g = np.geomspace(np.nanmin(x) / 2, np.nanmax(x) * 5, 80)
                y, _ = fs.form_curves(law, f, g)
                fs.split_line(ax, g, y, np.nanmax(x), color=st["color"])
                fitted = fs.fitted_grid(x)
                ys = fs.form_curves(law, f, fitted)[1]
                fs.band(ax, fitted, ys, st["color"], ci, f"band:{cell}:{law}")
                x_max, x_end = max(x_max, np.nanmax(x)), max(x_end, g[-1])
        if np.isfinite(x_max):
            fs.mark_extrapolation(ax, x_max, x_end)
        fs.axes(ax, label, fs.loss_label(t))
        # Name only laws that were fitted: a panel of points alone says so.
        title = f"with fitted {' / '.join(sorted(names))}" if names else f"({family} not fitted)"
        head = f"L({var}, {'D' if var == 'N' else 'N'}({var}))" if along else f"L({var})"
        ax.set_title(f"{head} {title}", fontsize=9)
        fs.legend(ax)
    return fig


def task_accuracy(extra: dict[str, np.ndarray]) -> tuple[np.ndarray, int] | None:
    """Per run, the mean over tasks of `eval/<task>/acc`, and the number of tasks.

    `eval/<task>/<part>/acc` columns are breakdowns of a task already counted: left out.
    """
    keys = [k for k in extra if k.endswith("/acc") and k.count("/") == 2]
    if not keys:
        return None
    return np.nanmean(np.stack([extra[k] for k in keys]), axis=0), len(keys)


def task_interval(extra: dict[str, np.ndarray], z: float = 1.96) -> np.ndarray | None:
    """Per run, the binomial half-width (z standard errors) of the mean over tasks of
    `eval/<task>/acc`, from each task's `eval/<task>/n`; None without every task's n."""
    keys = [k for k in extra if k.endswith("/acc") and k.count("/") == 2]
    if not keys or any(k.removesuffix("acc") + "n" not in extra for k in keys):
        return None
    var = sum(
        extra[k] * (1 - extra[k]) / np.maximum(extra[k.removesuffix("acc") + "n"], 1) for k in keys
    )
    return z * np.sqrt(var) / len(keys)


def task_chance(extra: dict[str, np.ndarray]) -> float | None:
    """The mean over runs and tasks of `eval/<task>/chance` (a uniform guess), if recorded."""
    keys = [k for k in extra if k.endswith("/chance") and k.count("/") == 2]
    values = np.concatenate([extra[k] for k in keys]) if keys else np.zeros(0)
    values = values[np.isfinite(values)]
    return float(values.mean()) if values.size else None


def fig_zero_shot(t: RunTable, fits: dict):
    if (got := task_accuracy(t.extra)) is None:
        return None
    acc, n_tasks = got
    half = task_interval(t.extra)
    fig, ax = plt.subplots(figsize=(7, 5))
    styles = fs.cell_styles(t.cells())
    for cell in t.cells():
        idx = [i for i, c in enumerate(t.cell) if c == cell]
        order = np.array(idx)[np.argsort(t.C[idx])]
        st = styles[cell]
        ax.scatter(t.C[order], acc[order], label=cell, edgecolor="k", lw=0.4, **st)
        if half is not None:
            ax.errorbar(
                t.C[order],
                acc[order],
                yerr=half[order],
                fmt="none",
                ecolor=st["color"],
                elinewidth=0.8,
                alpha=0.5,
                capsize=2,
                gid=f"interval:{cell}",
            )
        # The line joins the best run at each compute (several runs may share a budget).
        key = np.round(np.log10(t.C[order]), 1)
        best = [
            order[key == k][np.nanargmax(acc[order][key == k])]
            for k in np.unique(key)
            if np.isfinite(acc[order][key == k]).any()
        ]
        ax.plot(t.C[best], acc[best], color=st["color"], lw=1.0, alpha=0.7)
    if (chance := task_chance(t.extra)) is not None:
        ax.axhline(chance, color="0.4", ls=":", lw=1.2, label=f"chance ({chance:.3f})")
    fs.axes(
        ax, "training compute C (FLOPs)", f"mean zero-shot accuracy over {n_tasks} task(s)", False
    )
    fs.legend(ax)
    bars = " (bars: binomial 95% intervals)" if half is not None else ""
    ax.set_title(f"Zero-shot accuracy vs compute{bars}")
    return fig


def fig_residuals(t: RunTable, fits: dict):
    """Log residuals per law, one panel each (wrapped into rows); outlying points ringed."""
    laws = [
        law
        for base in ("chinchilla3", "kaplan_nd", "kaplan_n", "kaplan_d", "kaplan_c")
        for law in (base, f"{base}_noE")
        if any(fs.get_fit(fits, c, law) for c in t.cells())
    ]
    if not laws:
        return None
    fig, axs = fs.grid(len(laws), width=4.6, height=4.0)
    styles = fs.cell_styles(t.cells())
    for ax, law in zip(axs, laws):
        for cell in t.cells():
            if f := fs.get_fit(fits, cell, law):
                pts = f["residuals"]["points"]
                x = np.array([p["x"][0] for p in pts])
                r = np.array([p["log_resid"] for p in pts])
                ax.scatter(
                    x,
                    r,
                    label=fs.cell_label(cell, [("fit", f)]),
                    edgecolor="k",
                    lw=0.3,
                    s=18,
                    **styles[cell],
                )
                out = np.array([bool(p.get("outlier")) for p in pts], dtype=bool)
                if out.any():
                    ringed = any(c.get_label() == "outlier (flagged)" for c in ax.collections)
                    ax.scatter(
                        x[out],
                        r[out],
                        s=120,
                        facecolor="none",
                        edgecolor="r",
                        lw=1.2,
                        label="_nolegend_" if ringed else "outlier (flagged)",
                    )
        ax.axhline(0, color="k", lw=0.8)
        xlabel = {"kaplan_d": "training tokens D", "kaplan_c": "training compute C (FLOPs)"}
        xlabel = xlabel.get(law.removesuffix("_noE"), "parameters N")
        fs.axes(ax, xlabel, "log(L_observed / L_fitted)", logy=False)
        ax.set_title(f"residuals of {law}", fontsize=9)
        fs.legend(ax, 6)
    return fig


FIGURES = {
    "loss_vs_compute": (fig_loss_vs_compute, True),  # (draw, needs compute)
    "isoflops": (fig_isoflops, False),
    "loss_vs_n_d": (fig_loss_vs_size, False),
    "optimal_allocation": (fig_allocation, True),
    "zero_shot_vs_compute": (fig_zero_shot, True),
    "residuals": (fig_residuals, False),
}


def make_all_plots(table: RunTable, fits: dict, out_dir: str | Path) -> list[Path]:
    """Every figure for a table of runs and its fits (`laws.fit_cells`), PNG + SVG each;
    returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    has_c = bool(np.isfinite(table.C).any())
    paths = []
    for name, (draw, needs_c) in FIGURES.items():
        if needs_c and not has_c:
            continue
        fig = draw(table, fits)
        if fig is not None:
            paths += fs.save(fig, out, name)
    return paths + task_law_figures(table, fits, out)
