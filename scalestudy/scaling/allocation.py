"""Compute-optimal allocation from runs: Chinchilla approach 2, and answers at budgets.

Approach 2 groups runs into IsoFLOP budgets, fits a parabola of loss in log N (and log D) per
budget, and fits the same power laws to the parabolas' minima. Both bootstrap over runs with
the multiplicities from `resample.run_counts` (approach 1 and the compute frontier are
`scaling/frontier.py`).

Compute-optimal answers at given budgets (`at_compute`): N_opt, D_opt and D/N with bootstrap
intervals, from approach 3 (N_opt = G (C/k)^a, D_opt = C / (k N_opt)) or approaches 1 and 2
(N_opt = G C^a, D_opt = H C^b, each line fitted on its own). Every answer outside the runs'
compute range carries an `extrapolation` flag saying how far out it is.
"""

from __future__ import annotations

import re

import numpy as np

from scalestudy.scaling.flags import extrapolation, param_flags, points_flag, seed_flag
from scalestudy.scaling.forms import get_form
from scalestudy.scaling.resample import interval, summarise
from scalestudy.scaling.table import RunTable, ScalingDataError


def loglinear(logc_RB: np.ndarray, logy_RB: np.ndarray, w_RB: np.ndarray):
    """Weighted least squares of logy = intercept + slope * logc, per row: (slope, intercept)."""
    sw = w_RB.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mx = (w_RB * logc_RB).sum(axis=1) / sw
        my = (w_RB * logy_RB).sum(axis=1) / sw
        dx = logc_RB - mx[:, None]
        slope = (w_RB * dx * (logy_RB - my[:, None])).sum(axis=1) / (w_RB * dx * dx).sum(axis=1)
    ok = (w_RB > 0).sum(axis=1) >= 2
    slope = np.where(ok, slope, np.nan)
    return slope, np.where(ok, my - slope * mx, np.nan)


def power_laws(logc_RB, logn_RB, logd_RB, w_RB) -> dict[str, np.ndarray]:
    a, log_g = loglinear(logc_RB, logn_RB, w_RB)
    b, log_h = loglinear(logc_RB, logd_RB, w_RB)
    return {"a": a, "b": b, "G": np.exp(log_g), "H": np.exp(log_h)}


SAMPLES_KEPT = 200  # bootstrap values of a, G, b, H written to the JSON (for bands)


def allocation_result(point, samples, s, extra, n_points: int, what: str) -> dict:
    params = summarise({k: v[0] for k, v in point.items()}, samples, s.ci)
    # Each of N_opt(C) and D_opt(C) is a line with 2 parameters through the same points.
    flags = points_flag(n_points, 2, s.min_points_per_param, what)
    flags += param_flags(params, samples, s.ci, None)
    return {
        "formula": "N_opt = G C^a, D_opt = H C^b",
        "params": params,
        "samples": {k: np.asarray(v[:SAMPLES_KEPT]).tolist() for k, v in samples.items()},
        **extra,
        "flags": flags + extra.get("flags", []),
    }


# ----------------------------------------------------------------------------- approach 2


def isoflop_groups(C: np.ndarray, tol_dex: float) -> tuple[np.ndarray, list[str]]:
    """Budget index per run, and flags: each budget spans at most tol_dex in log10 C.

    Runs are taken in order of compute; a run opens a new budget when its log10 C lies more
    than tol_dex above the first run of the current budget. (Joining runs by the gap to their
    neighbour instead would chain a continuum of compute into one budget.) Where a cut falls
    between runs closer than tol_dex, the runs do not form separate budgets: flagged.
    """
    order = np.argsort(C)
    lc = np.log10(C[order])
    group_sorted = np.zeros(len(C), dtype=int)
    start, g = lc[0] if len(lc) else 0.0, 0
    cuts = []
    for i, v in enumerate(lc):
        if v - start > tol_dex:
            g, start = g + 1, v
            cuts.append(i)
        group_sorted[i] = g
    groups = np.empty(len(C), dtype=int)
    groups[order] = group_sorted
    close = [i for i in cuts if lc[i] - lc[i - 1] < tol_dex]
    flags = []
    if close:
        flags.append(
            f"budgets: the runs' compute does not fall into separate IsoFLOP budgets ({len(close)} "
            f"of {len(cuts)} cuts between budgets fall where runs are closer than {tol_dex} dex); "
            "the grouping is arbitrary: give a budget column (--budget-col) or --isoflop-tol"
        )
    return groups, flags


def budget_compute(label: str) -> float:
    """The compute a budget label names ('1e18', 'C1e18', '6e18 FLOPs'), or NaN."""
    m = re.search(r"[0-9.]+(?:[eE][-+]?\d+)?", str(label))
    if not m:
        return float("nan")
    try:
        v = float(m.group(0))
    except ValueError:
        return float("nan")
    return v if v > 0 else float("nan")


