"""IsoFLOP profiles and compute-optimal allocation figures (no fitting here)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import LogNorm

from scalestudy.scaling import figstyle as fs
from scalestudy.scaling.allocation import allocation_curves
from scalestudy.scaling.table import RunTable

PF_DAY = 8.64e19
BUDGET_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*", "<", ">"]


def _members(sub: RunTable, profiles: list[dict]) -> list[np.ndarray]:
    """Indices of each profile's own runs (from the fit; older fits: nearest budget in log C)."""
    if all("run_ids" in p for p in profiles):
        pos = {r: i for i, r in enumerate(sub.run_id)}
        return [np.array([pos[r] for r in p["run_ids"] if r in pos], dtype=int) for p in profiles]
    logc = np.log10([p["C"] for p in profiles])
    nearest = np.abs(np.log10(sub.C)[:, None] - logc[None]).argmin(axis=1)
    return [np.flatnonzero(nearest == i) for i in range(len(profiles))]


def fig_isoflops(t: RunTable, fits: dict):
    """One panel per cell: each budget's runs and parabola in a colour set by its compute."""
    cells = [c for c in t.cells() if fs.get_fit(fits, c, "chinchilla2")]
    if not cells:
        return None
    fig, axs = fs.grid(len(cells))
    all_c = [p["C"] for c in cells for p in fs.get_fit(fits, c, "chinchilla2")["isoflop"]]
    norm = LogNorm(min(all_c), max(all_c) * (1.0001 if min(all_c) == max(all_c) else 1.0))
    cmap, ci = plt.get_cmap("viridis"), fs.ci_level(fits)
    for ax, cell in zip(axs, cells):
        sub = t.subset(cell)
        fit = fs.get_fit(fits, cell, "chinchilla2")
        profiles = sorted(fit["isoflop"], key=lambda p: p["C"])  # numeric order of compute
        for i, (pr, idx) in enumerate(zip(profiles, _members(sub, profiles))):
            colour, marker = cmap(norm(pr["C"])), BUDGET_MARKERS[i % len(BUDGET_MARKERS)]
            style = {"color": colour, "marker": marker}
            ax.scatter(sub.N[idx], sub.loss[idx], s=18, edgecolor="k", lw=0.3, **style)
            p = pr["parabola_logN"]
            if len(idx):
                n = np.geomspace(sub.N[idx].min(), sub.N[idx].max(), 60)
                u = np.log(n) - p["x0"]
                co = np.array(pr.get("parabola_samples") or np.zeros((0, 3)), dtype=np.float64)
                if len(co):
                    ys = co[:, :1] + co[:, 1:2] * u + co[:, 2:3] * u * u
                    fs.band(ax, n, ys, colour, ci, f"band:{cell}:C={pr['C']:.3g}")
                ax.plot(
                    n,
                    p["c0"] + p["c1"] * u + p["c2"] * u * u,
                    color=colour,
                    lw=1,
                    marker=marker,
                    markevery=[0],
                    ms=4,
                    label=f"C={pr['C']:.2g}",
                )
            if pr["N_opt"]:
                u0 = np.log(pr["N_opt"]) - p["x0"]
                y0 = p["c0"] + p["c1"] * u0 + p["c2"] * u0**2
                ax.plot(pr["N_opt"], y0, "*", color=colour, ms=12, mec="k")
        fs.axes(ax, "parameters N", fs.loss_label(t), logy=False)
        ax.set_title(fs.fit_label(f"IsoFLOP profiles: {cell}", fit), fontsize=8)
        ax.legend(fontsize=6, ncol=2 if len(profiles) > 8 else 1)
    sm = plt.cm.ScalarMappable(norm=norm, cmap=cmap)
    fig.colorbar(sm, ax=axs, label="IsoFLOP budget C (FLOPs)", shrink=0.8)
    return fig


