"""How far a fit can be trusted, by resampling runs: bootstrap multiplicities and percentile
intervals, and out-of-sample errors (held-out largest-compute runs, k-fold or leave-one-out
cross-validation; each fold is a weight vector, so all folds are fitted at once by the same
batched optimiser as the bootstrap)."""

from __future__ import annotations

import numpy as np
from scipy import stats

from scalestudy.scaling.flags import repeat_groups
from scalestudy.scaling.forms import Form
from scalestudy.scaling.optimize import fit_delta, fit_weighted, point_fit
from scalestudy.scaling.table import RunTable


def run_counts(n_runs: int, resamples: int, seed: int) -> np.ndarray:
    """Multiplicities [R, J] of J runs in R bootstrap resamples (runs drawn with replacement)."""
    rng = np.random.default_rng(seed)
    if resamples <= 0:
        return np.zeros((0, n_runs))
    return rng.multinomial(n_runs, np.full(n_runs, 1.0 / n_runs), size=resamples).astype(float)


def strata(N_J: np.ndarray, D_J: np.ndarray) -> np.ndarray:
    """A label per run: its size, the (N, D) point its seeds repeat (`repeat_groups`; D left
    out where a run lacks it); runs without N are each their own."""
    rows = [N_J] + ([D_J] if np.isfinite(D_J).all() else [])
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.log(np.stack(rows).astype(float))
    label = np.arange(x.shape[1])
    for g in repeat_groups(x):
        label[g] = g[0]
    return label


def stratified_counts(strata_J, resamples: int, seed: int) -> tuple[np.ndarray, int]:
    """Multiplicities [R, J] of J runs drawn within their stratum (a label per run: its size),
    and the degrees of freedom of the within-size spread they resample (the sum of n - 1 over
    the sizes trained more than once). No resample loses a size.

    A size of n >= 2 runs draws n - 1 of them with replacement, each weighted n / (n - 1): it
    keeps the weight of n runs, and its mean varies by s^2 / n, the variance of a mean of n
    runs (n draws of n would give (n - 1) / n of it: 2/3 at three seeds). Sizes trained once
    have nothing within them to resample and are resampled among themselves as one stratum;
    with no size trained twice this is `run_counts`.
    """
    labels = np.asarray(strata_J)
    groups = [np.flatnonzero(labels == g) for g in np.unique(labels)]
    single = np.array([g[0] for g in groups if len(g) == 1], dtype=int)
    repeated = [g for g in groups if len(g) > 1]
    if not repeated:
        return run_counts(len(labels), resamples, seed), 0
    rng = np.random.default_rng(seed)
    out = np.zeros((max(resamples, 0), len(labels)))
    if resamples <= 0:
        return out, 0
    for g in repeated:
        n = len(g)
        out[:, g] = rng.multinomial(n - 1, np.full(n, 1.0 / n), size=resamples) * (n / (n - 1))
    if single.size:
        k = single.size
        out[:, single] = rng.multinomial(k, np.full(k, 1.0 / k), size=resamples)
    return out, sum(len(g) - 1 for g in repeated)


def widen(theta_Q: np.ndarray, theta_RQ: np.ndarray, df: int, ci: float) -> np.ndarray:
    """Resampled parameter vectors moved away from the point fit by t_df / z at level `ci`
    (1 where df is 0): each size's spread is estimated from a few runs, and a percentile
    interval that took it as known would cover as a z interval does where t's are due
    (coverage at the smoke study's design: docs/fits.md)."""
    if df <= 0 or not len(theta_RQ):
        return theta_RQ
    q = (1.0 + ci) / 2.0
    scale = float(stats.t.ppf(q, df) / stats.norm.ppf(q))
    return theta_Q[None] + scale * (theta_RQ - theta_Q[None])


def interval(samples: np.ndarray, ci: float) -> tuple[list[float] | None, int]:
    """Percentile interval of the finite samples and how many samples were not finite."""
    s = np.asarray(samples, dtype=np.float64)
    ok = np.isfinite(s)
    if ok.sum() < 2:
        return None, int((~ok).sum())
    lo, hi = np.percentile(s[ok], [50.0 * (1.0 - ci), 50.0 * (1.0 + ci)])
    return [float(lo), float(hi)], int((~ok).sum())


def summarise(point: dict[str, float], samples: dict[str, np.ndarray], ci: float) -> dict:
    """{name: {"value", "ci"}} for every named quantity; 'ci' is null without resamples."""
    out = {}
    for name, value in point.items():
        entry = {"value": _clean(value)}
        if name in samples and len(samples[name]):
            entry["ci"], bad = interval(samples[name], ci)
            if bad:
                entry["ci_failed_resamples"] = bad
        else:
            entry["ci"] = None
        out[name] = entry
    return out


def _clean(v) -> float | None:
    v = float(v)
    return v if np.isfinite(v) else None


def holdout(form: Form, table: RunTable, x, y, run, grid, s) -> dict:
    """Refit without the points of the `holdout` largest-compute runs; their errors."""
    held_runs = np.argsort(table.C)[::-1][: s.holdout]
    held = np.isin(run, held_runs)
    if not held.any():
        return {"error": f"none of the {s.holdout} largest-compute runs is a point of this law"}
    if (~held).sum() < len(form.params) + 1:
        return {"error": f"too few points left after holding out {s.holdout} runs"}
    theta = point_fit(form, x, y, (~held).astype(float), fit_delta(form, s.huber_delta), grid)
    pred, _ = form.predict(theta[None], x[:, held])
    err = y[held] - pred[0]
    return {
        "runs": [table.run_id[j] for j in run[held]],
        "rmse_log": float(np.sqrt(np.mean(err**2))),
        "rel_err": (np.exp(-err) - 1.0).tolist(),  # predicted / observed - 1
    }


def kfold(form: Form, x_VP, y_P, theta_Q, grid, s) -> dict:
    """k-fold (s.kfold >= 2) or leave-one-out (s.kfold == -1) error of the law's predictions.

    Points are assigned to folds in a fixed random order (`s.seed`); each point is predicted
    by the fit without its fold. Reports the out-of-sample RMSE of log loss beside the
    in-sample one, so a law that only fits its own points shows a large gap.
    """
    P = len(y_P)
    k = P if s.kfold == -1 else min(s.kfold, P)
    if P - int(np.ceil(P / k)) < len(form.params) + 1:
        return {
            "error": f"too few points ({P}) for {k}-fold validation of {len(form.params)} "
            "parameters"
        }
    fold_P = np.random.default_rng(s.seed).permutation(P) % k
    w_KP = (fold_P[None] != np.arange(k)[:, None]).astype(float)
    theta_KQ = fit_weighted(
        form,
        grid,
        theta_Q,
        x_VP,
        y_P,
        w_KP,
        fit_delta(form, s.huber_delta),
        s.top_k,
    )
    pred_KP, _ = form.predict(theta_KQ, x_VP)
    err_P = y_P - pred_KP[fold_P, np.arange(P)]
    full, _ = form.predict(theta_Q[None], x_VP)
    return {
        "folds": int(k),
        "kind": "leave-one-out" if k == P else f"{k}-fold",
        "rmse_log": float(np.sqrt(np.mean(err_P**2))),
        "in_sample_rmse_log": float(np.sqrt(np.mean((y_P - full[0]) ** 2))),
        "max_abs_log": float(np.abs(err_P).max()),
    }
