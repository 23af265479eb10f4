"""Cross-cell comparison, the readable table, JSON output and the command-line settings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from scalestudy.scaling import render
from scalestudy.scaling.flags import extrapolation
from scalestudy.scaling.forms import get_form
from scalestudy.scaling.intervals import span
from scalestudy.scaling.resample import interval
from scalestudy.scaling.table import ScalingDataError


def loss_at_compute(law: str, theta_KQ: np.ndarray, C: np.ndarray, k: float) -> np.ndarray:
    """Predicted loss [K, len(C)]: on the compute-optimal allocation (chinchilla3) or the
    compute frontier law (kaplan_c)."""
    form = get_form(law)
    p = form.named(np.atleast_2d(theta_KQ))
    C = np.asarray(C, dtype=np.float64)[None]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if law.startswith("chinchilla3"):
            al, be = p["alpha"][:, None], p["beta"][:, None]
            A, B = p["A"][:, None], p["B"][:, None]
            G = (al * A / (be * B)) ** (1.0 / (al + be))
            n = G * (C / k) ** (be / (al + be))
            d = (C / k) / n
            E = p.get("E", np.zeros(len(al)))[:, None]
            return E + A / n**al + B / d**be
        if law.startswith("kaplan_c"):
            E = p.get("E", np.zeros(len(p["alpha_C"])))[:, None]
            return (p["C_c"][:, None] / C) ** p["alpha_C"][:, None] + E
    raise ScalingDataError(f"law {law!r} does not predict loss from compute")


def _comparable(cell: dict) -> str | None:
    for law in ("chinchilla3", "chinchilla3_noE", "kaplan_c", "kaplan_c_noE"):
        if "theta" in cell["fits"].get(law, {}):
            return law
    return None


def _first_crossing(diff_KG: np.ndarray, logc_G: np.ndarray) -> np.ndarray:
    """Compute of the first sign change of each row (NaN if none), log-interpolated."""
    s = np.sign(diff_KG)
    change = (s[:, :-1] * s[:, 1:]) < 0
    out = np.full(len(diff_KG), np.nan)
    rows, cols = np.nonzero(change)
    first = {}
    for r, c in zip(rows, cols):
        first.setdefault(r, c)
    for r, c in first.items():
        d0, d1 = diff_KG[r, c], diff_KG[r, c + 1]
        out[r] = np.exp(logc_G[c] + (logc_G[c + 1] - logc_G[c]) * d0 / (d0 - d1))
    return out


def compare_cells(result: dict, s) -> dict:
    """Predicted loss per cell at given budgets (with intervals) and pairwise crossovers."""
    cells = {
        c: (law, v)
        for c, v in result["cells"].items()
        if (law := _comparable(v)) is not None and v["summary"]["C"] is not None
    }
    if not cells:
        return {"skipped": "no cell has a chinchilla3 or kaplan_c fit"}
    cmax = max(v["summary"]["C"][1] for _, v in cells.values())
    cmin = min(v["summary"]["C"][0] for _, v in cells.values())
    budgets = np.array(s.compare_at or [cmax, 10 * cmax, 100 * cmax], dtype=np.float64)
    grid = np.geomspace(cmin / 10.0, cmax * 1e6, 241)
    pred, samp = {}, {}
    for c, (law, v) in cells.items():
        k = v["flops_per_nd"]["k"]
        pred[c] = (
            loss_at_compute(law, np.array(v["fits"][law]["theta"]), budgets, k)[0],
            loss_at_compute(law, np.array(v["fits"][law]["theta"]), grid, k)[0],
        )
        ts = v["fits"][law].get("_theta_samples")
        if ts is not None and len(ts):
            samp[c] = (loss_at_compute(law, ts, budgets, k), loss_at_compute(law, ts, grid, k))
    at = []
    for i, b in enumerate(budgets):
        entry = {}
        for c in cells:
            ci = interval(samp[c][0][:, i], s.ci)[0] if c in samp else None
            entry[c] = {"loss": float(pred[c][0][i]), "ci": ci}
        best = min(entry, key=lambda c: entry[c]["loss"])
        far = extrapolation(float(b), [cmin, cmax])
        at.append({"C": float(b), "cells": entry, "best": best, "extrapolation": far})
    crossings = []
    names = sorted(cells)
    for i, c1 in enumerate(names):
        for c2 in names[i + 1 :]:
            crossings.append(_crossover(c1, c2, pred, samp, grid, s.ci))
    objectives = {c.split("/")[-1] for c in cells}
    note = None
    if "objective" in result["data"].get("groups", []) and len(objectives) > 1:
        note = (
            "cells with different objectives have losses on different targets; compare their "
            "losses within an objective, and across objectives on zero-shot accuracy"
        )
    return {
        "law": {c: law for c, (law, _) in cells.items()},
        "at": at,
        "crossovers": crossings,
        "search_range_C": [grid[0], grid[-1]],
        "note": note,
    }


def _crossover(c1: str, c2: str, pred: dict, samp: dict, grid: np.ndarray, ci: float) -> dict:
    """Where cell c2's predicted loss first crosses c1's on the compute grid (None if never),
    and its interval over the resamples that cross."""
    d = pred[c1][1] - pred[c2][1]
    cross = _first_crossing(d[None], np.log(grid))[0]
    entry = {"cells": [c1, c2], "C": None if np.isnan(cross) else float(cross)}
    if not np.isnan(cross):
        lower = c1 if d[0] < 0 else c2
        other = c2 if lower == c1 else c1
        entry["meaning"] = f"{other} overtakes {lower} above C = {cross:.3g} FLOPs"
    if c1 in samp and c2 in samp:
        R = min(len(samp[c1][1]), len(samp[c2][1]))
        bc = _first_crossing(samp[c1][1][:R] - samp[c2][1][:R], np.log(grid))
        # Over the resamples that cross at all; their share is reported beside it.
        ok = np.isfinite(bc).sum() >= 2
        entry["ci_among_crossing_resamples"] = interval(bc, ci)[0] if ok else None
        entry["fraction_of_resamples_crossing"] = float(np.isfinite(bc).mean())
    return entry


# ----------------------------------------------------------------------------- output


def strip_private(obj):
    """The result without in-memory keys (leading '_') and with numpy scalars as floats."""
    if isinstance(obj, dict):
        return {k: strip_private(v) for k, v in obj.items() if not str(k).startswith("_")}
    if isinstance(obj, list | tuple):
        return [strip_private(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, float) and not np.isfinite(obj):
        return None
    return obj


def write_json(result: dict, path: str | Path) -> Path:
    """Write the fit result as JSON (creating parent directories)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(strip_private(result), indent=2))
    return path


