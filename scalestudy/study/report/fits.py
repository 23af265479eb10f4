"""A study's runs as tables for the scaling library: the input side of `scalestudy fit` and
`scalestudy plot` (a registry, a study directory, or a CSV/TSV/JSONL table), and the fits and
figures a study's report shows.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from scalestudy.config.errors import not_found
from scalestudy.scaling import render
from scalestudy.scaling.fit_plots import make_all_plots
from scalestudy.scaling.fit_text import write_json
from scalestudy.scaling.forms import FORM_LAWS, get_form
from scalestudy.scaling.laws import FitSettings, fit_cells
from scalestudy.scaling.table import DataSettings, RunTable, ScalingDataError, to_float
from scalestudy.scaling.table_input import build_table
from scalestudy.scaling.table_input import load_table as load_table_file
from scalestudy.study.record.rows import CurvePoint, RunRow, read_curves, read_planned
from scalestudy.study.report.task_law_report import study_task_laws

REGISTRY_SUFFIXES = (".sqlite", ".sqlite3", ".db")


def find_registry(path: Path) -> Path | None:
    """The registry file for `path` (itself, or the single one inside a study directory)."""
    if path.is_file() and path.suffix in REGISTRY_SUFFIXES:
        return path
    if path.is_dir():
        found = sorted(p for s in REGISTRY_SUFFIXES for p in path.glob(f"*{s}"))
        if len(found) > 1:
            raise ScalingDataError(
                f"{path} holds several registries ({', '.join(p.name for p in found)}); "
                "pass one file"
            )
        if found:
            return found[0]
        raise ScalingDataError(f"no study registry (*.sqlite, *.db) in directory {path}")
    return None


def registry_table(
    runs: list[RunRow],
    curves: list[CurvePoint] | None = None,
    settings: DataSettings | None = None,
    by_variant: bool = False,
) -> RunTable:
    """A RunTable from a study's runs (`rows.read_rows`) and curves (`rows.read_curves`),
    each run a row of the table as the registry holds it (`RunRow.as_dict`; with
    `by_variant`, a `cell` column naming its cell with the variant, `RunRow.cell`).

    N is `params_total`, `params_non_embedding` or `params_active` (`settings.n_kind`;
    E and G, for the MoE laws, come from `experts` and `granularity`), D the processed
    positions or loss-bearing tokens (`d_kind`), C the counted `flops`, the loss the final
    validation loss; runs without one yet are left out and counted. The curves are training
    losses logged mid-schedule (never ends of finished schedules)."""
    s = settings or DataSettings()
    if not runs:
        raise ScalingDataError("no runs to fit")
    if s.curve_points == "finished":
        raise ScalingDataError(
            "a registry's curves are training loss logged mid-schedule, not ends of finished "
            "schedules; record cooldown branches as runs of their own instead"
        )
    if s.n_kind not in ("total", "non_embedding", "active"):
        raise ScalingDataError(f"n_kind {s.n_kind!r}; accepted: total, non_embedding, active")
    if s.d_kind not in ("positions", "tokens"):
        raise ScalingDataError(f"d_kind {s.d_kind!r}; accepted: positions, tokens")
    loss_col = s.loss_col or "loss"
    finished = [r for r in runs if math.isfinite(to_float(r.value(loss_col)))]
    if not finished:
        raise ScalingDataError("the registry has no finished runs (with a final loss) yet")
    columns = replace(
        s,
        n_col=s.n_col or f"params_{s.n_kind}",
        d_col=s.d_col or s.d_kind,
        c_col=s.c_col or "flops",
        loss_col=loss_col,
        run_col="run_id",
    )
    rows = [r.as_dict() | ({"cell": r.cell} if by_variant else {}) for r in finished]
    table = build_table(rows, columns, "registry")
    table.choices["N"] += f" ({s.n_kind} parameters)"
    table.choices["D"] += f" ({s.d_kind})"
    table.choices["unfinished_runs_left_out"] = len(runs) - len(finished)
    if curves:
        table.curves = _curves(curves, table)
    return table


def _curves(rows: list[CurvePoint], table: RunTable) -> dict[str, dict]:
    """Each run's logged curve as C, D and training loss."""
    # A point at fraction s of a run's training (by counted FLOPs) has s*C and s*D of the
    # run's final C and D, whatever C and D convention was chosen.
    final = {r: i for i, r in enumerate(table.run_id)}
    pts: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        r = str(row.run_id)
        if r in final:
            pts.setdefault(r, []).append((to_float(row.flops), to_float(row.loss)))
    out = {}
    for r, p in pts.items():
        f, loss = np.array(sorted(p)).T
        ok = np.isfinite(f) & np.isfinite(loss) & (f > 0) & (loss > 0)
        if ok.sum() < 2:
            continue
        frac = f[ok] / f[ok].max()
        i = final[r]
        out[r] = {"C": frac * table.C[i], "D": frac * table.D[i], "loss": loss[ok]}
    return out


