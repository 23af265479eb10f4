"""Building a `RunTable`: from rows (of a CSV/TSV or JSONL file, or any reader's) to the
per-run N, D, C and loss a fit uses, with units, conventions, filters and validation.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from scalestudy.config.errors import not_found
from scalestudy.scaling.select import row_mask
from scalestudy.scaling.table import (
    DataSettings,
    RunTable,
    ScalingDataError,
    parse_unit,
    to_float,
)

# Column names recognised when the user does not name them (compared case-insensitively,
# ignoring spaces, dashes and underscores).
_AUTO = {
    "n": ("n", "params", "parameters", "modelsize", "nparams", "numparams", "size"),
    "d": ("d", "tokens", "trainingtokens", "ntokens", "data", "datasize"),
    "c": ("c", "flops", "flop", "compute", "trainingflop", "trainingflops"),
    "loss": ("loss", "finalloss", "valloss", "evalloss", "validationloss"),
}

# Mixture-of-experts inputs of the MoE laws (scaling/forms.py), found by name only.
_MOE = {
    "E": ("e", "experts", "routedexperts", "numexperts", "nexperts"),
    "G": ("g", "granularity"),
}

# ----------------------------------------------------------------------------- columns


def _norm(name: str) -> str:
    return re.sub(r"[\s_\-()\[\]]", "", name.lower())


def _column(columns: list[str], given: str | None, role: str, required: bool) -> str | None:
    if given is not None:
        if given not in columns:
            raise ScalingDataError(
                f"column {given!r} (for {role}) not in the table; columns: {', '.join(columns)}"
            )
        return given
    found = [c for c in columns if _norm(c) in _AUTO[role]]
    if len(found) > 1:
        raise ScalingDataError(
            f"several columns could be {role}: {', '.join(found)}; choose one with --{role}-col"
        )
    if not found and required:
        raise ScalingDataError(
            f"no column for {role} found; name it with --{role}-col (columns: {', '.join(columns)})"
        )
    return found[0] if found else None


def _values(rows: list[dict], col: str | None, scale: float) -> np.ndarray:
    if col is None:
        return np.full(len(rows), np.nan)
    return np.array([to_float(r.get(col)) for r in rows]) * scale


def build_table(rows: Any, settings: DataSettings, kind: str) -> RunTable:
    """Rows of a table (one per run, or per curve point with repeated run ids) -> RunTable,
    applying the N/D/C choices in `settings`; `kind` names the source in the choices.
    `rows`: a list of dicts, or a pandas DataFrame (one row each)."""
    rows = as_rows(rows)
    if not rows:
        raise ScalingDataError("no runs to fit")
    columns = list(dict.fromkeys(k for r in rows for k in r))
    s = settings
    if s.curve_points not in ("mid_schedule", "finished"):
        raise ScalingDataError(f"curve_points {s.curve_points!r}; accepted: mid_schedule, finished")
    n_col = _column(columns, s.n_col, "n", required=False)
    d_col = _column(columns, s.d_col, "d", required=False)
    c_col = _column(columns, s.c_col, "c", required=False)
    loss_col = _column(columns, s.loss_col, "loss", required=True)
    run_col = _column(columns, s.run_col, "run", required=False) if s.run_col else None
    N, D, C, c_kind, desc = _sizes(rows, s, n_col, d_col, c_col)
    loss = _values(rows, loss_col, 1.0)
    groups, cell, budget = _cells(rows, columns, s)
    ids = [str(r[run_col]) if run_col else str(i) for i, r in enumerate(rows)]

    table_curves: dict[str, dict[str, np.ndarray]] = {}
    if run_col and len(set(ids)) < len(ids):
        # Repeated run ids: each row is a point of that run's training curve; the run's
        # final point (largest compute) stands for the run.
        table_curves, keep = _curves_from_rows(ids, C, D, loss)
        ids, cell = [ids[i] for i in keep], [cell[i] for i in keep]
        budget = [budget[i] for i in keep]
        N, D, C, loss, rows = N[keep], D[keep], C[keep], loss[keep], [rows[i] for i in keep]

    filters: list[str] = []
    if s.where or s.exclude:
        resolved = {"N": N, "D": D, "C": C, "loss": loss, "run": ids}
        keep_mask, filters = row_mask(s.where, s.exclude, resolved, rows)
        if not keep_mask.any():
            raise ScalingDataError(f"no run is left after the filters: {'; '.join(filters)}")
        k = np.flatnonzero(keep_mask)
        ids, cell, rows = [ids[i] for i in k], [cell[i] for i in k], [rows[i] for i in k]
        budget = [budget[i] for i in k]
        N, D, C, loss = N[k], D[k], C[k], loss[k]
        table_curves = {r: c for r, c in table_curves.items() if r in set(ids)}

    extra = _extra_columns(rows, columns)
    table = RunTable(ids, cell, N, D, C, loss, extra, table_curves, budget=budget)
    table.choices = {
        "source_kind": kind,
        **desc,
        "c_kind": c_kind,
        "loss": f"column {loss_col!r}",
        "units": {"n": s.n_unit or "1", "d": s.d_unit or "1", "c": s.c_unit or "1"},
        "groups": list(groups),
        "curve_points": s.curve_points,
        "filters": filters,
    }
    return _validate(table, s.drop_invalid)


def _sizes(
    rows: list[dict], s: DataSettings, n_col: str | None, d_col: str | None, c_col: str | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, str, dict[str, str]]:
    """N, D and C of each row in their units, the compute kind, and where each came from."""
    N = _values(rows, n_col, parse_unit(s.n_unit, "--n-unit"))
    D = _values(rows, d_col, parse_unit(s.d_unit, "--d-unit"))
    c_kind = s.c_kind or ("counted" if c_col else "6nd")
    if c_kind == "counted":
        if c_col is None:
            raise ScalingDataError("c_kind 'counted' needs a compute column; name it with --c-col")
        C = _values(rows, c_col, parse_unit(s.c_unit, "--c-unit"))
        c_desc = f"counted FLOPs from column {c_col!r}"
    elif c_kind == "6nd":
        C = 6.0 * N * D
        c_desc = f"C = 6 N D (N from {n_col!r}, D from {d_col!r})"
    else:
        raise ScalingDataError(f"c_kind {c_kind!r}; accepted: counted, 6nd")
    n_desc, d_desc = f"column {n_col!r}", f"column {d_col!r}"
    # Published IsoFLOP tables often give only two of N, D, C: the third from C = 6ND.
    if d_col is None and n_col is not None and c_col is not None:
        D, d_desc = C / (6.0 * N), "D = C / (6 N) (no tokens column)"
    if n_col is None and d_col is not None and c_col is not None:
        N, n_desc = C / (6.0 * D), "N = C / (6 D) (no parameters column)"
    return N, D, C, c_kind, {"N": n_desc, "D": d_desc, "C": c_desc}


def _cells(
    rows: list[dict], columns: list[str], s: DataSettings
) -> tuple[tuple[str, ...], list[str], list[str]]:
    """The group columns, each row's cell ("arch/objective" by default) and its budget label."""
    groups = s.group_cols
    if groups is None:
        groups = tuple(g for g in ("arch", "objective") if g in columns)
    missing = [g for g in groups if g not in columns]
    if missing:
        raise ScalingDataError(f"group columns {missing} not in the table; columns: {columns}")
    cell = ["/".join(str(r.get(g)) for g in groups) or "all" for r in rows]
    budget_col = s.budget_col or ("budget" if "budget" in columns else None)
    if budget_col is not None and budget_col not in columns:
        raise ScalingDataError(f"budget column {budget_col!r} not in the table; columns: {columns}")
    budget = [str(r.get(budget_col) or "") if budget_col else "" for r in rows]
    return groups, cell, budget


