"""Reading runs for fitting: a study registry, or any CSV/TSV/JSONL table of runs.

Everything is turned into one `RunTable` per source: per-run N (parameters), D (training
tokens), C (training FLOPs) and final loss, the cell (architecture/objective, or any user
columns) each run belongs to, extra numeric columns (zero-shot accuracies), and optional
training curves. Which N, D and C are used is an explicit choice (`DataSettings`) and is
recorded in `RunTable.choices` so that every fit states what it fitted.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from scalestudy.errors import ScalestudyError


class ScalingDataError(ScalestudyError, ValueError):
    """The runs given for fitting are missing, malformed or cannot support the fit."""


# Multipliers accepted for --n-unit/--d-unit/--c-unit and as suffixes inside table cells.
UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12, "pf-days": 8.64e19}
REGISTRY_SUFFIXES = (".sqlite", ".sqlite3", ".db")
# Column names recognised when the user does not name them (compared case-insensitively,
# ignoring spaces, dashes and underscores).
_AUTO = {
    "n": ("n", "params", "parameters", "modelsize", "nparams", "numparams", "size"),
    "d": ("d", "tokens", "trainingtokens", "ntokens", "data", "datasize"),
    "c": ("c", "flops", "flop", "compute", "trainingflop", "trainingflops"),
    "loss": ("loss", "finalloss", "valloss", "evalloss", "validationloss"),
}


@dataclass(frozen=True)
class DataSettings:
    """Which columns and conventions turn a table into (N, D, C, loss) per run."""

    n_col: str | None = None
    d_col: str | None = None
    c_col: str | None = None
    loss_col: str | None = None
    run_col: str | None = None  # repeated ids: rows are points of training curves
    budget_col: str | None = None  # IsoFLOP budget labels; None: 'budget' when present
    group_cols: tuple[str, ...] | None = None  # None: arch,objective when present
    n_kind: str = "non_embedding"  # registry: "total" | "non_embedding"
    d_kind: str = "positions"  # registry: "positions" | "tokens" (loss-bearing)
    c_kind: str | None = None  # "counted" | "6nd"; None: counted if a C column exists
    n_unit: str = ""
    d_unit: str = ""
    c_unit: str = ""
    drop_invalid: bool = False
    where: tuple[str, ...] = ()  # conditions a run must meet ('N>=1e8'; scaling/select.py)
    exclude: tuple[str, ...] = ()  # run ids left out


@dataclass
class RunTable:
    """Per-run arrays (NaN where a quantity is absent) plus curves and recorded choices."""

    run_id: list[str]
    cell: list[str]
    N: np.ndarray
    D: np.ndarray
    C: np.ndarray
    loss: np.ndarray
    extra: dict[str, np.ndarray] = field(default_factory=dict)
    curves: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # run -> C, D, loss
    choices: dict = field(default_factory=dict)
    budget: list[str] = field(default_factory=list)  # IsoFLOP budget label per run ('' if none)

    def cells(self) -> list[str]:
        return sorted(set(self.cell))

    def subset(self, cell: str) -> RunTable:
        """The runs (and their curves) of one cell."""
        idx = [i for i, c in enumerate(self.cell) if c == cell]
        ids = [self.run_id[i] for i in idx]
        return RunTable(
            run_id=ids,
            cell=[cell] * len(idx),
            N=self.N[idx],
            D=self.D[idx],
            C=self.C[idx],
            loss=self.loss[idx],
            extra={k: v[idx] for k, v in self.extra.items()},
            curves={r: self.curves[r] for r in ids if r in self.curves},
            choices=self.choices,
            budget=[self.budget[i] for i in idx] if self.budget else [],
        )


def parse_unit(text: str, what: str) -> float:
    """A unit multiplier: a number ('1e6') or a name (k, M, B, G, T, PF-days)."""
    key = str(text).strip().lower()
    if key in UNITS:
        return UNITS[key]
    try:
        value = float(key)
    except ValueError:
        raise ScalingDataError(
            f"{what}: unknown unit {text!r}; accepted: a number such as 1e6, or one of "
            "k, M, B (=G), T, PF-days"
        ) from None
    if not value > 0:
        raise ScalingDataError(f"{what}: unit multiplier must be positive, got {text!r}")
    return value


_NUMBER = re.compile(r"^\s*([-+]?[0-9.,]*[0-9](?:[eE][-+]?\d+)?)\s*([kKmMbBgGtT]?)\s*$")


def to_float(value: object) -> float:
    """A table cell as a float: numbers, '1,234', '70B', '1.4T'; NaN when empty or not numeric."""
    if value is None or isinstance(value, bool):
        return math.nan
    if isinstance(value, int | float):
        return float(value)
    m = _NUMBER.match(str(value))
    if not m:
        return math.nan
    try:
        return float(m.group(1).replace(",", "")) * UNITS[m.group(2).lower()]
    except ValueError:  # e.g. '1.2.3': matches the pattern's characters, not a number
        return math.nan


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


def build_table(
    rows: list[dict], curves: list[dict] | None, settings: DataSettings, kind: str
) -> RunTable:
    """Rows of a registry or table -> RunTable, applying the N/D/C choices in `settings`."""
    if not rows:
        raise ScalingDataError("no runs to fit")
    columns = list(dict.fromkeys(k for r in rows for k in r))
    s = settings
    n_unfinished = 0
    if kind == "registry":
        if s.n_kind not in ("total", "non_embedding"):
            raise ScalingDataError(f"n_kind {s.n_kind!r}; accepted: total, non_embedding")
        if s.d_kind not in ("positions", "tokens"):
            raise ScalingDataError(f"d_kind {s.d_kind!r}; accepted: positions, tokens")
        # Unfinished runs have no final loss yet: they are left out, and counted.
        finished = [r for r in rows if math.isfinite(to_float(r.get(s.loss_col or "loss")))]
        if not finished:
            raise ScalingDataError("the registry has no finished runs (with a final loss) yet")
        n_unfinished, rows = len(rows) - len(finished), finished
        s = DataSettings(
            **{
                **s.__dict__,
                "n_col": s.n_col or f"params_{s.n_kind}",
                "d_col": s.d_col or s.d_kind,
                "c_col": s.c_col or "flops",
                "loss_col": s.loss_col or "loss",
                "run_col": "run_id",
            }
        )
    n_col = _column(columns, s.n_col, "n", required=False)
    d_col = _column(columns, s.d_col, "d", required=False)
    c_col = _column(columns, s.c_col, "c", required=False)
    loss_col = _column(columns, s.loss_col, "loss", required=True)
    run_col = _column(columns, s.run_col, "run", required=False) if s.run_col else None
    N = _values(rows, n_col, parse_unit(s.n_unit, "--n-unit"))
    D = _values(rows, d_col, parse_unit(s.d_unit, "--d-unit"))
    loss = _values(rows, loss_col, 1.0)
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
    ids = [str(r[run_col]) if run_col else str(i) for i, r in enumerate(rows)]

    table_curves: dict[str, dict[str, np.ndarray]] = {}
    if run_col and len(set(ids)) < len(ids):
        # Repeated run ids: each row is a point of that run's training curve; the run's
        # final point (largest compute) stands for the run.
        table_curves, keep = _curves_from_rows(ids, C, D, loss)
        ids, cell = [ids[i] for i in keep], [cell[i] for i in keep]
        budget = [budget[i] for i in keep]
        N, D, C, loss, rows = N[keep], D[keep], C[keep], loss[keep], [rows[i] for i in keep]
    elif curves:
        table_curves = _curves_from_registry(curves, ids, C, D)

    filters: list[str] = []
    if s.where or s.exclude:
        from scalestudy.scaling.select import row_mask

        resolved = {"N": N, "D": D, "C": C, "loss": loss, "run": ids}
        keep_mask, filters = row_mask(s.where, s.exclude, resolved, rows)
        if not keep_mask.any():
            raise ScalingDataError(f"no run is left after the filters: {'; '.join(filters)}")
        k = np.flatnonzero(keep_mask)
        ids, cell, rows = [ids[i] for i in k], [cell[i] for i in k], [rows[i] for i in k]
        budget = [budget[i] for i in k]
        N, D, C, loss = N[k], D[k], C[k], loss[k]
        table_curves = {r: c for r, c in table_curves.items() if r in set(ids)}

    extra = {}
    for col in columns:
        if col.startswith("eval/"):
            extra[col] = _values(rows, col, 1.0)
    table = RunTable(ids, cell, N, D, C, loss, extra, table_curves, budget=budget)
    table.choices = {
        "source_kind": kind,
        "N": n_desc + (f" ({s.n_kind} parameters)" if kind == "registry" else ""),
        "D": d_desc + (f" ({s.d_kind})" if kind == "registry" else ""),
        "C": c_desc,
        "c_kind": c_kind,
        "loss": f"column {loss_col!r}",
        "units": {"n": s.n_unit or "1", "d": s.d_unit or "1", "c": s.c_unit or "1"},
        "groups": list(groups),
        "unfinished_runs_left_out": n_unfinished,
        "filters": filters,
    }
    return _validate(table, s.drop_invalid)


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


def _curves_from_registry(curves, ids, C, D):
    # A curve point at fraction s of a run's training (by counted FLOPs, else tokens) has
    # s*C and s*D of the run's final C and D, whatever C and D convention was chosen.
    final = {r: i for i, r in enumerate(ids)}
    pts: dict[str, list[tuple[float, float]]] = {}
    for row in curves:
        r = str(row.get("run_id"))
        if r in final:
            pts.setdefault(r, []).append((to_float(row.get("flops")), to_float(row.get("loss"))))
    out = {}
    for r, p in pts.items():
        f, loss = np.array(sorted(p)).T
        ok = np.isfinite(f) & np.isfinite(loss) & (f > 0) & (loss > 0)
        if ok.sum() < 2:
            continue
        frac = f[ok] / f[ok].max()
        i = final[r]
        out[r] = {"C": frac * C[i], "D": frac * D[i], "loss": loss[ok]}
    return out


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


def fingerprint(t: RunTable) -> str:
    """A short hash of the runs a fit used (ids, cells, N, D, C, loss), to match fits to data."""
    rows = sorted(
        f"{r}|{c}|{n:.10g}|{d:.10g}|{cc:.10g}|{x:.10g}"
        for r, c, n, d, cc, x in zip(t.run_id, t.cell, t.N, t.D, t.C, t.loss)
    )
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()[:16]


def load_table(source: str | Path, settings: DataSettings | None = None) -> RunTable:
    """Read a registry, CSV/TSV or JSONL of runs into a RunTable."""
    from scalestudy.scaling.sources import read_rows

    rows, curves, kind = read_rows(source)
    table = build_table(rows, curves, settings or DataSettings(), kind)
    table.choices["source"] = str(source)
    return table


def table_from_rows(
    runs: list[dict], curves: list[dict] | None = None, settings: DataSettings | None = None
) -> RunTable:
    """A RunTable from registry rows already in memory (study.registry.load_runs/load_curves)."""
    return build_table(runs, curves, settings or DataSettings(), "registry")
