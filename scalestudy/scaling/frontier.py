"""Points that end finished schedules: the compute-efficient frontier (for L(C)) and
Chinchilla approach 1 (N_opt(C) = G C^a, D_opt(C) = H C^b through the lowest-loss run at
each FLOP budget).

A loss logged mid-way through a learning-rate schedule is above what a run trained to that
compute reaches, so only points that end a finished schedule count: curve points declared as
ends of decayed schedules (cooldown branches from a warmup-stable-decay run, Hägele et al.
2024; `DataSettings.curve_points = "finished"`), else each run's final validation loss
(separate runs, one finished schedule each).
"""

from __future__ import annotations

import numpy as np

from scalestudy.scaling.allocation import allocation_result, isoflop_groups, power_laws
from scalestudy.scaling.flags import repeat_groups, seed_flag
from scalestudy.scaling.table import RunTable, ScalingDataError, finished_curves


def envelope(table: RunTable, n_budgets: int = 80):
    """Loss of every run's curve at log-spaced budgets: (budgets_B, loss_JB, D_JB); inf outside."""
    ids = [r for r in table.run_id if r in table.curves]
    if len(ids) < 2:
        raise ScalingDataError(
            "approach 1 (and the compute frontier) need training curves for at least 2 runs; "
            f"found {len(ids)}; give a registry with curves or a table with --run-col"
        )
    lo = min(table.curves[r]["C"].min() for r in ids)
    hi = max(table.curves[r]["C"].max() for r in ids)
    budgets = np.geomspace(lo, hi, n_budgets)
    lb = np.log(budgets)
    loss = np.full((len(table.run_id), n_budgets), np.inf)
    dd = np.full_like(loss, np.nan)
    for j, r in enumerate(table.run_id):
        if r not in table.curves:
            continue
        c = table.curves[r]
        lc = np.log(c["C"])
        inside = (lb >= lc[0]) & (lb <= lc[-1])
        loss[j, inside] = np.exp(np.interp(lb[inside], lc, np.log(c["loss"])))
        dd[j, inside] = np.exp(np.interp(lb[inside], lc, np.log(c["D"])))
    return budgets, loss, dd


def approach1(table: RunTable, counts_RJ: np.ndarray, s) -> dict:
    """Chinchilla approach 1: minimum loss over runs per FLOP budget -> N_opt(C), D_opt(C).

    Only points that end a finished schedule count: the envelope of curves whose points are
    ends of decayed schedules (cooldown branches), else the runs' final losses grouped into
    budgets. Losses logged mid-way through a schedule are refused: mid-schedule, a run's loss
    is above what a run trained to that compute reaches.
    """
    if not finished_curves(table):
        return _approach1_finals(table, counts_RJ, s)
    budgets, loss_JB, d_JB = envelope(table)
    logc = np.log(budgets)
    present = np.concatenate([np.ones((1, len(table.run_id))), counts_RJ]) > 0  # row 0: all
    masked = np.where(present[:, :, None], loss_JB[None], np.inf)  # [R+1, J, B]
    best = masked.argmin(axis=1)
    valid = np.isfinite(np.take_along_axis(masked, best[:, None], 1)[:, 0])
    # A budget reached by only one run says nothing about the optimum there.
    valid &= np.isfinite(masked).sum(axis=1) >= 2
    logn = np.log(table.N)[best]
    logd = np.log(np.where(np.isnan(d_JB), 1.0, d_JB))[best, np.arange(len(budgets))]
    w = valid.astype(float)
    R1 = len(w)
    laws = power_laws(np.broadcast_to(logc, (R1, len(logc))), logn, logd, w)
    point = {k: v[:1] for k, v in laws.items()}
    sizes = np.unique(table.N[best[0][valid[0]]])
    if valid[0].sum() < 2:
        raise ScalingDataError("approach 1: fewer than 2 FLOP budgets are covered by 2+ runs")
    return allocation_result(
        point,
        {k: v[1:] for k, v in laws.items()},
        s,
        {
            "n_budgets": int(valid[0].sum()),
            "frontier": {
                "C": budgets[valid[0]].tolist(),
                "loss": np.take_along_axis(loss_JB, best[0][None], 0)[0][valid[0]].tolist(),
                "N": np.exp(logn[0][valid[0]]).tolist(),
                "D": np.exp(logd[0][valid[0]]).tolist(),
            },
        },
        int(sizes.size),
        "distinct model sizes on the loss envelope",
    ) | {"points_used": FINISHED_CURVES}