def _extra_columns(rows: list[dict], columns: list[str]) -> dict[str, np.ndarray]:
    """Columns beside N, D, C and loss: every `eval/*` score, and the MoE laws' input."""
    extra = {}
    for col in columns:
        if col.startswith("eval/"):
            extra[col] = _values(rows, col, 1.0)
    for var, names in _MOE.items():
        found = [c for c in columns if _norm(c) in names]
        if len(found) > 1:
            raise ScalingDataError(
                f"several columns could be {var} (the MoE laws' input): {', '.join(found)}; "
                "keep one"
            )
        if found:
            extra[var] = _values(rows, found[0], 1.0)
    return extra


def as_rows(table: Any) -> list[dict]:
    """A table as a list of row dicts: a pandas DataFrame by its records (no pandas import
    here: anything with `to_dict("records")` and `columns`), a list as it is."""
    if hasattr(table, "to_dict") and hasattr(table, "columns"):
        return table.to_dict("records")
    return list(table)


def _curves_from_rows(ids, C, D, loss):
    by_run: dict[str, list[int]] = {}
    for i, r in enumerate(ids):
        by_run.setdefault(r, []).append(i)
    curves, keep = {}, []
    for r, idx in by_run.items():
        idx = sorted(idx, key=lambda i: C[i])
        curves[r] = {"C": C[idx], "D": D[idx], "loss": loss[idx]}
        keep.append(idx[-1])
    return curves, keep