def _g(v) -> str:
    return "-" if v is None else f"{v:.4g}"


def _ci(ci) -> str:
    return render.bracket(ci, _g)


def _fit_lines(law: str, fit: dict) -> list[str]:
    """One law's lines: formula, parameters with intervals, validation, answers and flags."""
    if "skipped" in fit:
        return [f"  {law:<16} skipped: {fit['skipped']}"]
    extra = f"rmse(log) {fit['residuals']['rmse_log']:.3g}" if "residuals" in fit else ""
    mark = "  FLAGGED" if fit.get("flags") else ""
    lines = [f"  {law:<16} {fit['formula']}   {extra}{mark}"]
    if fit.get("along"):
        lines.append(f"      {fit['along']}")
    for name, p in fit["params"].items():
        lines.append(f"      {name:<8} {_g(p['value']):>11}  {_ci(p.get('ci'))}")
    if "published" in fit:
        said = ", ".join(f"{k} {_g(v)}" for k, v in fit["published"].items())
        lines.append(f"      published: {said} (their scale, not this study's)")
    if "holdout" in fit and "rmse_log" in fit["holdout"]:
        lines.append(f"      held-out rmse(log) {fit['holdout']['rmse_log']:.3g}")
    cv = fit.get("crossval")
    if cv:
        if "rmse_log" in cv:
            lines.append(
                f"      {cv['kind']} rmse({cv.get('of', 'log L')}) {cv['rmse_log']:.3g} "
                f"(in-sample {cv['in_sample_rmse_log']:.3g})"
            )
        else:
            lines.append(f"      cross-validation: {cv['error']}")
    for a in fit.get("at_compute", []):
        lines.append(
            f"      at C={a['C']:.3g}: N_opt {_g(a['N_opt']['value'])}{_ci(a['N_opt']['ci'])}, "
            f"D_opt {_g(a['D_opt']['value'])}{_ci(a['D_opt']['ci'])}, "
            f"D/N {_g(a['D_per_N']['value'])}{_ci(a['D_per_N']['ci'])}"
        )
        if a.get("extrapolation"):
            lines.append(f"        ! {a['extrapolation']}")
    return lines + [f"      ! {f}" for f in fit.get("flags", [])]


