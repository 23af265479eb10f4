"""The table of runs every fit reads: per-run N, D, C, loss, cell, extras and curves.

`RunTable` holds per-run N (parameters), D (training tokens), C (training FLOPs) and final
loss, the cell (architecture/objective, or any user columns) each run belongs to, extra
numeric columns (zero-shot accuracies), and optional training curves. Which N, D and C are
used is an explicit choice (`DataSettings`) recorded in `RunTable.choices`, so that every fit
states what it fitted. Building tables from rows and files is `scaling/table_input.py`.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field

import numpy as np

from scalestudy.config.errors import ScalestudyError


class ScalingDataError(ScalestudyError, ValueError):
    """The runs given for fitting are missing, malformed or cannot support the fit."""


# Multipliers accepted for --n-unit/--d-unit/--c-unit and as suffixes inside table cells.
UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12, "pf-days": 8.64e19}


@dataclass(frozen=True)
class DataSettings:
    """Which columns and conventions turn a table into (N, D, C, loss) per run."""

    n_col: str | None = None
    d_col: str | None = None
    c_col: str | None = None
    loss_col: str | None = None
    run_col: str | None = None  # repeated ids: rows are points of training curves
    # What a run's curve points are: "mid_schedule" (losses logged during one schedule) or
    # "finished" (each point the end of a decayed schedule: cooldown branches at budgets).
    curve_points: str = "mid_schedule"
    budget_col: str | None = None  # IsoFLOP budget labels; None: 'budget' when present
    group_cols: tuple[str, ...] | None = None  # None: arch,objective when present
    n_kind: str = "non_embedding"  # registry: "total" | "non_embedding" | "active"
    d_kind: str = "positions"  # registry: "positions" | "tokens" (loss-bearing)
    c_kind: str | None = None  # "counted" | "6nd"; None: counted if a C column exists
    n_unit: str = ""
    d_unit: str = ""
    c_unit: str = ""
    drop_invalid: bool = False
    where: tuple[str, ...] = ()  # conditions a run must meet ('N>=1e8'; scaling/select.py)
    exclude: tuple[str, ...] = ()  # run ids left out
    all_runs: bool = False  # registry: also the runs the study's spec no longer plans


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


def fingerprint(t: RunTable) -> str:
    """A short hash of the runs a fit used (ids, cells, N, D, C, loss), to match fits to data."""
    rows = sorted(
        f"{r}|{c}|{n:.10g}|{d:.10g}|{cc:.10g}|{x:.10g}"
        for r, c, n, d, cc, x in zip(t.run_id, t.cell, t.N, t.D, t.C, t.loss)
    )
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()[:16]


def finished_curves(t: RunTable) -> bool:
    """Whether the table's curve points are ends of finished schedules (usable for L(C))."""
    return t.choices.get("curve_points") == "finished"
