"""A study's runs as tables for the scaling library: the input side of `scalestudy fit` and
`scalestudy plot` (a registry, a study directory, or a CSV/TSV/JSONL table), and the fits and
figures a study's report shows.
"""

from __future__ import annotations

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
    with a warning.
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
    write_json(fits, Path(out) / "fits.json")
    return fits, make_all_plots(table, fits, Path(out) / "figures")
