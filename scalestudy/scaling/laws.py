"""Scaling-law fits: Kaplan forms, Chinchilla approaches 1-3, bootstrap intervals, allocation.

Laws (names accepted by `--law` and `FitSettings.laws`):
- kaplan_n, kaplan_d, kaplan_c: L(X) = (X_c/X)^alpha_X + E (suffix _noE: without E);
  kaplan_c is fitted to the compute-efficient frontier.
- kaplan_nd: L(N, D) = [(N_c/N)^(alpha_N/alpha_D) + D_c/D]^alpha_D (kaplan_nd_E: + E).
- chinchilla1, chinchilla2: approaches 1 and 2 (scaling/allocation.py).
- chinchilla3: L(N, D) = E + A/N^alpha + B/D^beta, fitted as in Hoffmann et al. (2022), with
  the implied compute-optimal N_opt(C) = G (C/k)^a, D_opt(C) = (1/G) (C/k)^b for C = k N D.
- auto: every law the data support (the others are reported as skipped, with the reason).
Every parameter and derived exponent carries a percentile bootstrap interval over runs.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from scalestudy.scaling import allocation
from scalestudy.scaling.bootstrap import run_counts, summarise
from scalestudy.scaling.forms import FORM_LAWS, Chinchilla, Form, get_form
from scalestudy.scaling.io import DataSettings, RunTable, ScalingDataError, table_from_rows
from scalestudy.scaling.optimize import best_of_grid, minimize

LAWS = (*FORM_LAWS, "chinchilla1", "chinchilla2")
AUTO_LAWS = ("kaplan_n", "kaplan_d", "kaplan_c", "kaplan_nd", "chinchilla1", "chinchilla2")
AUTO_LAWS = (*AUTO_LAWS, "chinchilla3")


@dataclass(frozen=True)
class FitSettings:
    """What to fit and how; recorded with every result."""

    laws: tuple[str, ...] = ("auto",)
    data: DataSettings = field(default_factory=DataSettings)
    bootstrap: int = 200  # resamples of runs; 0: no intervals
    seed: int = 0
    ci: float = 0.95
    huber_delta: float = 1e-3
    flops_per_nd: float | None = None  # k in C = k N D; None: 6 (6nd) or median C/(ND) (counted)
    holdout: int = 0  # refit without the N largest-compute runs and report their errors
    isoflop_tol: float = 0.1  # dex: runs closer in log10 C share an IsoFLOP budget
    top_k: int = 4  # grid starts per bootstrap resample (plus the full-data optimum)
    compare_at: tuple[float, ...] = ()  # compute budgets for the cross-cell comparison

    def __post_init__(self):
        bad = [law for law in self.laws if law not in (*LAWS, "auto")]
        if bad:
            raise ScalingDataError(f"unknown law(s) {bad}; accepted: auto, {', '.join(LAWS)}")
        if not 0.0 < self.ci < 1.0:
            raise ScalingDataError(f"ci must be in (0, 1), got {self.ci}")
        if self.bootstrap < 0:
            raise ScalingDataError(f"bootstrap must be >= 0, got {self.bootstrap}")


# ----------------------------------------------------------------------------- form fits


def _inputs(table: RunTable, form: Form):
    """(log inputs [V, P], log loss [P], run index per point [P]) for a form."""
    if form.inputs == ("C",):
        if np.isnan(table.C).all():
            raise ScalingDataError(f"{form.name} needs compute C (or N and D for C = 6ND)")
        c, loss, run = allocation.frontier_points(table)
        return np.log(c)[None], np.log(loss), run
    cols = {"N": table.N, "D": table.D}
    for v in form.inputs:
        if np.isnan(cols[v]).all():
            raise ScalingDataError(f"{form.name} needs {v}, which the runs do not have")
    x = np.log(np.stack([cols[v] for v in form.inputs]))
    run = np.arange(len(table.loss))
    if len(form.inputs) == 1:
        # L(N) and L(D) describe models not limited by the other quantity (Kaplan et al.
        # fit them near convergence): of runs sharing a value, keep the lowest loss.
        key = np.round(x[0], 6)
        run = np.array(
            [min(np.flatnonzero(key == k), key=lambda j: table.loss[j]) for k in np.unique(key)]
        )
        x = x[:, run]
    return x, np.log(table.loss[run]), run


def _check_points(form: Form, x_VP: np.ndarray) -> None:
    for v, x in zip(form.inputs, x_VP):
        distinct = np.unique(np.round(x, 9)).size
        if distinct < 2:
            raise ScalingDataError(
                f"{form.name}: every point has the same {v} ({np.exp(x[0]):.4g}); a law in "
                f"{v} needs at least 2 distinct values (3 or more to be meaningful)"
            )
    Q, P = len(form.params), x_VP.shape[1]
    if P < Q + 1:
        raise ScalingDataError(
            f"{form.name} has {Q} parameters and needs at least {Q + 1} points; got {P}"
        )


def _point_fit(form: Form, x, y, w, delta: float, grid: np.ndarray) -> np.ndarray:
    # Every grid start is run a short way, the best few to convergence: the same minimum
    # as running all of them to the end, at a fraction of the cost.
    res = minimize(form, grid, x, y, w, delta, max_iter=25)
    top = np.argsort(np.where(np.isfinite(res.loss_K), res.loss_K, np.inf))[:32]
    res = minimize(form, res.theta_KQ[top], x, y, w, delta, max_iter=1000)
    return res.theta_KQ[np.argmin(res.loss_K)]


def chinchilla_allocation(named: dict[str, np.ndarray], k: float) -> dict[str, np.ndarray]:
    """Exponents a, b and coefficient G of N_opt = G (C/k)^a, D_opt = (C/k)^b / G."""
    al, be = named["alpha"], named["beta"]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        G = (al * named["A"] / (be * named["B"])) ** (1.0 / (al + be))
        return {"a": be / (al + be), "b": al / (al + be), "G": G}


def fit_form(form: Form, table: RunTable, counts_RJ: np.ndarray, s: FitSettings, k: float):
    """Fit one form to a cell's runs: point estimate from the full grid, bootstrap, residuals."""
    x, y, run = _inputs(table, form)
    _check_points(form, x)
    grid = form.grid(x)
    ones = np.ones_like(y)
    theta = _point_fit(form, x, y, ones, s.huber_delta, grid)
    point = {n: v[0] for n, v in form.named(theta[None]).items()}
    samples: dict[str, np.ndarray] = {}
    theta_R = np.zeros((0, len(theta)))
    if len(counts_RJ):
        w_RP = counts_RJ[:, run]
        starts = best_of_grid(form, grid, x, y, w_RP, s.huber_delta, s.top_k)
        starts = np.concatenate([starts, np.broadcast_to(theta, (len(w_RP), 1, len(theta)))], 1)
        R, S, Q = starts.shape
        # A short run from every start, then only each resample's best to convergence.
        res = minimize(
            form, starts.reshape(R * S, Q), x, y, np.repeat(w_RP, S, 0), s.huber_delta, 30
        )
        pick = res.loss_K.reshape(R, S).argmin(axis=1)
        theta_R = res.theta_KQ.reshape(R, S, Q)[np.arange(R), pick]
        theta_R = minimize(form, theta_R, x, y, w_RP, s.huber_delta, max_iter=1000).theta_KQ
        samples = form.named(theta_R)
    if isinstance(form, Chinchilla):
        point.update(
            {n: v[0] for n, v in chinchilla_allocation(form.named(theta[None]), k).items()}
        )
        if len(theta_R):
            samples.update(chinchilla_allocation(samples, k))
    pred, _ = form.predict(theta[None], x)
    resid = y - pred[0]
    out = {
        "formula": form.formula(),
        "params": summarise(point, samples, s.ci),
        "n_points": len(y),
        "theta": theta.tolist(),
        "_theta_samples": theta_R,
        "residuals": {
            "rmse_log": float(np.sqrt(np.mean(resid**2))),
            "max_abs_log": float(np.abs(resid).max()),
            "points": [
                {"run": table.run_id[j], "x": np.exp(x[:, i]).tolist(), "log_resid": float(r)}
                for i, (j, r) in enumerate(zip(run, resid))
            ],
        },
        "flags": _flags(form, point, samples, pred[0]),
    }
    if len(form.inputs) == 1:
        out["points_used"] = f"lowest loss per distinct {form.inputs[0]}"
    if s.holdout > 0:
        out["holdout"] = _holdout(form, table, x, y, run, grid, s)
    return out


