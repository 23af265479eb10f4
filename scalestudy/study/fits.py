"""A study's runs as tables for the scaling library: the input side of `scalestudy fit` and
`scalestudy plot` (a registry, a study directory, or a CSV/TSV/JSONL table), and the fits and
figures a study's report shows.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

from scalestudy.scaling.io import build_table
from scalestudy.scaling.io import load_table as load_table_file
from scalestudy.scaling.laws import FitSettings, fit_cells
from scalestudy.scaling.plots import make_all_plots
from scalestudy.scaling.report import write_json
from scalestudy.scaling.table import DataSettings, RunTable, ScalingDataError
from scalestudy.scaling.task_law import fit_task_laws, task_names
from scalestudy.study.registry import load_curves, load_runs

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
    runs: list[dict], curves: list[dict] | None = None, settings: DataSettings | None = None
) -> RunTable:
    """A RunTable from registry rows (`registry.load_runs`, `registry.load_curves`)."""
    return build_table(runs, curves, settings or DataSettings(), "registry")


def load_table(source: str | Path, settings: DataSettings | None = None) -> RunTable:
    """The runs of a registry (a file or a study directory) or a CSV/TSV/JSONL table."""
    path = Path(source)
    if not path.exists():
        raise ScalingDataError(f"runs source not found: {path}")
    registry = find_registry(path)
    if registry is None:
        return load_table_file(path, settings)
    table = registry_table(load_runs(registry), load_curves(registry), settings)
    table.choices["source"] = str(source)
    return table


def fit_study(study: Any, out: Path, runs: list, curves: list) -> tuple[dict, list[Path]]:
    """The fits and figures of a finished study's runs (registry rows); writes `out/fits.json`
    and `out/figures/`.

    The spec's `fit` section chooses laws, N, C and the bootstrap. When it asks for a law the
    data cannot support (e.g. too few sizes), every law the data do support is fitted instead,
    with a warning. Tasks with a task loss get task laws with the largest-size backtest.
    """
    f = study.fit
    settings = FitSettings(
        laws=tuple(f.laws),
        data=DataSettings(n_kind=f.n_kind, c_kind=f.c_kind),
        bootstrap=f.bootstrap,
        seed=f.seed,
    )
    table = registry_table(runs, curves, settings.data)
    try:
        fits = fit_cells(table, settings)
    except ScalingDataError as e:
        warnings.warn(f"fit: {e}; fitting the laws the data support instead", stacklevel=2)
        fits = fit_cells(table, replace(settings, laws=("auto",)))
    if task_names(table):
        try:
            fits["task_laws"] = fit_task_laws(table, settings, holdout_largest=True)
        except ScalingDataError as e:
            fits["task_laws"] = {"skipped": str(e)}
    write_json(fits, Path(out) / "fits.json")
    return fits, make_all_plots(table, fits, Path(out) / "figures")


def fmt(x: Any, spec: str = ".3g") -> str:
    """A number for a report ('-' when missing or not finite)."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, spec)


def _iv(ci) -> str:
    return f" [{fmt(ci[0])}, {fmt(ci[1])}]" if ci else ""


def fits_lines(fits: dict[str, Any]) -> list[str]:
    """The report's fits: per cell and law the fitted formula and each parameter with its
    bootstrap interval; then the task laws and their backtests, when fitted."""
    if not fits.get("cells"):
        return []
    data = fits.get("data", {})
    ci = fits.get("settings", {}).get("ci", 0.95)
    lines = [
        f"Each cell's own validation loss, fitted separately (N = {data.get('N')}, "
        f"C = {data.get('C')}); {ci:.0%} intervals from "
        f"{fits.get('settings', {}).get('bootstrap')} bootstrap resamples of runs.",
        "",
        "| cell | law | formula | parameters |",
        "|---|---|---|---|",
    ]
    for cell, v in fits["cells"].items():
        for law, fit in v.get("fits", {}).items():
            if "skipped" in fit:
                lines.append(f"| {cell} | {law} | skipped: {fit['skipped']} | |")
                continue
            params = []
            for name, p in fit.get("params", {}).items():
                iv = p.get("ci")
                span = f" [{fmt(iv[0])}, {fmt(iv[1])}]" if iv else ""
                params.append(f"{name} = {fmt(p.get('value'))}{span}")
            formula = str(fit.get("formula", "")).replace("|", "/")
            if fit.get("points_used"):
                formula += f" (points: {fit['points_used']})"
            flags = [str(f).replace("|", "/") for f in fit.get("flags", [])]
            warn = f" **flagged**: {' / '.join(flags)}" if flags else ""
            lines.append(f"| {cell} | {law} | {formula} | {'; '.join(params)}{warn} |")
    return lines + _task_law_lines(fits.get("task_laws"))


def _task_law_lines(laws: dict[str, Any] | None) -> list[str]:
    """Task laws: per cell and task, both steps and the backtest of the largest size."""
    if not laws:
        return []
    if "skipped" in laws:
        return ["", f"Task laws were not fitted: {laws['skipped']}"]
    m = laws["metrics"]
    lines = [
        "",
        f"**Task laws** ({laws['method']}; task loss `{m['task_loss']}`, accuracy "
        f"`{m['accuracy']}`). Backtest: fitted on every size but the largest, then the "
        "largest size's accuracy predicted; error = predicted - observed.",
        "",
        "| cell | task | task-loss law | accuracy from task loss | backtest (largest N) |",
        "|---|---|---|---|---|",
    ]
    for cell, tasks in laws["cells"].items():
        for task, fit in tasks.items():
            if "skipped" in fit:
                lines.append(f"| {cell} | {task} | skipped: {fit['skipped']} | | |")
                continue
            cols = []
            for step in ("task_loss", "accuracy"):
                part = fit[step]
                params = "; ".join(
                    f"{k} = {fmt(p['value'])}{_iv(p.get('ci'))}" for k, p in part["params"].items()
                )
                flags = " / ".join(part["flags"])
                cols.append(
                    f"{part['formula']}: {params}" + (f" **flagged**: {flags}" if flags else "")
                )
            bt = fit.get("backtest") or {}
            if "skipped" in bt or not bt:
                cols.append(bt.get("skipped", "-"))
            else:
                cols.append(
                    f"N = {fmt(bt['N'])}: predicted {bt['predicted']:.3f}"
                    f"{_iv(bt['predicted_ci'])}, observed {bt['observed']:.3f}"
                    f"{_iv(bt.get('observed_ci'))}, error {bt['error']:+.3f}{_iv(bt['error_ci'])}"
                )
            cells = " | ".join(c.replace("|", "/") for c in cols)
            lines.append(f"| {cell} | {task} | {cells} |")
    return lines