def _validate(t: RunTable, drop_invalid: bool) -> RunTable:
    bad = ~np.isfinite(t.loss) | (t.loss <= 0)
    for arr in (t.N, t.D, t.C):
        present = ~np.all(np.isnan(arr))
        if present:
            bad |= ~np.isfinite(arr) | (arr <= 0)
    if bad.any():
        rows = [t.run_id[i] for i in np.flatnonzero(bad)[:5]]
        if not drop_invalid:
            raise ScalingDataError(
                f"{int(bad.sum())} run(s) have a missing, NaN, infinite or non-positive N, D, C "
                f"or loss (first: {', '.join(rows)}); fix the table or pass --drop-invalid"
            )
        keep = np.flatnonzero(~bad)
        dropped = int(bad.sum())
        t = RunTable(
            [t.run_id[i] for i in keep],
            [t.cell[i] for i in keep],
            t.N[keep],
            t.D[keep],
            t.C[keep],
            t.loss[keep],
            {k: v[keep] for k, v in t.extra.items()},
            {r: c for r, c in t.curves.items() if r in {t.run_id[i] for i in keep}},
            {**t.choices, "dropped_invalid": dropped},
            [t.budget[i] for i in keep] if t.budget else [],
        )
        if not keep.size:
            raise ScalingDataError("every run was invalid; nothing left to fit")
    return t


def load_table(path: str | Path, settings: DataSettings | None = None) -> RunTable:
    """Read a CSV/TSV or JSONL table of runs into a RunTable."""
    path = Path(path)
    if not path.is_file():
        raise ScalingDataError(not_found(path, "runs source", "a .csv/.tsv or .jsonl file"))
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        rows, kind = _read_jsonl(path), "jsonl"
    elif suffix in (".csv", ".tsv", ".txt"):
        rows, kind = _read_csv(path), "csv"
    else:
        raise ScalingDataError(
            f"{path}: unknown kind of runs source; accepted: a registry (.sqlite, .db or a study "
            "directory), .csv/.tsv, .jsonl"
        )
    table = build_table(rows, settings or DataSettings(), kind)
    table.choices["source"] = str(path)
    return table


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise ScalingDataError(f"{path}: not a text file (CSV/TSV/JSONL expected)") from None
    except OSError as e:
        raise ScalingDataError(f"{path}: cannot read ({e.strerror})") from None


def _read_csv(path: Path) -> list[dict]:
    lines = [ln for ln in _text(path).splitlines() if ln.strip() and not ln.startswith("#")]
    if not lines:
        raise ScalingDataError(f"{path}: no rows")
    try:
        dialect = csv.Sniffer().sniff(lines[0], delimiters=",\t;")
    except csv.Error:
        dialect = csv.excel
    reader = csv.DictReader(lines, dialect=dialect)
    header = [(k or "").strip() for k in reader.fieldnames or ()]
    twice = sorted({k for k in header if header.count(k) > 1})
    if twice:
        raise ScalingDataError(
            f"{path}: column {'s' if len(twice) > 1 else ''}{', '.join(map(repr, twice))} "
            "named twice in the header; give each column its own name"
        )
    rows = []
    for i, row in enumerate(reader, 1):
        if None in row:  # more cells than the header names
            raise ScalingDataError(
                f"{path}: data row {i} has {len(header) + len(row[None])} cells; the header names "
                f"{len(header)} columns; give each row one cell per column"
            )
        rows.append({(k or "").strip(): v for k, v in row.items()})
    if not rows:
        raise ScalingDataError(f"{path}: a header but no rows")
    return rows


def _read_jsonl(path: Path) -> list[dict]:
    text = _text(path)
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ScalingDataError(f"{path}: not valid JSON: {e}") from None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ScalingDataError(f"{path}: a JSON array of objects (one per run) is needed")
        return rows
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ScalingDataError(f"{path}:{i}: not valid JSON: {e}") from None
            if not isinstance(row, dict):
                raise ScalingDataError(f"{path}:{i}: each line must be a JSON object (one run)")
            rows.append(row)
    if not rows:
        raise ScalingDataError(f"{path}: no rows")
    return rows