def _parabola_min(x_J, y_J, w_RJ, member_J):
    """Weighted parabola y = c0 + c1 x + c2 x^2 over the members; argmin x per row, NaN if bad."""
    xm = x_J[member_J]
    x0 = xm.mean()
    u = x_J - x0
    V = np.stack([np.ones_like(u), u, u * u], axis=1)  # [J, 3]
    w = w_RJ * member_J
    A = np.einsum("rj,ji,jk->rik", w, V, V)
    rhs = np.einsum("rj,ji,j->ri", w, V, y_J)
    distinct = np.array([np.unique(x_J[(wr > 0)]).size for wr in w])
    ok = distinct >= 3
    coef = np.full((len(w), 3), np.nan)
    coef[ok] = np.linalg.solve(A[ok], rhs[ok][..., None])[..., 0]
    with np.errstate(invalid="ignore", divide="ignore"):
        xmin = x0 - coef[:, 1] / (2.0 * coef[:, 2])
    inside = (xmin >= xm.min()) & (xmin <= xm.max())
    good = ok & (coef[:, 2] > 0) & inside
    return np.where(good, xmin, np.nan), coef, x0, good


def approach2(table: RunTable, counts_RJ: np.ndarray, s) -> dict:
    """Chinchilla approach 2: IsoFLOP parabolas in log N and log D -> N_opt(C), D_opt(C)."""
    groups, named, c_source, flags = _budget_groups(table, s)
    w_RJ = np.concatenate([np.ones((1, len(table.run_id))), counts_RJ])
    rows, profiles, budget_flags = _isoflop_minima(table, groups, named, c_source, w_RJ)
    flags += budget_flags
    if not rows:
        raise ScalingDataError(
            "approach 2 needs IsoFLOP budgets with at least 3 model sizes each; found none "
            f"(runs are grouped by compute within {s.isoflop_tol} dex; see --isoflop-tol)"
        )
    logc = np.array([r[0] for r in rows])[None].repeat(len(w_RJ), 0)
    ln = np.stack([r[1] for r in rows], axis=1)
    ld = np.stack([r[2] for r in rows], axis=1)
    w = (np.isfinite(ln) & np.isfinite(ld)).astype(float)
    if w[0].sum() < 2:
        raise ScalingDataError(
            f"approach 2: only {int(w[0].sum())} IsoFLOP budget(s) have a usable minimum; "
            "need at least 2"
        )
    laws = power_laws(logc, np.nan_to_num(ln), np.nan_to_num(ld), w)
    extra = {"n_budgets": int(w[0].sum()), "budget_C": c_source, "isoflop": profiles}
    if s.kfold:
        extra["crossval"] = _leave_one_budget_out(logc[0], ln[0], ld[0], w[0])
    flags += seed_flag(table.N, table.D)
    return allocation_result(
        {k: v[:1] for k, v in laws.items()},
        {k: v[1:] for k, v in laws.items()},
        s,
        {**extra, "flags": flags},
        int(w[0].sum()),
        "IsoFLOP budgets with a minimum",
    )


def _budget_groups(table: RunTable, s) -> tuple[np.ndarray, list, str, list[str]]:
    """Each run's IsoFLOP budget (an index), each budget's named compute (NaN when not a
    number), where a budget's compute comes from, and the grouping's flags."""
    if any(table.budget):
        # Budgets named by the study or a budget column: exact IsoFLOP membership, and the
        # named budget is the compute of its parabola (when the label is a number).
        labels = sorted(set(table.budget), key=lambda b: (budget_compute(b), b))
        groups = np.array([labels.index(b) for b in table.budget])
        named = [budget_compute(b) for b in labels]
        c_source = "budget labels" if np.isfinite(named).all() else "mean of runs' log C"
        return groups, named, c_source, []
    groups, flags = isoflop_groups(table.C, s.isoflop_tol)
    return groups, [np.nan] * (groups.max() + 1), "mean of runs' log C", flags