FINISHED_CURVES = "envelope of finished-schedule points (each the end of a decayed schedule)"
FINAL_POINTS = (
    "final validation loss of each run (each a finished schedule); mid-schedule training "
    "curves not used"
)


def _approach1_finals(table: RunTable, counts_RJ: np.ndarray, s) -> dict:
    """Approach 1 from the runs' final losses: per budget, the size of the lowest loss."""
    groups, gflags = isoflop_groups(table.C, s.isoflop_tol)
    present = np.concatenate([np.ones((1, len(table.run_id))), counts_RJ]) > 0  # row 0: all
    budgets = [g for g in np.unique(groups) if (groups == g).sum() >= 2]
    if len(budgets) < 2:
        raise ScalingDataError(
            "approach 1 needs finished-schedule points at 2 or more FLOP budgets with 2 or more "
            f"runs each (found {len(budgets)}); mid-schedule training losses are not used. Train "
            "sizes to common budgets (separate runs or cooldown branches), or give curve rows "
            "that end finished schedules (--curve-points finished)"
        )
    R1 = len(present)
    logc, logn, logd = (np.zeros((R1, len(budgets))) for _ in range(3))
    w = np.zeros((R1, len(budgets)))
    for b, g in enumerate(budgets):
        member = groups == g
        loss_RJ = np.where(present & member[None], table.loss[None], np.inf)
        best = loss_RJ.argmin(axis=1)
        ok = (np.isfinite(loss_RJ).sum(axis=1) >= 2).astype(float)
        logc[:, b], logn[:, b], logd[:, b] = (np.log(a[best]) for a in (table.C, table.N, table.D))
        w[:, b] = ok
    laws = power_laws(logc, logn, logd, w)
    return allocation_result(
        {k: v[:1] for k, v in laws.items()},
        {k: v[1:] for k, v in laws.items()},
        s,
        {
            "n_budgets": len(budgets),
            "points_used": FINAL_POINTS,
            "frontier": {
                "C": np.exp(logc[0]).tolist(),
                "N": np.exp(logn[0]).tolist(),
                "D": np.exp(logd[0]).tolist(),
            },
            "flags": gflags + seed_flag(table.N, table.D),
        },
        int(np.unique(logn[0]).size),
        "distinct model sizes at the budgets' minima",
    )


def frontier_points(table: RunTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(C, loss, run index) of the compute-efficient frontier: the envelope of curves whose
    points end finished schedules (cooldown branches), else the final losses of the points no
    cheaper point beats (`final_frontier`: seeds of one point judged together; a curve logged
    mid-schedule is never used).

    The envelope is taken only at compute where at least two curves compete, plus the end of
    the longest run: beyond the second-longest run's end a single curve is left, mid-way
    through its learning-rate schedule, and its loss there says nothing about what that
    compute buys (a run trained to exactly that compute ends lower)."""
    if finished_curves(table) and sum(r in table.curves for r in table.run_id) >= 2:
        budgets, loss_JB, _ = envelope(table, n_budgets=40)
        best = loss_JB.argmin(axis=0)
        lb = loss_JB[best, np.arange(len(budgets))]
        ok = np.isfinite(loss_JB).sum(axis=0) >= 2
        last = max(
            (j for j, r in enumerate(table.run_id) if r in table.curves),
            key=lambda j: table.curves[table.run_id[j]]["C"][-1],
        )
        end = table.curves[table.run_id[last]]
        c = np.append(budgets[ok], end["C"][-1])
        return c, np.append(lb[ok], end["loss"][-1]), np.append(best[ok], last)
    idx = final_frontier(table)
    return table.C[idx], table.loss[idx], idx


def final_frontier(table: RunTable) -> np.ndarray:
    """Indices of the runs on the frontier of final losses, every seed of each point kept.

    Seeds of one planned run (`repeat_groups` on C, N and D) are one point, judged by their
    mean log loss: a point is on the frontier when no cheaper point's mean is lower, and then
    all its runs are, so a lucky seed is not picked and an unlucky one not dropped (as the laws
    in N keep every seed of the best training length). Without repeats this is the runs that
    no cheaper run beats."""
    cols = [table.C] + [a for a in (table.N, table.D) if np.isfinite(a).all()]
    groups = repeat_groups(np.log(np.stack(cols).astype(float)))
    mean_c = [float(np.mean(table.C[g])) for g in groups]
    keep, best = [], np.inf
    for i in np.argsort(mean_c, kind="stable"):
        m = float(np.mean(np.log(table.loss[groups[i]])))
        if m < best:
            keep += groups[i].tolist()
            best = m
    return np.array(sorted(keep, key=lambda j: (table.C[j], j)), dtype=int)