def fig_allocation(t: RunTable, fits: dict):
    """N_opt(C) and D_opt(C) from approaches 1-3 with bands, optima and published references."""
    laws = ("chinchilla3", "chinchilla2", "chinchilla1")
    if not any(fs.get_fit(fits, c, law) for c in t.cells() for law in laws):
        return None  # nothing fitted to compare with the published references
    c_max = float(np.nanmax(t.C))
    c = np.geomspace(np.nanmin(t.C) / 10, c_max * 1e4, 100)
    fig, axs = plt.subplots(1, 2, figsize=(13, 4.8), layout="constrained")
    ci = fs.ci_level(fits)
    _draw_references(axs, c)
    styles = fs.cell_styles(t.cells())
    drawn = set()
    for cell in t.cells():
        drawn |= _draw_cell(axs, fits, cell, styles[cell], c, c_max, ci)
    for ax in axs:
        fs.mark_extrapolation(ax, c_max, c[-1])
    fs.axes(axs[0], "training compute C (FLOPs)", "compute-optimal parameters N_opt")
    fs.axes(axs[1], "training compute C (FLOPs)", "compute-optimal tokens D_opt")
    for ls, name in sorted(drawn, key=lambda d: d[1], reverse=True):
        axs[1].plot([], [], color="k", ls=ls, lw=1.3, label=name)
    fs.legend(axs[0], 6)
    fs.legend(axs[1], 6)
    kinds = {"approach 3": "solid", "approach 2": "dashed", "approach 1": "dotted"}
    keys = "; ".join(f"{kinds[n]}: {n}" for n in sorted({n for _, n in drawn}, reverse=True))
    fig.suptitle(
        f"Compute-optimal allocation ({keys + '; ' if keys else ''}shaded: {ci:.0%} bootstrap "
        "band; hatched: beyond the runs)",
        fontsize=9,
    )
    return fig


def _draw_references(axs, c: np.ndarray) -> None:
    """The published allocations on both panels (N_opt, then D_opt)."""
    # Published references: Chinchilla's ~20 tokens per parameter (C = 6ND) and Kaplan et
    # al.'s N_opt = 1.3e9 (C / PF-day)^0.73.
    n_chin, n_kap = np.sqrt(c / 120.0), 1.3e9 * (c / PF_DAY) ** 0.73
    for ax, which in zip(axs, ("N", "D")):
        ax.plot(
            c,
            n_chin if which == "N" else 20 * n_chin,
            color="0.4",
            ls=":",
            lw=0.8,
            label="Chinchilla (D = 20 N)",
        )
        ax.plot(
            c,
            n_kap if which == "N" else c / (6 * n_kap),
            color="0.6",
            ls="-.",
            lw=0.8,
            label="Kaplan et al. (N ∝ C^0.73)",
        )


def _draw_cell(
    axs, fits: dict, cell: str, st: dict, c: np.ndarray, c_max: float, ci: float
) -> set[tuple]:
    """One cell's allocation lines and bands (each approach fitted) and its IsoFLOP optima;
    returns the (line style, approach) pairs drawn, for the legend."""
    drawn = set()
    k = fits["cells"][cell]["flops_per_nd"]["k"] if cell in fits.get("cells", {}) else 6.0
    for law, ls, name in (
        ("chinchilla3", "-", "approach 3"),
        ("chinchilla2", "--", "approach 2"),
        ("chinchilla1", (0, (1, 1)), "approach 1"),
    ):
        f = fs.get_fit(fits, cell, law)
        if not f:
            continue
        drawn.add((ls, name))
        n_KC, d_KC = allocation_curves(law, f, k, c)
        for ax, v_KC, lab in ((axs[0], n_KC, True), (axs[1], d_KC, False)):
            label = fs.cell_label(f"{cell} {name}", [("fit", f)]) if lab else None
            fs.split_line(ax, c, v_KC[0], c_max, color=st["color"], ls=ls, lw=1.3, label=label)
            fs.band(ax, c, v_KC[1:], st["color"], ci, f"band:{cell}:{law}")
    if f := fs.get_fit(fits, cell, "chinchilla2"):
        opt = [(pr["C"], pr["N_opt"], pr["D_opt"]) for pr in f["isoflop"] if pr["N_opt"]]
        if opt:
            cc, nn, dd = np.array(opt, dtype=float).T
            axs[0].scatter(cc, nn, edgecolor="k", lw=0.4, label=f"{cell} IsoFLOP optima", **st)
            axs[1].scatter(cc, dd, edgecolor="k", lw=0.4, **st)
    return drawn