def _flags(form: Form, point: dict, samples: dict, pred_P: np.ndarray) -> list[str]:
    flags = []
    if np.ptp(pred_P) < 1e-3:
        flags.append(
            "flat: the fitted loss varies by less than 0.1% over the data, so the exponents "
            "are not determined (loss does not change with scale in these runs)"
        )
    for name, v in point.items():
        if name.startswith(("alpha", "beta")) and not v > 1e-3:
            flags.append(f"{name} = {v:.3g} <= 0: loss does not fall with scale; degenerate fit")
        if name in samples:
            bad = ~np.isfinite(samples[name])
            if bad.mean() > 0.05:
                flags.append(f"{name}: {bad.mean():.0%} of bootstrap fits failed")
    return flags


def _holdout(form: Form, table: RunTable, x, y, run, grid, s: FitSettings) -> dict:
    """Refit without the points of the `holdout` largest-compute runs; their errors."""
    held_runs = np.argsort(table.C)[::-1][: s.holdout]
    held = np.isin(run, held_runs)
    if not held.any():
        return {"error": f"none of the {s.holdout} largest-compute runs is a point of this law"}
    if (~held).sum() < len(form.params) + 1:
        return {"error": f"too few points left after holding out {s.holdout} runs"}
    theta = _point_fit(form, x, y, (~held).astype(float), s.huber_delta, grid)
    pred, _ = form.predict(theta[None], x[:, held])
    err = y[held] - pred[0]
    return {
        "runs": [table.run_id[j] for j in run[held]],
        "rmse_log": float(np.sqrt(np.mean(err**2))),
        "rel_err": (np.exp(-err) - 1.0).tolist(),  # predicted / observed - 1
    }