def format_table(result: dict) -> str:
    """A readable summary: per cell and law, each parameter with its interval, and flags."""
    s, d = result["settings"], result["data"]
    lines = [
        f"data: N: {d.get('N')}; D: {d.get('D')}; C: {d.get('C')}",
        f"bootstrap: {s['bootstrap']} resamples of runs, seed {s['seed']}, "
        f"{s['ci']:.0%} percentile intervals; Kaplan forms by least squares in log space, "
        f"Chinchilla approach 3 by Huber (delta {s['huber_delta']}) in log space",
    ]
    if d.get("filters"):
        lines.append(f"filters: {'; '.join(d['filters'])}")
    if gone := d.get("unplanned_runs_left_out"):
        lines.append(
            f"left out: {len(gone)} run(s) of the registry that the study's spec no longer "
            f"plans ({', '.join(gone)})"
        )
    for cell, v in result["cells"].items():
        sm = v["summary"]
        lines += [
            "",
            f"== {cell}: {sm['runs']} runs, {sm['distinct_N']} sizes, C in "
            f"[{_g(sm['C'] and sm['C'][0])}, {_g(sm['C'] and sm['C'][1])}] FLOPs",
        ]
        for law, fit in v["fits"].items():
            lines += _fit_lines(law, fit)
    cmp_ = result.get("comparison", {})
    if "at" in cmp_:
        lines += ["", "== comparison (predicted loss at compute)"]
        for row in cmp_["at"]:
            cells = ", ".join(
                f"{c} {_g(e['loss'])}"
                + (f" [{_g(e['ci'][0])}, {_g(e['ci'][1])}]" if e["ci"] else "")
                for c, e in row["cells"].items()
            )
            lines.append(f"  C={row['C']:.3g}: {cells}; best {row['best']}")
            if row.get("extrapolation"):
                lines.append(f"    ! {row['extrapolation']}")
        for x in cmp_["crossovers"]:
            if x["C"] is not None:
                lines.append(f"  {x['meaning']}")
        if cmp_.get("note"):
            lines.append(f"  note: {cmp_['note']}")
    return "\n".join(lines)


def _params_line(params: dict) -> str:
    return ", ".join(f"{k} {_g(p['value'])}{_ci(p.get('ci'))}" for k, p in params.items())


def format_task_laws(task_laws: dict) -> str:
    """A readable summary of task laws: per cell and task, both steps and the backtest."""
    m = task_laws["metrics"]
    lines = [
        f"task laws ({task_laws['method']}); task loss: eval/<task>/{m['task_loss']}, "
        f"accuracy: eval/<task>/{m['accuracy']}"
    ]
    for cell, tasks in task_laws["cells"].items():
        for task, fit in tasks.items():
            lines.append(f"\n== {cell} / {task}")
            if "skipped" in fit:
                lines.append(f"  skipped: {fit['skipped']}")
                continue
            tl, acc = fit["task_loss"], fit["accuracy"]
            lines.append(f"  {tl['formula']}   rmse(log) {tl['rmse_log']:.3g}")
            lines.append(f"      {_params_line(tl['params'])}")
            lines += [f"      ! {f}" for f in tl["flags"]]
            fixed = (
                ""
                if acc["chance_fixed"] is None
                else f" (b fixed at chance {acc['chance_fixed']:.3g})"
            )
            lines.append(f"  {acc['formula']}{fixed}   rmse {acc['rmse']:.3g}")
            lines.append(f"      {_params_line(acc['params'])}")
            lines += [f"      ! {f}" for f in acc["flags"]]
            bt = fit.get("backtest")
            if bt and "skipped" in bt:
                lines.append(f"  backtest skipped: {bt['skipped']}")
            elif bt:
                err = bt["error_ci"]
                err = span(bt["error"], *err) if err else f"{bt['error']:+.3f}"
                lines.append(
                    f"  backtest at N = {bt['N']:.3g} (held out {len(bt['held_out'])} run(s)): "
                    f"predicted {bt['predicted']:.3f}{_ci(bt['predicted_ci'])}, observed "
                    f"{bt['observed']:.3f}{_ci(bt.get('observed_ci'))}, error {err}"
                )
    return "\n".join(lines)
