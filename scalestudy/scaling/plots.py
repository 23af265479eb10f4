"""Figures from runs and fits (PNG and SVG); no fitting here beyond `fit_cells` when no fits
are given. Every cell has one colour (its architecture) and one marker (its objective) in all
figures."""

from __future__ import annotations

import zlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from scalestudy.scaling.forms import get_form
from scalestudy.scaling.io import RunTable, table_from_rows
from scalestudy.scaling.report import loss_at_compute

ARCH_COLOURS = {
    "causal_decoder": "#1f77b4",
    "noncausal_decoder": "#ff7f0e",
    "encoder_decoder": "#2ca02c",
}
OBJECTIVE_MARKERS = {"flm": "o", "plm": "s", "mlm": "^"}
_PALETTE = ["#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
_MARKERS = ["D", "v", "P", "X", "*", "<", ">"]
PF_DAY = 8.64e19


def cell_style(cell: str) -> dict:
    """Colour from the cell's architecture and marker from its objective (stable across figures)."""
    parts = cell.split("/")
    h = zlib.crc32(cell.encode())
    colour = ARCH_COLOURS.get(parts[0], _PALETTE[h % len(_PALETTE)])
    marker = OBJECTIVE_MARKERS.get(parts[-1], _MARKERS[h % len(_MARKERS)])
    return {"color": colour, "marker": marker}


def _loss_label(table: RunTable) -> str:
    if table.choices.get("source_kind") == "registry":
        return "validation loss (nats/token)"
    return f"loss ({table.choices.get('loss', 'as given')})"


def _save(fig, out_dir: Path, name: str) -> list[Path]:
    paths = []
    fig.tight_layout()
    for ext in ("png", "svg"):
        p = out_dir / f"{name}.{ext}"
        fig.savefig(p, dpi=120, bbox_inches="tight")
        paths.append(p)
    plt.close(fig)
    return paths


def _axes(ax, xlabel: str, ylabel: str, logy: bool = True) -> None:
    ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.25)


def _fit(fits: dict, cell: str, law: str) -> dict | None:
    f = fits.get("cells", {}).get(cell, {}).get("fits", {}).get(law)
    return f if f and "skipped" not in f else None


def _curve(law: str, fit: dict, x: np.ndarray) -> np.ndarray:
    form = get_form(law)
    y, _ = form.predict(np.array(fit["theta"])[None], np.log(x)[None])
    return np.exp(y[0])


def plot_loss_vs_compute(t: RunTable, fits: dict, out: Path) -> list[Path]:
    fig, ax = plt.subplots(figsize=(7, 5))
    for cell in t.cells():
        sub, st = t.subset(cell), cell_style(cell)
        for r in sub.run_id:
            if r in sub.curves:
                c = sub.curves[r]
                ax.plot(c["C"], c["loss"], color=st["color"], alpha=0.25, lw=0.8)
        ax.scatter(sub.C, sub.loss, label=cell, edgecolor="k", lw=0.4, **st)
        c_grid = np.geomspace(np.nanmin(sub.C) / 3, np.nanmax(sub.C) * 30, 100)
        if f := _fit(fits, cell, "kaplan_c"):
            ax.plot(c_grid, _curve("kaplan_c", f, c_grid), color=st["color"], lw=1.5)
        if f := _fit(fits, cell, "chinchilla3"):
            k = fits["cells"][cell]["flops_per_nd"]["k"]
            lc = loss_at_compute("chinchilla3", np.array(f["theta"]), c_grid, k)[0]
            ax.plot(c_grid, lc, color=st["color"], ls="--", lw=1.5)
    cells = t.cells()
    if any(_fit(fits, cell, "kaplan_c") for cell in cells):
        ax.plot([], [], "k-", label="L(C) frontier fit (Kaplan)")
    if any(_fit(fits, cell, "chinchilla3") for cell in cells):
        ax.plot([], [], "k--", label="compute-optimal L from L(N, D) (Chinchilla 3)")
    _axes(ax, "training compute C (FLOPs)", _loss_label(t))
    ax.legend(fontsize=7)
    ax.set_title("Loss vs compute")
    return _save(fig, out, "loss_vs_compute")


