"""Compute-optimal answers at given budgets: N_opt, D_opt and D/N with bootstrap intervals.

From approach 3 (N_opt = G (C/k)^a, D_opt = C / (k N_opt)) and approaches 1 and 2
(N_opt = G C^a, D_opt = H C^b, each line fitted on its own). Every answer outside the runs'
compute range carries an `extrapolation` flag saying how far out it is.
"""

from __future__ import annotations

import numpy as np

from scalestudy.scaling.bootstrap import interval
from scalestudy.scaling.flags import extrapolation
from scalestudy.scaling.forms import get_form

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
