"""Scaling-law fits: Kaplan forms, Chinchilla approaches 1-3, bootstrap intervals, allocation.

Laws (names accepted by `--law` and `FitSettings.laws`):
- kaplan_n, kaplan_d, kaplan_c: L(X) = (X_c/X)^alpha_X + E (suffix _noE: without E);
  kaplan_c is fitted to the compute-efficient frontier of points that end finished schedules
  (scaling/frontier.py). Kaplan forms are fitted by least squares in log space, as Kaplan et
  al. (2020) did.
- kaplan_nd: L(N, D) = [(N_c/N)^(alpha_N/alpha_D) + D_c/D]^alpha_D (kaplan_nd_E: + E).
- chinchilla1, chinchilla2: approaches 1 (scaling/frontier.py) and 2 (scaling/allocation.py).
- chinchilla3: L(N, D) = E + A/N^alpha + B/D^beta, fitted as in Hoffmann et al. (2022) (Huber
  loss of log residuals), with the implied compute-optimal N_opt(C) = G (C/k)^a,
  D_opt(C) = (1/G) (C/k)^b for C = k N D.
- clark_ne: log10 L(N, E) = a log10 N + b log10 E + c log10 N log10 E + d, for mixtures of E
  experts (Clark et al. 2022); krajewski_ndg: L(N, D, G) = c + (g/G^gamma + a)/N^alpha +
  b/D^beta, for granularity G (Krajewski et al. 2024), with their constants beside ours. E and
  G come from table columns (experts, granularity); `auto` does not include them.
- auto: every law the data support (the others are reported as skipped, with the reason).
Every parameter and derived exponent carries a percentile bootstrap interval over runs (drawn
within each size: `resample.stratified_counts`), and every fit a list of flags saying why the
data may not support it (scaling/flags.py). A law in N (or D) alone over rungs that vary the
other is labelled L(N, D(N)) (or L(D, N(D))).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass, field

import numpy as np

from scalestudy.scaling import allocation, frontier, resample
from scalestudy.scaling.allocation import ALLOCATION_LAWS, at_compute
from scalestudy.scaling.fit_text import compare_cells, strip_private
from scalestudy.scaling.flags import (
    SAME_POINT_REL,
    fit_flags,
    outlier_flags,
    outlier_points,
    param_flags,
    points_flag,
    prediction_span_flag,
    repeat_groups,
)
from scalestudy.scaling.forms import FORM_LAWS, Chinchilla, Form, get_form
from scalestudy.scaling.optimize import fit_delta, fit_weighted, point_fit
from scalestudy.scaling.resample import strata, stratified_counts, summarise, widen
from scalestudy.scaling.table import (
    DataSettings,
    RunTable,
    ScalingDataError,
    fingerprint,
    finished_curves,
)

LAWS = (*FORM_LAWS, "chinchilla1", "chinchilla2")
AUTO_LAWS = ("kaplan_n", "kaplan_d", "kaplan_c", "kaplan_nd", "chinchilla1", "chinchilla2")
AUTO_LAWS = (*AUTO_LAWS, "chinchilla3")
SAMPLES_KEPT = 200  # bootstrap parameter vectors written to the JSON (for bands in figures)


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
    isoflop_tol: float = 0.1  # dex: the widest spread of log10 C within one IsoFLOP budget
    top_k: int = 4  # grid starts per bootstrap resample (plus the full-data optimum)
    compare_at: tuple[float, ...] = ()  # compute budgets for the cross-cell comparison
    at_compute: tuple[float, ...] = ()  # budgets at which N_opt, D_opt and D/N are reported
    kfold: int = 0  # k-fold cross-validation of each law (0: off; -1: leave one out)
    min_points_per_param: float = 3.0  # fewer points per fitted parameter: flagged

    def __post_init__(self):
        bad = [law for law in self.laws if law not in (*LAWS, "auto")]
        if bad:
            raise ScalingDataError(f"unknown law(s) {bad}; accepted: auto, {', '.join(LAWS)}")
        _check_number("ci", self.ci, "a number in (0, 1), e.g. 0.95", lambda v: 0.0 < v < 1.0)
        _check_int("bootstrap", self.bootstrap, "0 (no intervals) or an integer >= 2", 0, 2)
        _check_int("seed", self.seed, "an integer >= 0", 0)
        _check_int("holdout", self.holdout, "an integer >= 0", 0)
        _check_int("top_k", self.top_k, "an integer >= 1", 1)
        _check_int("kfold", self.kfold, "0 (off), -1 (leave one out) or an integer >= 2", -1, 2)
        _check_number("huber_delta", self.huber_delta, "a number > 0, e.g. 1e-3", _positive)
        _check_number("isoflop_tol", self.isoflop_tol, "a number of dex > 0, e.g. 0.1", _positive)
        _check_number("min_points_per_param", self.min_points_per_param, "a number > 0", _positive)
        if self.flops_per_nd is not None:
            _check_number("flops_per_nd", self.flops_per_nd, "a number > 0, e.g. 6", _positive)
        for name in ("compare_at", "at_compute"):
            for v in getattr(self, name):
                _check_number(name, v, "compute budgets > 0 in FLOPs, e.g. 1e21", _positive)


def _positive(v: float) -> bool:
    return v > 0.0


def _check_number(name: str, value, accepted: str, ok) -> None:
    """A finite number that `ok` accepts, else an error naming the option and what is accepted."""
    flag = "--" + name.replace("_", "-")
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = float("nan")
    if isinstance(value, bool) or not np.isfinite(v) or not ok(v):
        raise ScalingDataError(f"{flag} {value!r} is not accepted; give {accepted}")


def _check_int(name: str, value, accepted: str, lowest: int, least_positive: int = 1) -> None:
    """An integer that is 0 (or `lowest`) or at least `least_positive`."""
    flag = "--" + name.replace("_", "-")
    ok = isinstance(value, int | np.integer) and not isinstance(value, bool)
    ok = ok and (lowest <= value <= 0 or value >= least_positive)
    if not ok:
        raise ScalingDataError(f"{flag} {value!r} is not accepted; give {accepted}")


# ----------------------------------------------------------------------------- form fits


def _inputs(table: RunTable, form: Form):
    """(log inputs [V, P], log loss [P], run index per point [P]) for a form."""
    if form.inputs == ("C",):
        if np.isnan(table.C).all():
            raise ScalingDataError(f"{form.name} needs compute C (or N and D for C = 6ND)")
        c, loss, run = frontier.frontier_points(table)
        return np.log(c)[None], np.log(loss), run
    cols = {"N": table.N, "D": table.D, **{v: table.extra.get(v) for v in ("E", "G")}}
    for v in form.inputs:
        if cols[v] is None or np.isnan(cols[v]).all():
            where = {"E": " (a column named experts)", "G": " (a column named granularity)"}
            raise ScalingDataError(
                f"{form.name} needs {v}, which the runs do not have{where.get(v, '')}"
            )
    x = np.log(np.stack([cols[v] for v in form.inputs]))
    run = np.arange(len(table.loss))
    if len(form.inputs) == 1:
        # L(N) and L(D) describe models not limited by the other quantity (Kaplan et al.
        # fit them near convergence): of runs sharing a value, keep the training length (the
        # other quantity) with the lowest mean loss, and every seed of it, so that repeats
        # weigh in as measurements and a lucky seed is not picked.
        other = table.D if form.inputs[0] == "N" else table.N
        run = _lowest_loss_runs(np.round(x[0], 6), np.log(other), np.log(table.loss))
        x = x[:, run]
    return x, np.log(table.loss[run]), run


def _lowest_loss_runs(key_J: np.ndarray, other_J: np.ndarray, log_loss_J: np.ndarray):
    """Indices of the runs kept for a law in one input: per value of `key_J`, the runs that
    repeat one value of `other_J` (`repeat_groups`: the seeds of one planned run) whose mean
    log loss is lowest."""
    keep: list[int] = []
    for k in np.unique(key_J):
        idx = np.flatnonzero(key_J == k)
        groups = [idx[g] for g in repeat_groups(np.nan_to_num(other_J[idx], nan=0.0)[None])]
        keep += min(groups, key=lambda g: float(np.mean(log_loss_J[g]))).tolist()
    return np.array(sorted(keep))


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


def chinchilla_allocation(named: dict[str, np.ndarray], k: float) -> dict[str, np.ndarray]:
    """Exponents a, b and coefficient G of N_opt = G (C/k)^a, D_opt = (C/k)^b / G."""
    al, be = named["alpha"], named["beta"]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        G = (al * named["A"] / (be * named["B"])) ** (1.0 / (al + be))
        return {"a": be / (al + be), "b": al / (al + be), "G": G}


def fit_form(
    form: Form, table: RunTable, counts_RJ: np.ndarray, s: FitSettings, k: float, df: int = 0
):
    """Fit one form to a cell's runs: point estimate from the full grid, bootstrap, residuals.

    `df`: the degrees of freedom of the within-size spread the resamples draw from
    (`resample.stratified_counts`); the resampled fits are widened by t_df / z (`widen`)."""
    x, y, run = _inputs(table, form)
    _check_points(form, x)
    grid = form.grid(x)
    ones = np.ones_like(y)
    theta = point_fit(form, x, y, ones, fit_delta(form, s.huber_delta), grid)
    point = {n: v[0] for n, v in form.named(theta[None]).items()}
    theta_R, samples = _bootstrap(form, grid, theta, x, y, counts_RJ, run, s, df)
    if isinstance(form, Chinchilla):
        point.update(
            {n: v[0] for n, v in chinchilla_allocation(form.named(theta[None]), k).items()}
        )
        if len(theta_R):
            samples.update(chinchilla_allocation(samples, k))
    pred, _ = form.predict(theta[None], x)
    resid = y - pred[0]
    params = summarise(point, samples, s.ci)
    ids = [table.run_id[j] for j in run]
    flags = _form_flags(form, table, x, y, run, pred[0], params, samples, theta_R, s)
    out_P = outlier_points(resid)
    outliers, outlier_runs = outlier_flags(resid, ids, out_P)
    out = {
        "formula": form.formula(),
        **_along(form, table, run),
        "params": params,
        "n_points": len(y),
        "n_params": len(form.params),
        "x_range": {
            v: [float(np.exp(r.min())), float(np.exp(r.max()))] for v, r in zip(form.inputs, x)
        },
        "theta": theta.tolist(),
        "theta_samples": theta_R[:SAMPLES_KEPT].tolist(),
        "_theta_samples": theta_R,
        "residuals": _residuals(table, x, run, resid, set(out_P.tolist()), outlier_runs),
        "flags": flags + outliers,
    }
    if note := _points_used(form, table):
        out["points_used"] = note
    if published := getattr(form, "published", None):
        out["published"] = published  # the paper's constants, beside ours
    if s.holdout > 0:
        out["holdout"] = resample.holdout(form, table, x, y, run, grid, s)
    if s.kfold:
        out["crossval"] = resample.kfold(form, x, y, theta, grid, s)
    return out


def _bootstrap(
    form: Form,
    grid,
    theta: np.ndarray,
    x: np.ndarray,
    y: np.ndarray,
    counts_RJ: np.ndarray,
    run: np.ndarray,
    s: FitSettings,
    df: int,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The resampled fits [R, P] (widened by t_df / z) and their named parameters; none
    (0 rows, no names) without resamples. `run`: each point's run (a column of `counts_RJ`)."""
    if not len(counts_RJ):
        return np.zeros((0, len(theta))), {}
    delta = fit_delta(form, s.huber_delta)
    theta_R = fit_weighted(form, grid, theta, x, y, counts_RJ[:, run], delta, s.top_k)
    theta_R = widen(theta, theta_R, df, s.ci)
    return theta_R, form.named(theta_R)