# ----------------------------------------------------------------------------- cells


def flops_per_nd(table: RunTable, s: FitSettings) -> tuple[float, str]:
    """k in C = k N D used for compute-optimal allocation, and where it came from."""
    if s.flops_per_nd is not None:
        return s.flops_per_nd, "given"
    if table.choices.get("c_kind") == "6nd":
        return 6.0, "C = 6 N D"
    ratio = table.C / (table.N * table.D)
    if np.isfinite(ratio).any():
        return float(np.nanmedian(ratio)), "median over runs of counted C / (N D)"
    return 6.0, "default 6 (N or D missing)"


def summary(table: RunTable) -> dict:
    """Data summary of one cell's runs."""

    def rng(a):
        return [float(np.nanmin(a)), float(np.nanmax(a))] if np.isfinite(a).any() else None

    return {
        "runs": len(table.run_id),
        "distinct_N": int(np.unique(table.N[np.isfinite(table.N)]).size),
        "N": rng(table.N),
        "D": rng(table.D),
        "C": rng(table.C),
        "loss": rng(table.loss),
        "runs_with_curves": sum(r in table.curves for r in table.run_id),
    }


def fit_cell(table: RunTable, s: FitSettings) -> dict:
    """Every requested law for one cell; with 'auto', unsupported laws are reported skipped."""
    auto = "auto" in s.laws
    laws = AUTO_LAWS if auto else s.laws
    k, k_src = flops_per_nd(table, s)
    counts = run_counts(len(table.run_id), s.bootstrap, s.seed)
    fits = {}
    for law in laws:
        t0 = time.perf_counter()
        try:
            if law == "chinchilla1":
                fits[law] = allocation.approach1(table, counts, s.ci)
            elif law == "chinchilla2":
                fits[law] = allocation.approach2(table, counts, s.ci, s.isoflop_tol)
            else:
                fits[law] = fit_form(get_form(law), table, counts, s, k)
        except ScalingDataError as e:
            if not auto:
                raise ScalingDataError(f"cell {table.cell[0]!r}: {e}") from None
            fits[law] = {"skipped": str(e)}
            continue
        fits[law]["time_s"] = round(time.perf_counter() - t0, 3)
    return {"summary": summary(table), "flops_per_nd": {"k": k, "source": k_src}, "fits": fits}


def fit_cells(runs, curves=None, settings: FitSettings | None = None) -> dict:
    """Fit every (architecture, objective) cell and compare them.

    `runs` is a RunTable, or rows from study.registry.load_runs (then `curves` are rows from
    load_curves). Returns a JSON-able dict: settings, data choices, per-cell fits with
    intervals, and the cross-cell comparison.
    """
    from scalestudy.scaling.report import compare_cells, strip_private

    s = settings or FitSettings()
    table = runs if isinstance(runs, RunTable) else table_from_rows(runs, curves, s.data)
    t0 = time.perf_counter()
    cells = {c: fit_cell(table.subset(c), s) for c in table.cells()}
    result = {
        "settings": {**asdict(s), "data": asdict(s.data)},
        "data": table.choices,
        "cells": cells,
    }
    result["comparison"] = compare_cells(result, s)
    result["time_s"] = round(time.perf_counter() - t0, 3)
    return strip_private(result)


def fit_main(args) -> int:
    """`scalestudy fit`: fit, print a table (or JSON), optionally write the JSON."""
    from scalestudy.scaling.report import format_table, settings_from_args, write_json

    settings, source = settings_from_args(args)
    from scalestudy.scaling.io import load_table

    table = load_table(source, settings.data)
    result = fit_cells(table, settings=settings)
    if args.out:
        write_json(result, args.out)
    if args.json:
        import json

        print(json.dumps(result, indent=2, default=str))
    else:
        print(format_table(result))
    return 0


def analyze_study(study: Any, out: Path, runs: list, curves: list) -> tuple[dict, list[Path]]:
    """The fits and figures of a finished study (`run_study(analyze=...)`).

    `study` is the study spec (its `fit` section chooses laws, N, C and the bootstrap);
    writes `out/fits.json` and `out/figures/`. When the spec asks for a law the data cannot
    support (e.g. too few sizes), fits every law the data do support instead, with a warning.
    """
    from scalestudy.scaling.plots import make_all_plots
    from scalestudy.scaling.report import write_json

    f = study.fit
    settings = FitSettings(
        laws=tuple(f.laws),
        data=DataSettings(n_kind=f.n_kind, c_kind=f.c_kind),
        bootstrap=f.bootstrap,
        seed=f.seed,
    )
    try:
        fits = fit_cells(runs, curves, settings)
    except ScalingDataError as e:
        warnings.warn(f"fit: {e}; fitting the laws the data support instead", stacklevel=2)
        fits = fit_cells(runs, curves, replace(settings, laws=("auto",)))
    write_json(fits, Path(out) / "fits.json")
    return fits, make_all_plots(runs, curves, fits, Path(out) / "figures")