def _isoflop_minima(
    table: RunTable, groups: np.ndarray, named: list, c_source: str, w_RJ: np.ndarray
) -> tuple[list[tuple], list[dict], list[str]]:
    """Per budget with at least 3 sizes: (log C, argmin log N [R], argmin log D [R]), its
    profile for the report, and a flag for each budget whose parabola has no minimum."""
    logn, logd, loss = np.log(table.N), np.log(table.D), table.loss
    rows, profiles, flags = [], [], []
    for g in range(groups.max() + 1):
        member = groups == g
        if np.unique(table.N[member]).size < 3:
            continue
        n_min, coef, x0, good = _parabola_min(logn, loss, w_RJ, member)
        d_min, *_ = _parabola_min(logd, loss, w_RJ, member)
        c_g = named[g] if c_source == "budget labels" else np.exp(np.log(table.C[member]).mean())
        c_g = float(c_g)
        rows.append((np.log(c_g), n_min, d_min))
        profiles.append(
            {
                "C": c_g,
                "runs": int(member.sum()),
                "run_ids": [table.run_id[j] for j in np.flatnonzero(member)],
                "parabola_logN": {"c0": coef[0, 0], "c1": coef[0, 1], "c2": coef[0, 2], "x0": x0},
                # Bootstrap coefficients (c0, c1, c2; null where a resample has < 3 sizes).
                "parabola_samples": coef[1 : SAMPLES_KEPT + 1].tolist(),
                "N_opt": float(np.exp(n_min[0])) if good[0] else None,
                "D_opt": float(np.exp(d_min[0])) if np.isfinite(d_min[0]) else None,
            }
        )
        if not good[0]:
            flags.append(
                f"budget C={c_g:.3g}: the parabola has no minimum inside the sampled sizes "
                "(not convex or optimum at the edge); budget left out"
            )
    return rows, profiles, flags


def _leave_one_budget_out(logc_B, logn_B, logd_B, w_B) -> dict:
    """Each usable budget's optimum N and D predicted by the lines through the others."""
    use = np.flatnonzero(w_B > 0)
    if use.size < 3:
        return {"error": f"leave-one-budget-out needs 3 usable budgets; got {use.size}"}
    w_KB = np.repeat(w_B[None], use.size, 0)
    w_KB[np.arange(use.size), use] = 0.0  # row k leaves budget use[k] out
    C_KB = np.broadcast_to(logc_B, w_KB.shape)
    laws = power_laws(
        C_KB,
        np.broadcast_to(np.nan_to_num(logn_B), w_KB.shape),
        np.broadcast_to(np.nan_to_num(logd_B), w_KB.shape),
        w_KB,
    )
    pred_n = np.log(laws["G"]) + laws["a"] * logc_B[use]
    pred_d = np.log(laws["H"]) + laws["b"] * logc_B[use]
    err_n, err_d = logn_B[use] - pred_n, logd_B[use] - pred_d
    full = power_laws(
        logc_B[None], np.nan_to_num(logn_B)[None], np.nan_to_num(logd_B)[None], w_B[None]
    )
    fit_n = logn_B[use] - (np.log(full["G"][0]) + full["a"][0] * logc_B[use])
    return {
        "kind": "leave-one-budget-out",
        "folds": int(use.size),
        "rmse_log": float(np.sqrt(np.mean(err_n**2))),  # of N_opt
        "in_sample_rmse_log": float(np.sqrt(np.mean(fit_n**2))),
        "rmse_log_D_opt": float(np.sqrt(np.mean(err_d**2))),
        "of": "log N_opt of each budget",
    }


# ----------------------------------------------------------------------------- frontier


# ----------------------------------------------------------------------------- at budgets

ALLOCATION_LAWS = ("chinchilla1", "chinchilla2", "chinchilla3", "chinchilla3_noE")


def allocation_curves(law: str, fit: dict, k: float, C: np.ndarray):
    """(N_opt [K, B], D_opt [K, B]) for the point (row 0) and each bootstrap sample."""
    C = np.asarray(C, dtype=np.float64)[None]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if law.startswith("chinchilla3"):
            samples = fit.get("_theta_samples")
            if samples is None:
                samples = fit.get("theta_samples", [])
            theta = np.array([fit["theta"], *samples], dtype=np.float64)
            p = get_form(law).named(theta)
            al, be = p["alpha"][:, None], p["beta"][:, None]
            G = (al * p["A"][:, None] / (be * p["B"][:, None])) ** (1.0 / (al + be))
            n = G * (C / k) ** (be / (al + be))
            return n, (C / k) / n
        values = {name: v["value"] for name, v in fit["params"].items()}
        samples = fit.get("samples", {})
        cols = {
            name: np.array([values[name], *samples.get(name, [])], dtype=np.float64)[:, None]
            for name in ("a", "b", "G", "H")
        }
        return cols["G"] * C ** cols["a"], cols["H"] * C ** cols["b"]


def at_compute(law: str, fit: dict, k: float, budgets, c_range, ci: float) -> list[dict]:
    """N_opt, D_opt and D/N at each budget, with percentile intervals over the resamples."""
    n_KB, d_KB = allocation_curves(law, fit, k, budgets)
    out = []
    for i, c in enumerate(budgets):
        entry = {"C": float(c)}
        for name, arr in (("N_opt", n_KB[:, i]), ("D_opt", d_KB[:, i]), ("D_per_N", None)):
            col = d_KB[:, i] / n_KB[:, i] if arr is None else arr
            v = float(col[0])
            entry[name] = {
                "value": v if np.isfinite(v) else None,
                "ci": interval(col[1:], ci)[0] if len(col) > 2 else None,
            }
        entry["extrapolation"] = extrapolation(float(c), c_range)
        out.append(entry)
    return out