def _form_flags(
    form: Form,
    table: RunTable,
    x: np.ndarray,
    y: np.ndarray,
    run: np.ndarray,
    pred: np.ndarray,
    params: dict,
    samples: dict[str, np.ndarray],
    theta_R: np.ndarray,
    s: FitSettings,
) -> list[str]:
    """The warnings on one fit, outliers apart: too few runs, a flat fit, badly determined
    parameters or predictions, residual patterns, failed bootstrap fits."""
    resid = y - pred
    # Frontier points (L(C)) are read off the runs' curves: count the runs they come from.
    n_runs = int(np.unique(run).size)
    what = "points" if n_runs == len(y) else f"runs (behind {len(y)} frontier points)"
    flags = points_flag(n_runs, len(form.params), s.min_points_per_param, what)
    if np.ptp(pred) < 1e-3:
        flags.append(
            "flat: the fitted loss varies by less than 0.1% over the data, so the exponents "
            "are not determined (loss does not change with scale in these runs)"
        )
    flags += param_flags(params, samples, s.ci, float(np.exp(y.min())))
    if len(theta_R):
        pred_R, _ = form.predict(theta_R, x)
        v = form.inputs[0]
        flags += prediction_span_flag(np.exp(pred), np.exp(pred_R), s.ci, np.exp(x[0]), v)
    # Training and seeds are properties of the cell's runs, not only of the points kept.
    in_n_and_d = len(form.inputs) > 1 and "D" in form.inputs
    flags += fit_flags(resid, x[0], table.N, table.D, f"log {form.inputs[0]}", in_n_and_d)
    flags += [
        f"bound: {name}: {bad:.0%} of bootstrap fits failed"
        for name, v in samples.items()
        if (bad := float(np.mean(~np.isfinite(v)))) > 0.05
    ]
    return flags