def plot_isoflops(t: RunTable, fits: dict, out: Path) -> list[Path]:
    cells = [c for c in t.cells() if _fit(fits, c, "chinchilla2")]
    if not cells:
        return []
    fig, axs = plt.subplots(1, len(cells), figsize=(5 * len(cells), 4.2), squeeze=False)
    for ax, cell in zip(axs[0], cells):
        sub, st = t.subset(cell), cell_style(cell)
        profiles = _fit(fits, cell, "chinchilla2")["isoflop"]
        cmap = plt.get_cmap("viridis")
        for i, pr in enumerate(profiles):
            colour = cmap(i / max(len(profiles) - 1, 1))
            member = np.abs(np.log10(sub.C) - np.log10(pr["C"])) < 0.15
            ax.scatter(sub.N[member], sub.loss[member], color=colour, marker=st["marker"], s=18)
            p = pr["parabola_logN"]
            n = np.geomspace(sub.N[member].min(), sub.N[member].max(), 60)
            u = np.log(n) - p["x0"]
            ax.plot(
                n,
                p["c0"] + p["c1"] * u + p["c2"] * u * u,
                color=colour,
                lw=1,
                label=f"C={pr['C']:.2g}",
            )
            if pr["N_opt"]:
                u0 = np.log(pr["N_opt"]) - p["x0"]
                ax.plot(
                    pr["N_opt"],
                    p["c0"] + p["c1"] * u0 + p["c2"] * u0**2,
                    "*",
                    color=colour,
                    ms=12,
                    mec="k",
                )
        _axes(ax, "parameters N", _loss_label(t), logy=False)
        ax.set_title(f"IsoFLOP profiles: {cell}", fontsize=9)
        ax.legend(fontsize=6)
    return _save(fig, out, "isoflops")


