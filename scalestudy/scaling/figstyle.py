"""What every figure shares: one distinct style per cell, confidence bands, the extrapolated
region, flagged-fit labels, panel grids, and saving as PNG + SVG.

Artists that tests (and readers of the SVG) look for carry a gid: `band:<cell>:<law>` for a
confidence band and `extrapolation` for the shaded region beyond the data.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from scalestudy.scaling.forms import get_form

ARCH_COLOURS = {
    "causal_decoder": "#1f77b4",
    "noncausal_decoder": "#ff7f0e",
    "encoder_decoder": "#2ca02c",
}
OBJECTIVE_MARKERS = {"flm": "o", "plm": "s", "mlm": "^"}
# Ten colours and seven markers (coprime counts): the i-th pair is distinct for i < 70.
PALETTE = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
]
MARKERS = ["D", "v", "P", "X", "*", "<", ">"]
EXTRAPOLATION_LABEL = "extrapolation (beyond the runs)"


def cell_style(cell: str) -> dict:
    """Colour from the cell's architecture and marker from its objective, when both are known
    (the same in every study); other cells get theirs from `cell_styles`."""
    return cell_styles([cell])[cell]


def cell_styles(cells: list[str]) -> dict[str, dict]:
    """A distinct (colour, marker) pair for every cell: known architectures and objectives keep
    their fixed colour and marker; any other cell takes the next unused pair."""
    styles, used = {}, set()
    for cell in cells:
        parts = cell.split("/")
        if parts[0] in ARCH_COLOURS and parts[-1] in OBJECTIVE_MARKERS:
            st = (ARCH_COLOURS[parts[0]], OBJECTIVE_MARKERS[parts[-1]])
            styles[cell], used = st, used | {st}
    i = 0
    for cell in sorted(c for c in cells if c not in styles):
        while (st := (PALETTE[i % len(PALETTE)], MARKERS[i % len(MARKERS)])) in used:
            i += 1
        styles[cell], used = st, used | {st}
    return {c: {"color": s[0], "marker": s[1]} for c, s in styles.items()}


def loss_label(table) -> str:
    if table.choices.get("source_kind") == "registry":
        return "validation loss (nats/token)"
    return f"loss ({table.choices.get('loss', 'as given')})"


def grid(n: int, width: float = 5.0, height: float = 4.2, ncols: int = 3):
    """A figure with n panels wrapped into rows of at most ncols; unused panels hidden."""
    cols = min(n, ncols)
    rows = math.ceil(n / cols)
    fig, axs = plt.subplots(
        rows, cols, figsize=(width * cols, height * rows), squeeze=False, layout="constrained"
    )
    flat = axs.ravel()
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, list(flat[:n])


def save(fig, out_dir: Path, name: str) -> list[Path]:
    paths = []
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    for ext in ("png", "svg"):
        p = Path(out_dir) / f"{name}.{ext}"
        fig.savefig(p, dpi=120, bbox_inches="tight")
        paths.append(p)
    plt.close(fig)
    return paths


def axes(ax, xlabel: str, ylabel: str, logy: bool = True) -> None:
    ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.25)
    # Under two decades matplotlib labels minor ticks too; keep them from running together.
    ax.tick_params(axis="x", which="minor", labelsize=7, labelrotation=35)


def get_fit(fits: dict, cell: str, law: str) -> dict | None:
    f = fits.get("cells", {}).get(cell, {}).get("fits", {}).get(law)
    return f if f and "skipped" not in f else None


def first_fit(fits: dict, cell: str, laws: tuple[str, ...]) -> tuple[str, dict | None]:
    """(name, fit) of the first of `laws` fitted for `cell` (a law with E, then without),
    or (laws[0], None)."""
    for law in laws:
        if f := get_fit(fits, cell, law):
            return law, f
    return laws[0], None


def fit_label(text: str, fit: dict) -> str:
    """A legend label that says when the fit is flagged, and why (the flag kinds)."""
    flags = fit.get("flags") or []
    if not flags:
        return text
    kinds = sorted({str(f).split(":")[0] for f in flags})
    return f"{text} (FLAGGED: {', '.join(kinds)})"


def cell_label(cell: str, fits: list[tuple[str, dict | None]]) -> str:
    """A cell's legend entry, naming each of its drawn fits that is flagged and why."""
    notes = []
    for name, fit in fits:
        if fit and fit.get("flags"):
            kinds = sorted({str(f).split(":")[0] for f in fit["flags"]})
            notes.append(f"{name} FLAGGED: {', '.join(kinds)}")
    return f"{cell} ({'; '.join(notes)})" if notes else cell


def legend(ax, fontsize: float = 7) -> None:
    """A legend inside the panel, or beside it when it is long enough to hide the data."""
    handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return
    if len(handles) > 8 or max(len(lab) for lab in labels) > 55:
        ax.legend(fontsize=fontsize - 1, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    else:
        ax.legend(fontsize=fontsize)


def form_curves(law: str, fit: dict, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fitted values [X], bootstrap values [K, X]) of a form law over one input x."""
    form = get_form(law)
    theta = np.array([fit["theta"], *fit.get("theta_samples", [])], dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        y, _ = form.predict(theta, np.log(x)[None])
    y = np.exp(y)
    return y[0], y[1:]


def fitted_grid(x: np.ndarray, n: int = 60) -> np.ndarray:
    """Log-spaced points over the range of the runs a law was fitted to: where its band is
    drawn (beyond the runs the curve goes on, faded, and the band does not)."""
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x) & (x > 0)]
    return np.geomspace(x.min(), x.max(), n) if x.size else x


def band(ax, x, samples_KX, colour, ci: float, gid: str) -> None:
    """Shade the percentile interval of the bootstrap curves (nothing without samples)."""
    s = np.asarray(samples_KX, dtype=np.float64)
    if s.ndim != 2 or len(s) < 5:
        return
    s = np.where(np.isfinite(s), s, np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: no band there
        lo, hi = np.nanpercentile(s, [50 * (1 - ci), 50 * (1 + ci)], axis=0)
    ok = np.isfinite(lo) & np.isfinite(hi)
    if ok.sum() < 2:
        return
    poly = ax.fill_between(x[ok], lo[ok], hi[ok], color=colour, alpha=0.15, lw=0)
    poly.set_gid(gid)


def split_line(ax, x, y, x_max: float, **kw) -> None:
    """A fitted curve: full strength over the data, faded beyond the largest observed x."""
    inside = x <= x_max
    ax.plot(x[inside], y[inside], **kw)
    if (~inside).any():
        j = max(int(inside.sum()) - 1, 0)
        ax.plot(x[j:], y[j:], **{**kw, "alpha": 0.45, "label": None})


def mark_extrapolation(ax, x_max: float, x_end: float) -> None:
    """Shade the region beyond the data, where every curve is an extrapolation."""
    if x_end <= x_max:
        return
    span = ax.axvspan(
        x_max, x_end, color="0.5", alpha=0.08, hatch="//", lw=0, label=EXTRAPOLATION_LABEL
    )
    span.set_gid("extrapolation")


def ci_level(fits: dict) -> float:
    return float(fits.get("settings", {}).get("ci", 0.95))