def _residuals(
    table: RunTable,
    x: np.ndarray,
    run: np.ndarray,
    resid: np.ndarray,
    outlying: set[int],
    outlier_runs: list,
) -> dict:
    """A fit's residual summary and each point's log residual."""
    return {
        "rmse_log": float(np.sqrt(np.mean(resid**2))),
        "max_abs_log": float(np.abs(resid).max()),
        "outlier_runs": outlier_runs,
        "points": [
            {
                "run": table.run_id[j],
                "x": np.exp(x[:, i]).tolist(),
                "log_resid": float(r),
                "outlier": i in outlying,
            }
            for i, (j, r) in enumerate(zip(run, resid))
        ],
    }


def _points_used(form: Form, table: RunTable) -> str | None:
    """Which points a one-input law was fitted to (None for a law in several inputs)."""
    if form.inputs == ("C",):
        finished = finished_curves(table) and len(table.curves) >= 2
        return frontier.FINISHED_CURVES if finished else frontier.FINAL_POINTS
    if len(form.inputs) == 1:
        return (
            f"per distinct {form.inputs[0]}, every run of the training length with the lowest "
            "mean loss"
        )
    return None


def _along(form: Form, table: RunTable, run: np.ndarray) -> dict:
    """For a law in N (or D) alone whose runs vary the other along the ladder (each rung
    trains its own step count): the law is L(N, D(N)), and its formula and an `along` note
    say so, so that its exponent is not read as one at fixed D."""
    if len(form.inputs) != 1 or form.inputs[0] not in ("N", "D"):
        return {}
    v = form.inputs[0]
    o = "D" if v == "N" else "N"
    other = (table.D if v == "N" else table.N)[run]
    other = other[np.isfinite(other) & (other > 0)]
    if other.size < 2 or other.max() <= other.min() * (1 + 2 * SAME_POINT_REL):
        return {}
    law = f"L({v}, {o}({v}))"
    what = "tokens D" if o == "D" else "parameters N"
    return {
        "formula": law + form.formula()[len(f"L({v})") :],
        "along": (
            f"{law}: {what} vary with {v} along the ladder ({other.min():.3g} to "
            f"{other.max():.3g}), so alpha_{v} is the ladder's exponent, of {v} and {o} "
            f"together, not one of {v} at fixed {o}"
        ),
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
    # Runs are resampled within their size, so no resample loses a size (docs/fits.md).
    counts, df = stratified_counts(strata(table.N, table.D), s.bootstrap, s.seed)
    fits = {}
    for law in laws:
        t0 = time.perf_counter()
        try:
            if law == "chinchilla1":
                fits[law] = frontier.approach1(table, counts, s)
            elif law == "chinchilla2":
                fits[law] = allocation.approach2(table, counts, s)
            else:
                fits[law] = fit_form(get_form(law), table, counts, s, k, df)
        except ScalingDataError as e:
            if not auto:
                raise ScalingDataError(f"cell {table.cell[0]!r}: {e}") from None
            fits[law] = {"skipped": str(e)}
            continue
        if s.at_compute and law in ALLOCATION_LAWS:
            c_range = summary(table)["C"]
            fits[law]["at_compute"] = at_compute(law, fits[law], k, s.at_compute, c_range, s.ci)
        fits[law]["time_s"] = round(time.perf_counter() - t0, 3)
    return {"summary": summary(table), "flops_per_nd": {"k": k, "source": k_src}, "fits": fits}


def fit_cells(
    table: RunTable, settings: FitSettings | None = None, fallback: FitSettings | None = None
) -> dict:
    """Fit every cell of `table` (one per architecture/objective, or per group) and compare them.

    Returns a JSON-able dict: settings, data choices, per-cell fits with intervals, and the
    cross-cell comparison. With `fallback`, a cell whose data cannot support the asked laws
    is fitted with `fallback`'s (with a warning naming it); the other cells keep theirs.
    """
    s = settings or FitSettings()
    t0 = time.perf_counter()
    cells = {}
    for c in table.cells():
        try:
            cells[c] = fit_cell(table.subset(c), s)
        except ScalingDataError as e:
            if fallback is None:
                raise
            warnings.warn(f"fit: {e}; fitting the laws its data support instead", stacklevel=2)
            cells[c] = fit_cell(table.subset(c), fallback)
    result = {
        "settings": {**asdict(s), "data": asdict(s.data)},
        "data": table.choices,
        "data_fingerprint": fingerprint(table),
        "cells": cells,
    }
    result["comparison"] = compare_cells(result, s)
    result["time_s"] = round(time.perf_counter() - t0, 3)
    return strip_private(result)