def plot_loss_vs_size(t: RunTable, fits: dict, out: Path) -> list[Path]:
    fig, axs = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, var, law, label in (
        (axs[0], "N", "kaplan_n", "parameters N"),
        (axs[1], "D", "kaplan_d", "training tokens D"),
    ):
        for cell in t.cells():
            sub, st = t.subset(cell), cell_style(cell)
            x = getattr(sub, var)
            if np.isnan(x).all():
                continue
            ax.scatter(x, sub.loss, label=cell, edgecolor="k", lw=0.4, **st)
            if f := _fit(fits, cell, law):
                g = np.geomspace(np.nanmin(x) / 2, np.nanmax(x) * 5, 80)
                ax.plot(g, _curve(law, f, g), color=st["color"])
        _axes(ax, label, _loss_label(t))
        ax.set_title(f"L({var}) with fitted {law}", fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return _save(fig, out, "loss_vs_n_d")


def plot_allocation(t: RunTable, fits: dict, out: Path) -> list[Path]:
    lo, hi = np.nanmin(t.C) / 10, np.nanmax(t.C) * 1e4
    c = np.geomspace(lo, hi, 100)
    fig, axs = plt.subplots(1, 2, figsize=(11, 4.5))
    # Published references: Chinchilla's ~20 tokens per parameter (C = 6ND) and Kaplan et
    # al.'s N_opt = 1.3e9 (C / PF-day)^0.73.
    n_chin, n_kap = np.sqrt(c / 120.0), 1.3e9 * (c / PF_DAY) ** 0.73
    for ax, which in zip(axs, ("N", "D")):
        ref_c = n_chin if which == "N" else 20 * n_chin
        ref_k = n_kap if which == "N" else c / (6 * n_kap)
        ax.plot(c, ref_c, color="0.4", ls=":", label="Chinchilla (D = 20 N)")
        ax.plot(c, ref_k, color="0.6", ls="-.", label="Kaplan et al. (N ∝ C^0.73)")
    for cell in t.cells():
        st = cell_style(cell)
        if f := _fit(fits, cell, "chinchilla3"):
            k = fits["cells"][cell]["flops_per_nd"]["k"]
            p = {n: v["value"] for n, v in f["params"].items()}
            n = p["G"] * (c / k) ** p["a"]
            axs[0].plot(c, n, color=st["color"], label=f"{cell} (approach 3)")
            axs[1].plot(c, (c / k) / n, color=st["color"])
        for law, ls in (("chinchilla2", "--"), ("chinchilla1", (0, (1, 1)))):
            if f := _fit(fits, cell, law):
                p = {n: v["value"] for n, v in f["params"].items()}
                axs[0].plot(c, p["G"] * c ** p["a"], color=st["color"], ls=ls, lw=1)
                axs[1].plot(c, p["H"] * c ** p["b"], color=st["color"], ls=ls, lw=1)
        if f := _fit(fits, cell, "chinchilla2"):
            opt = [(pr["C"], pr["N_opt"], pr["D_opt"]) for pr in f["isoflop"] if pr["N_opt"]]
            if opt:
                cc, nn, dd = np.array(opt, dtype=float).T
                axs[0].scatter(cc, nn, edgecolor="k", lw=0.4, label=f"{cell} IsoFLOP optima", **st)
                axs[1].scatter(cc, dd, edgecolor="k", lw=0.4, **st)
    _axes(axs[0], "training compute C (FLOPs)", "compute-optimal parameters N_opt")
    _axes(axs[1], "training compute C (FLOPs)", "compute-optimal tokens D_opt")
    axs[0].legend(fontsize=6)
    axs[1].legend(fontsize=6)
    fig.suptitle("Compute-optimal allocation (solid: approach 3, dashed: approach 2)", fontsize=9)
    return _save(fig, out, "optimal_allocation")


def task_accuracy(extra: dict[str, np.ndarray]) -> tuple[np.ndarray, int] | None:
    """Per run, the mean over tasks of `eval/<task>/acc`, and the number of tasks.

    `eval/<task>/<part>/acc` columns are breakdowns of a task already counted: left out.
    """
    keys = [k for k in extra if k.endswith("/acc") and k.count("/") == 2]
    if not keys:
        return None
    return np.nanmean(np.stack([extra[k] for k in keys]), axis=0), len(keys)


def plot_zero_shot(t: RunTable, out: Path) -> list[Path]:
    if (got := task_accuracy(t.extra)) is None:
        return []
    acc, n_tasks = got
    fig, ax = plt.subplots(figsize=(7, 5))
    for cell in t.cells():
        idx = [i for i, c in enumerate(t.cell) if c == cell]
        order = np.array(idx)[np.argsort(t.C[idx])]
        st = cell_style(cell)
        ax.scatter(t.C[order], acc[order], label=cell, edgecolor="k", lw=0.4, **st)
        # The line joins the best run at each compute (several runs may share a budget).
        key = np.round(np.log10(t.C[order]), 1)
        best = [
            order[key == k][np.nanargmax(acc[order][key == k])]
            for k in np.unique(key)
            if np.isfinite(acc[order][key == k]).any()
        ]
        ax.plot(t.C[best], acc[best], color=st["color"], lw=1.0, alpha=0.7)
    _axes(
        ax,
        "training compute C (FLOPs)",
        f"mean zero-shot accuracy over {n_tasks} task(s)",
        logy=False,
    )
    ax.legend(fontsize=7)
    ax.set_title("Zero-shot accuracy vs compute")
    return _save(fig, out, "zero_shot_vs_compute")


def plot_residuals(t: RunTable, fits: dict, out: Path) -> list[Path]:
    laws = [
        law
        for law in ("chinchilla3", "kaplan_nd", "kaplan_n", "kaplan_d")
        if any(_fit(fits, c, law) for c in t.cells())
    ]
    if not laws:
        return []
    fig, axs = plt.subplots(1, len(laws), figsize=(4.5 * len(laws), 4), squeeze=False)
    for ax, law in zip(axs[0], laws):
        for cell in t.cells():
            if f := _fit(fits, cell, law):
                pts = f["residuals"]["points"]
                x = [p["x"][0] for p in pts]
                ax.scatter(
                    x,
                    [p["log_resid"] for p in pts],
                    label=cell,
                    edgecolor="k",
                    lw=0.3,
                    s=18,
                    **cell_style(cell),
                )
        ax.axhline(0, color="k", lw=0.8)
        _axes(
            ax,
            "parameters N" if law != "kaplan_d" else "training tokens D",
            "log(L_observed / L_fitted)",
            logy=False,
        )
        ax.set_title(f"residuals of {law}", fontsize=9)
        ax.legend(fontsize=6)
    return _save(fig, out, "residuals")


def make_all_plots(runs, curves, fits: dict | None, out_dir: str | Path) -> list[Path]:
    """Every figure for a study's runs and fits (PNG + SVG each); returns the files written.

    `runs` is a RunTable or rows from study.registry.load_runs (`curves` from load_curves);
    `fits` is the result of `fit_cells` (fitted here without intervals when None).
    """
    table = runs if isinstance(runs, RunTable) else table_from_rows(runs, curves)
    if fits is None:
        from scalestudy.scaling.laws import FitSettings, fit_cells

        fits = fit_cells(table, settings=FitSettings(bootstrap=0))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    has_c = bool(np.isfinite(table.C).any())
    paths = plot_loss_vs_compute(table, fits, out) if has_c else []
    paths += plot_isoflops(table, fits, out)
    paths += plot_loss_vs_size(table, fits, out)
    paths += plot_allocation(table, fits, out) if has_c else []
    paths += plot_zero_shot(table, out) if has_c else []
    paths += plot_residuals(table, fits, out)
    return paths
