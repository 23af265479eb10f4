"""Task scaling laws: zero-shot accuracy predicted from scale in two steps.

The method of the model-ladder work (Bhagia et al. 2024, "Establishing Task Scaling Laws via
Compute-Efficient Model Ladders") and of Llama 3's downstream prediction:
1. task loss L_t, the normalised negative log-likelihood of the correct answer (per task,
   `eval/<task>/task_loss` by default), as a scaling law in N and D (`chinchilla3`, as Bhagia
   et al.) or in N, D or C alone (`kaplan_*`); `auto` takes chinchilla3 where N and D each
   take 3 or more values independently of each other and L_t(N) = (N_c/N)^alpha_N + E
   otherwise (a ladder at fixed tokens, or at a fixed ratio of tokens to parameters);
   fitted like the loss laws (the same objective and starting grids);
2. accuracy as a sigmoid of task loss: acc = b + a / (1 + exp(k (L_t - L0))), with b fixed at
   the task's chance accuracy when the table records it (`eval/<task>/chance`), else fitted,
   and a <= 1 - b: every prediction, and every end of its interval, lies in [b, 1].
Intervals come from one bootstrap over runs that refits both steps, so a prediction carries
the uncertainty of both. The backtest fits on every size but the largest and predicts the
largest size's accuracy: its error (predicted - observed) with an interval that holds the
law's uncertainty (the bootstrap over runs) and the held-out runs' own run-to-run variation
(`run_variance`, pooled over the fitted sizes' repeats, drawn from a t on its degrees of
freedom); without repeats the interval holds the law's uncertainty only, and the report says
so.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import least_squares
from scipy.special import expit

from scalestudy.scaling.flags import (
    fit_flags,
    outlier_flags,
    outlier_points,
    param_flags,
    points_flag,
    prediction_span_flag,
)
from scalestudy.scaling.forms import get_form
from scalestudy.scaling.optimize import fit_delta, fit_weighted, point_fit
from scalestudy.scaling.resample import interval, strata, stratified_counts, summarise
from scalestudy.scaling.table import RunTable, ScalingDataError

TASK_FORMS = ("auto", "chinchilla3", "chinchilla3_noE", "kaplan_n", "kaplan_d", "kaplan_c")
SIGMOID = "acc = b + a / (1 + exp(k (L_t - L0)))"
FLAT_ACC = 0.02  # accuracies spanning less than this cannot place a sigmoid
# A task's groups get laws of their own up to this many (each costs a bootstrap of both steps).
MAX_GROUPS = 8


def task_names(
    table: RunTable,
    loss_metric: str = "task_loss",
    acc_metric: str = "acc",
    max_groups: int = MAX_GROUPS,
) -> list[str]:
    """Tasks with both a task-loss and an accuracy column (`eval/<task>/<metric>`), and the
    groups of a task with at most `max_groups` of them (`eval/<task>/<group>/<metric>`, named
    `<task>/<group>`: the synthetic probes, say, but not BLiMP's 67 paradigms)."""
    names = []
    for col in table.extra:
        parts = col.split("/")
        is_loss = len(parts) in (3, 4) and parts[0] == "eval" and parts[-1] == loss_metric
        name = "/".join(parts[1:-1])
        if is_loss and f"eval/{name}/{acc_metric}" in table.extra:
            names.append(name)
    groups: dict[str, int] = {}
    for name in names:
        if "/" in name:
            groups[name.split("/")[0]] = groups.get(name.split("/")[0], 0) + 1
    return sorted(n for n in names if "/" not in n or groups[n.split("/")[0]] <= max_groups)


def varies_independently(N: np.ndarray, D: np.ndarray, max_corr: float = 0.99) -> bool:
    """Whether N and D each take 3 or more values and are not tied to each other: a ladder at
    a fixed ratio of tokens to parameters (D = r N) has log D a linear function of log N, and
    a law in N and D is then not identifiable, only one in N."""
    ok = np.isfinite(N) & np.isfinite(D) & (N > 0) & (D > 0)
    logN, logD = np.log(N[ok]), np.log(D[ok])
    if min(np.unique(np.round(v, 9)).size for v in (logN, logD)) < 3:
        return False
    return abs(float(np.corrcoef(logN, logD)[0, 1])) < max_corr


def sigmoid(L: np.ndarray, p: np.ndarray) -> np.ndarray:
    """acc at task loss L for parameters p = (L0, k, a, b) along p's last axis; broadcasts
    (p [K, 1, 4] with L [K, P] gives [K, P])."""
    p = np.asarray(p, dtype=np.float64)
    L0, k, a, b = (p[..., i] for i in range(4))
    with np.errstate(over="ignore"):
        return b + a / (1.0 + np.exp(k * (np.asarray(L) - L0)))


def sigmoid_jacobian(L: np.ndarray, p) -> np.ndarray:
    """d sigmoid(L, p) / d (L0, k, a, b) [P, 4]: with s = 1 / (1 + exp(k (L - L0))),
    ds/dL0 = k s (1 - s) and ds/dk = -(L - L0) s (1 - s). The fits pass it to the solver,
    which would otherwise difference every parameter numerically (most of a report's time)."""
    L = np.asarray(L, dtype=np.float64)
    L0, k, a = float(p[0]), float(p[1]), float(p[2])
    s = expit(-k * (L - L0))
    ds = s * (1.0 - s)
    return np.stack([a * k * ds, -a * (L - L0) * ds, s, np.ones_like(L)], axis=1)


def fit_sigmoid(L_P, acc_P, w_P, chance: float | None, start=None) -> np.ndarray:
    """(L0, k, a, b) by weighted least squares; b = chance when given; k >= 0, b in [0, 1]
    and a in [0, 1 - b], so that accuracy stays within [b, 1] at every task loss.

    From a grid of starting points, or from `start` alone (a bootstrap resample starts from
    the point fit: nine starts per resample made the bootstrap the slowest part of a report).
    """
    L_P, acc_P, w_P = (np.asarray(v, dtype=np.float64) for v in (L_P, acc_P, w_P))
    keep = w_P > 0
    L, acc, sw = L_P[keep], acc_P[keep], np.sqrt(w_P[keep])
    spread = max(float(np.ptp(L)), 1e-3)
    b0 = chance if chance is not None else float(acc.min())
    if start is None:
        starts = [
            (L0, k, max(float(acc.max()) - b0, 1e-3), b0)
            for L0 in np.percentile(L, [25.0, 50.0, 75.0])
            for k in (1.0 / spread, 4.0 / spread, 16.0 / spread)
        ]
    else:
        starts = [tuple(np.asarray(start, dtype=np.float64))]
    n_free = 4 if chance is None else 3

    # Fitted as (L0, k, c, b) with a = c (1 - b), c in [0, 1]: a + b <= 1 is then a box
    # constraint, which the solver's bounds can hold (a in [0, 1] let accuracy reach 1 + b).
    def full(q):
        b = q[3] if chance is None else chance
        return [q[0], q[1], q[2] * (1.0 - b), b]

    def resid(q):
        return sw * (sigmoid(L, full(q)) - acc)

    def jac(q):
        p = full(q)
        J = sigmoid_jacobian(L, p)
        J = np.stack([J[:, 0], J[:, 1], J[:, 2] * (1.0 - p[3]), J[:, 3] - q[2] * J[:, 2]], 1)
        return sw[:, None] * J[:, :n_free]

    lo = np.array([-np.inf, 0.0, 0.0, 0.0][:n_free])
    hi = np.array([np.inf, np.inf, 1.0, 1.0][:n_free])
    best = None
    for L0, k, a0, b_start in starts:
        c0 = a0 / max(1.0 - (b_start if chance is None else chance), 1e-12)
        x0 = np.clip([L0, k, c0, b_start][:n_free], lo + 1e-9, hi - 1e-9)
        r = least_squares(resid, x0, jac=jac, bounds=(lo, hi))
        if best is None or r.cost < best.cost:
            best = r
    return np.asarray(full(best.x), dtype=np.float64)


def _points(table: RunTable, task: str, form, loss_metric: str, acc_metric: str):
    """Runs usable for one task: finite task loss, accuracy and every input of the form."""
    L = table.extra[f"eval/{task}/{loss_metric}"]
    acc = table.extra[f"eval/{task}/{acc_metric}"]
    cols = {"N": table.N, "D": table.D, "C": table.C}
    ok = np.isfinite(L) & (L > 0) & np.isfinite(acc)
    for v in form.inputs:
        ok &= np.isfinite(cols[v]) & (cols[v] > 0)
    idx = np.flatnonzero(ok)
    x = np.log(np.stack([cols[v][idx] for v in form.inputs]))
    return idx, x, L[idx], acc[idx]


def _chance(table: RunTable, task: str, idx) -> float | None:
    col = table.extra.get(f"eval/{task}/chance")
    if col is None or not np.isfinite(col[idx]).any():
        return None
    return float(np.nanmean(col[idx]))


def _two_steps(form, x, L, acc, counts_RP, chance, s):
    """Point fit and bootstrap of both steps: (theta, sig, theta_R, sig_R, grid)."""
    y = np.log(L)
    grid = form.grid(x)
    theta = point_fit(form, x, y, np.ones_like(y), fit_delta(form, s.huber_delta), grid)
    sig = fit_sigmoid(L, acc, np.ones_like(L), chance)
    theta_R = np.zeros((0, len(theta)))
    sig_R = np.zeros((0, 4))
    if len(counts_RP):
        theta_R = fit_weighted(
            form,
            grid,
            theta,
            x,
            y,
            counts_RP,
            fit_delta(form, s.huber_delta),
            s.top_k,
        )
        sig_R = np.array([fit_sigmoid(L, acc, w, chance, start=sig) for w in counts_RP])
    return theta, sig, theta_R, sig_R


def _predict(form, theta_KQ, sig_K4, x_VP):
    """(task loss [K, P], accuracy [K, P]) of each parameter row at inputs x."""
    logL, _ = form.predict(np.atleast_2d(theta_KQ), x_VP)
    L = np.exp(logL)
    return L, sigmoid(L, np.atleast_2d(sig_K4)[:, None, :])


def _enough_points(
    table: RunTable, task: str, form, form_name: str, loss_metric: str, acc_metric: str
) -> tuple:
    """`_points` of a task, refused when too few runs or sizes are left to fit `form`."""
    idx, x, L, acc = _points(table, task, form, loss_metric, acc_metric)
    n_params = len(form.params)
    distinct = min(np.unique(np.round(v, 9)).size for v in x)
    if len(idx) < n_params + 1 or distinct < 3:
        raise ScalingDataError(
            f"task {task!r}: {len(idx)} run(s) with task loss and accuracy; the {form_name} "
            f"law of task loss needs at least {n_params + 1} runs and 3 or more distinct values of "
            f"{' and '.join(form.inputs)}"
        )
    return idx, x, L, acc


def fit_task(
    table: RunTable,
    task: str,
    s,
    form_name: str = "auto",
    holdout_largest: bool = False,
    loss_metric: str = "task_loss",
    acc_metric: str = "acc",
) -> dict:
    """Both steps of one task's law for one cell's runs, with intervals, flags and backtest.

    `s` is a `laws.FitSettings` (bootstrap, seed, ci, huber_delta, top_k, min_points_per_param).
    """
    if form_name not in TASK_FORMS:
        raise ScalingDataError(f"task-law form {form_name!r}; accepted: {', '.join(TASK_FORMS)}")
    if form_name == "auto":
        form_name = "chinchilla3" if varies_independently(table.N, table.D) else "kaplan_n"
    form = get_form(form_name)
    idx, x, L, acc = _enough_points(table, task, form, form_name, loss_metric, acc_metric)
    n_params = len(form.params)
    chance = _chance(table, task, idx)
    counts, _ = stratified_counts(strata(table.N[idx], table.D[idx]), s.bootstrap, s.seed)
    theta, sig, theta_R, sig_R = _two_steps(form, x, L, acc, counts, chance, s)
    point = {n: v[0] for n, v in form.named(theta[None]).items()}
    samples = form.named(theta_R) if len(theta_R) else {}
    params = summarise(point, samples, s.ci)
    pred_L, pred_acc = _predict(form, theta, sig, x)
    resid = np.log(L) - np.log(pred_L[0])
    ids = [table.run_id[i] for i in idx]
    flags = points_flag(len(idx), n_params, s.min_points_per_param, "runs")
    flags += param_flags(params, samples, s.ci, float(L.min()))
    flags += fit_flags(
        resid, x[0], table.N[idx], table.D[idx], f"log {form.inputs[0]}", len(form.inputs) == 2
    )
    if len(theta_R):
        pred_R, _ = _predict(form, theta_R, sig_R, x)
        flags += prediction_span_flag(pred_L[0], pred_R, s.ci, np.exp(x[0]), form.inputs[0])
    flags += outlier_flags(resid, ids, outlier_points(resid))[0]
    sig_params, sig_flags = _sigmoid_summary(sig, sig_R, acc, chance, len(idx), s)
    out = {
        "runs": ids,
        "task_loss": {
            "form": form_name,
            "formula": "L_t = " + form.formula().split(" = ")[-1],
            "params": params,
            "theta": theta.tolist(),
            "rmse_log": float(np.sqrt(np.mean(resid**2))),
            "flags": flags,
        },
        "accuracy": {
            "formula": SIGMOID,
            "params": sig_params,
            "chance_fixed": chance,
            "rmse": float(np.sqrt(np.mean((pred_acc[0] - acc) ** 2))),
            "flags": sig_flags,
        },
    }
    if holdout_largest:
        out["backtest"] = backtest(table, task, form, s, loss_metric, acc_metric)
    return out


def _sigmoid_summary(
    sig: np.ndarray, sig_R: np.ndarray, acc: np.ndarray, chance: float | None, n_runs: int, s
) -> tuple[dict, list[str]]:
    """The accuracy step's parameters (with intervals) and its flags: too few runs, or an
    accuracy too flat to place the sigmoid."""
    sig_names = ("L0", "k", "a", "b")
    sig_params = summarise(
        dict(zip(sig_names, sig)),
        {n: sig_R[:, i] for i, n in enumerate(sig_names)} if len(sig_R) else {},
        s.ci,
    )
    # A fixed chance level leaves 3 free parameters of the 4.
    sig_flags = points_flag(n_runs, 3 if chance is not None else 4, s.min_points_per_param)
    if np.ptp(acc) < FLAT_ACC:
        sig_flags.append(
            f"flat: accuracy spans {np.ptp(acc):.3g} over the runs (under {FLAT_ACC}): the "
            "sigmoid's position and slope are not determined (accuracy does not yet move "
            "with scale)"
        )
    return sig_params, sig_flags


def backtest(table: RunTable, task: str, form, s, loss_metric: str, acc_metric: str) -> dict:
    """Fit both steps on every size but the largest N; predict the largest size's accuracy."""
    idx, x, L, acc = _points(table, task, form, loss_metric, acc_metric)
    N = table.N[idx]
    held = np.isclose(N, N.max())
    if np.unique(N[~held]).size < 3 or (~held).sum() < len(form.params) + 1:
        return {"skipped": "too few sizes left to fit after holding out the largest (3 needed)"}
    chance = _chance(table, task, idx)
    fitted = idx[~held]
    counts, _ = stratified_counts(strata(table.N[fitted], table.D[fitted]), s.bootstrap, s.seed)
    theta, sig, theta_R, sig_R = _two_steps(
        form, x[:, ~held], L[~held], acc[~held], counts, chance, s
    )
    xh = x[:, held]
    pL, pacc = _predict(form, theta, sig, xh)
    observed = float(acc[held].mean())
    predicted = float(pacc[0].mean())
    out = {
        "held_out": [table.run_id[i] for i in idx[held]],
        "N": float(N.max()),
        "observed": observed,
        "predicted": predicted,
        "error": predicted - observed,
        "task_loss_observed": float(L[held].mean()),
        "task_loss_predicted": float(pL[0].mean()),
        "predicted_ci": None,
        "error_ci": None,
    }
    n_col = table.extra.get(f"eval/{task}/n")
    if n_col is not None and np.isfinite(n_col[idx[held]]).all():
        n = float(n_col[idx[held]].sum())
        half = 1.959964 * np.sqrt(max(observed * (1 - observed), 1e-12) / max(n, 1.0))
        out["observed_ci"] = [observed - half, observed + half]
    var, df = run_variance(N[~held], acc[~held])
    out["run_sd"], out["run_df"] = (float(np.sqrt(var)), df) if df else (None, 0)
    if len(theta_R):
        _, pacc_R = _predict(form, theta_R, sig_R, xh)
        samples = pacc_R.mean(axis=1)
        out["predicted_ci"] = interval(samples, s.ci)[0]
        if df:  # the held-out runs' own draw: their mean varies by var / n about the law
            rng = np.random.default_rng(s.seed + 1)
            n_held = int(held.sum())
            samples = samples + rng.standard_t(df, samples.size) * np.sqrt(var / n_held)
            # An accuracy the runs could score lies in [0, 1] (below chance by bad luck).
            samples = np.clip(samples, 0.0, 1.0)
        out["error_ci"] = interval(samples - observed, s.ci)[0]
    return out


def run_variance(sizes: np.ndarray, acc: np.ndarray) -> tuple[float, int]:
    """(pooled variance of one run's accuracy about its size's mean, degrees of freedom)
    over the sizes trained by two or more runs; (nan, 0) without repeats. The run is the
    unit: what a retrained run at a size would score, seed and all."""
    ss, df = 0.0, 0
    for size in np.unique(sizes):
        a = acc[sizes == size]
        if a.size > 1:
            ss += float(((a - a.mean()) ** 2).sum())
            df += a.size - 1
    return (ss / df, df) if df else (float("nan"), 0)


def _fit_cell(sub: RunTable, tasks: list[str], *args) -> dict:
    """Every task's law of one cell's runs (`fit_task`'s arguments after the task)."""
    out = {}
    for task in tasks:
        try:
            out[task] = fit_task(sub, task, *args)
        except ScalingDataError as e:
            out[task] = {"skipped": str(e)}
    return out


def fit_task_laws(
    table: RunTable,
    s,
    form_name: str = "auto",
    holdout_largest: bool = False,
    loss_metric: str = "task_loss",
    acc_metric: str = "acc",
    tasks: list[str] | None = None,
    workers: int = 1,
) -> dict:
    """Task laws of every task with task loss and accuracy (or of `tasks`), per cell; a task
    or cell without enough runs is reported skipped with the reason. With `workers` > 1 the
    cells are fitted in that many processes (each fit is seeded on its own: the same
    numbers as in one process)."""
    tasks = task_names(table, loss_metric, acc_metric) if tasks is None else tasks
    if not tasks:
        raise ScalingDataError(
            f"no task has both eval/<task>/{loss_metric} and eval/<task>/{acc_metric} columns; "
            "task laws need the task loss (normalised NLL of the correct answer) per run"
        )
    subs = {cell: table.subset(cell) for cell in table.cells()}
    args = (tasks, s, form_name, holdout_largest, loss_metric, acc_metric)
    if workers > 1 and len(subs) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        spawn = multiprocessing.get_context("spawn")  # no forked JAX runtime
        with ProcessPoolExecutor(min(workers, len(subs)), mp_context=spawn) as pool:
            futures = {cell: pool.submit(_fit_cell, sub, *args) for cell, sub in subs.items()}
            cells = {cell: future.result() for cell, future in futures.items()}
    else:
        cells = {cell: _fit_cell(sub, *args) for cell, sub in subs.items()}
    return {
        "method": "two-step: task loss law, then a sigmoid from task loss to accuracy",
        "form": form_name,
        "metrics": {"task_loss": loss_metric, "accuracy": acc_metric},
        "bootstrap": s.bootstrap,
        "cells": cells,
    }


def task_loss_from_examples(logprob_gold, n_units_gold) -> float:
    """A task's task loss from per-example scores: the mean over examples of the correct
    answer's negative log-likelihood per unit. The evaluator's `eval/<task>/task_loss` is this
    with bytes as the unit (each record's gold choice: `logprob` over `bytes`)."""
    lp = np.asarray(logprob_gold, dtype=np.float64)
    n = np.asarray(n_units_gold, dtype=np.float64)
    if lp.shape != n.shape or not lp.size or (n <= 0).any():
        raise ScalingDataError(
            "per-example scores: one correct-answer log-likelihood and a positive length per "
            "example are needed"
        )
    return float(np.mean(-lp / n))