def load_table(source: str | Path, settings: DataSettings | None = None) -> RunTable:
    """The runs of a registry (a file or a study directory) or a CSV/TSV/JSONL table."""
    path = Path(source)
    if not (path.is_file() or path.is_dir()):
        raise ScalingDataError(
            not_found(path, "runs source", "a registry, a study directory or a table file")
        )
    registry = find_registry(path)
    if registry is None:
        if settings is not None and settings.all_runs:
            raise ScalingDataError(
                f"--all-runs selects a study registry's runs; {path} is a table file, whose "
                "rows are all read"
            )
        return load_table_file(path, settings)
    runs, gone = read_planned(registry, every=settings is not None and settings.all_runs)
    if gone and not runs:
        raise ScalingDataError(
            f"{registry}: none of its {len(gone)} runs is planned by the spec the study last "
            "ran with; fit them with --all-runs, or run the study with their spec again"
        )
    kept = {r.run_id for r in runs}
    curves = read_curves(registry, kept)
    table = registry_table(runs, curves, settings)
    table.choices["source"] = str(source)
    if gone:  # as the study's report does: what its spec no longer plans is not its data
        table.choices["unplanned_runs_left_out"] = gone
    return table


def pools_variants(laws: Any) -> bool:
    """Whether `laws` take a variant's routed experts E or granularity G as an input (the MoE
    laws), so that the variants of an architecture x objective are fitted together; every
    other law fits each variant alone."""
    return any(law in FORM_LAWS and {"E", "G"} & set(get_form(law).inputs) for law in laws)


def fit_study(
    study: Any, out: Path, runs: list[RunRow], curves: list[CurvePoint]
) -> tuple[dict, list[Path]]:
    """The fits and figures of a finished study's runs (registry rows); writes `out/fits.json`
    and `out/figures/`.

    The spec's `fit` section chooses laws, N, C and the bootstrap (`task_bootstrap`, where
    set, for the task laws). When it asks for a law a cell's data cannot support (e.g. too
    few sizes), every law that cell's data do support is fitted for it instead, with a
    warning; the other cells keep the spec's laws. Tasks with a task loss get task laws with
    the largest-size backtest. A study's variants are cells of their own, except for laws
    that take the variants' experts or granularity as an input (`pools_variants`).
    """
    f = study.fit
    pooled = pools_variants(f.laws)
    settings = FitSettings(
        laws=tuple(f.laws),
        data=DataSettings(
            n_kind=f.n_kind, c_kind=f.c_kind, group_cols=None if pooled else ("cell",)
        ),
        bootstrap=f.bootstrap,
        seed=f.seed,
    )
    # each variant a cell of its own, as in the report's comparisons, unless pooled
    table = registry_table(runs, curves, settings.data, by_variant=not pooled)
    fits = fit_cells(table, settings, fallback=replace(settings, laws=("auto",)))
    tasks = settings if f.task_bootstrap is None else replace(settings, bootstrap=f.task_bootstrap)
    fits["task_laws"] = study_task_laws(table, tasks)
    write_json(fits, Path(out) / "fits.json")
    return fits, make_all_plots(table, fits, Path(out) / "figures")


def fmt(x: Any) -> str:
    """A number for a report in 3 significant digits ('-' when missing or not finite)."""
    return render.num(x, ".3g")


def fits_lines(fits: dict[str, Any]) -> list[str]:
    """The report's fits: per cell and law the fitted formula and each parameter with its
    bootstrap interval (the task laws have a section of their own: `task_laws.section`)."""
    if not fits.get("cells"):
        return []
    data = fits.get("data", {})
    ci = fits.get("settings", {}).get("ci", 0.95)
    lines = [
        f"Each cell's own validation loss, fitted separately (N = {data.get('N')}, "
        f"C = {data.get('C')}); {ci:.0%} intervals from "
        f"{fits.get('settings', {}).get('bootstrap')} bootstrap resamples of runs.",
        "",
    ]
    rows: list[list[Any]] = []
    for cell, v in fits["cells"].items():
        for law, fit in v.get("fits", {}).items():
            if "skipped" in fit:
                rows.append([cell, law, f"skipped: {fit['skipped']}", render.BLANK])
                continue
            params = []
            for name, p in fit.get("params", {}).items():
                span = render.bracket(p.get("ci"), fmt)
                params.append(f"{name} = {fmt(p.get('value'))}{span}")
            formula = str(fit.get("formula", "")).replace("|", "/")
            if fit.get("points_used"):
                formula += f" (points: {fit['points_used']})"
            flags = [str(f).replace("|", "/") for f in fit.get("flags", [])]
            warn = f" **flagged**: {' / '.join(flags)}" if flags else ""
            rows.append([cell, law, formula, f"{'; '.join(params)}{warn}"])
    lines += render.table(["cell", "law", "formula", "parameters"], rows)
    along = sorted(
        {
            fit["along"].split(":")[0]
            for v in fits["cells"].values()
            for fit in v.get("fits", {}).values()
            if fit.get("along")
        }
    )
    if along:
        lines += [
            "",
            f"{' and '.join(along)}: each rung trains its own step count, so a law over the "
            "rungs is one of size and training length together; its exponent is the ladder's, "
            "not one at a fixed value of the other input.",
        ]
    return lines
