"""The study registry: one SQLite file per study holding runs, final results and curves.

Crash safety: the database runs in WAL mode with synchronous=FULL and every change is one
transaction, so a study killed at any instant (even with SIGKILL) leaves a consistent file;
a run caught mid-training is simply still `running` and is resumed on the next invocation.
The tables and their migrations are in `study/record/registry_schema.py`; this module writes and
reads them. Rows of stage runs (adaptation, finetuning, runs from scratch matched to them)
carry their lineage and are left out of pretraining queries unless asked for.
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from scalestudy.study.plan.recipe import recipe
from scalestudy.study.record.registry_schema import RUN_COLUMNS, STATUSES, RegistryError, connect

# The registry's file in a study's folder.
FILE_NAME = "registry.sqlite"


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


class Registry:
    """A study's SQLite store; safe to reopen after a crash."""

    def __init__(self, path: str | Path, *, create: bool = True) -> None:
        self.path = Path(path)
        if not create and not self.path.is_file():
            raise RegistryError(f"no study registry at {self.path}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = connect(self.path, create)
        self._conn.row_factory = sqlite3.Row

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    # ------------------------------------------------------------------ writes

    def add_runs(self, rows: Iterable[dict[str, Any]]) -> int:
        """Insert planned runs (status pending); existing ids are left as they are."""
        n = 0
        with self._tx() as c:
            for row in rows:
                row = {k: v for k, v in row.items() if k in RUN_COLUMNS or k == "run_id"}
                row.setdefault("status", "pending")
                row.setdefault("created_at", time.time())
                cols = ", ".join(row)
                marks = ", ".join("?" for _ in row)
                cur = c.execute(
                    f"INSERT OR IGNORE INTO runs ({cols}) VALUES ({marks})", list(row.values())
                )
                n += cur.rowcount
        return n

    def set_plan(self, run_ids: Iterable[str]) -> None:
        """Mark the pretraining runs the study's spec plans now (`planned` 1) and every other
        pretraining row (`planned` 0), in one transaction."""
        ids = [(run_id,) for run_id in run_ids]
        with self._tx() as c:
            c.execute("UPDATE runs SET planned = 0 WHERE stage IS NULL")
            c.executemany("UPDATE runs SET planned = 1 WHERE run_id = ?", ids)

    def update(self, run_id: str, **fields: Any) -> None:
        """Set columns of one run (unknown column names are an error)."""
        bad = [k for k in fields if k not in RUN_COLUMNS]
        if bad:
            raise KeyError(f"unknown run columns {bad}")
        if "status" in fields and fields["status"] not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}; got {fields['status']!r}")
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self._tx() as c:
            c.execute(f"UPDATE runs SET {sets} WHERE run_id = ?", [*fields.values(), run_id])

    def mark_running(self, run_id: str) -> None:
        self.update(run_id, status="running", started_at=time.time(), error=None)

    def reclaim_running(self, why: str) -> list[str]:
        """Mark `interrupted` (with `why`) every run still `running`, and return their names:
        called by the process that holds the study lock, so no live study is training them."""
        with self._tx() as c:
            names = [n for (n,) in c.execute("SELECT name FROM runs WHERE status = 'running'")]
            c.execute(
                "UPDATE runs SET status = 'interrupted', error = ? WHERE status = 'running'", (why,)
            )
        return names

    def mark_failed(self, run_id: str, error: str) -> None:
        self.update(run_id, status="failed", error=error[-4000:], finished_at=time.time())

    def finish(
        self, run_id: str, summary: dict[str, Any], curves: list[dict[str, Any]] | None = None
    ) -> None:
        """Record a finished run: summary numbers, final scalars and its metrics, atomically."""
        fields = {
            "tokens": summary.get("tokens"),
            "positions": summary.get("positions"),
            "document_tokens": _number(summary.get("document_tokens")),
            # Summaries that predate `loss_tokens` count loss-bearing tokens as `tokens`.
            "loss_tokens": _number(summary.get("loss_tokens", summary.get("tokens"))),
            "flops": summary.get("flops"),
            "flops_6nd": summary.get("flops_6nd"),
            "loss": _number(summary.get("final_val_loss")),
            "train_loss": _number(summary.get("final_train_loss")),
            "best_val_loss": _number(summary.get("best_val_loss")),
            "wall_time_s": summary.get("wall_time_s"),
            "status": "done",
            "finished_at": time.time(),
            "error": None,
        }
        finals = {
            k: v for k, v in summary.items() if not isinstance(v, dict) and _number(v) is not None
        }
        finals.update(
            {
                f"eval/{k}": v
                for k, v in (summary.get("eval") or {}).items()
                if _number(v) is not None
            }
        )
        with self._tx() as c:
            sets = ", ".join(f"{k} = ?" for k in fields)
            c.execute(f"UPDATE runs SET {sets} WHERE run_id = ?", [*fields.values(), run_id])
            c.execute("DELETE FROM finals WHERE run_id = ?", (run_id,))
            c.executemany(
                "INSERT INTO finals VALUES (?, ?, ?)",
                [(run_id, k, _number(v)) for k, v in finals.items()],
            )
            if curves is not None:
                c.execute("DELETE FROM metrics WHERE run_id = ?", (run_id,))
                c.executemany(
                    "INSERT OR REPLACE INTO metrics VALUES (?, ?, ?, ?)",
                    [
                        (run_id, int(rec["step"]), k, _number(v))
                        for rec in curves
                        if "step" in rec
                        for k, v in rec.items()
                        if k != "step" and _number(v) is not None
                    ],
                )

    # ------------------------------------------------------------------ reads

    def runs(self, status: str | None = None, *, stages: bool = False) -> list[dict[str, Any]]:
        """Run rows (plain dicts) in insertion order, optionally of one status; pretraining
        runs only unless `stages` (then stage runs too, after their parents)."""
        where = [] if stages else ["stage IS NULL"]
        if status:
            where.append("status = ?")
        q = "SELECT * FROM runs" + (f" WHERE {' AND '.join(where)}" if where else "")
        return [
            dict(r) for r in self._conn.execute(q + " ORDER BY rowid", (status,) if status else ())
        ]

    def status_counts(self) -> dict[str, int]:
        """How many runs (pretraining and stage runs) have each status."""
        rows = self._conn.execute("SELECT status, COUNT(*) FROM runs GROUP BY status")
        return {s: n for s, n in rows}

    def finals(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for run_id, name, value in self._conn.execute("SELECT * FROM finals"):
            out.setdefault(run_id, {})[name] = value
        return out

    def metrics(self) -> dict[str, dict[int, dict[str, float]]]:
        out: dict[str, dict[int, dict[str, float]]] = {}
        q = "SELECT run_id, step, name, value FROM metrics ORDER BY run_id, step"
        for run_id, step, name, value in self._conn.execute(q):
            out.setdefault(run_id, {}).setdefault(step, {})[name] = value
        return out


def _registry_path(path: str | Path) -> Path:
    path = Path(path)
    return path / FILE_NAME if path.is_dir() else path


def planned_runs(
    runs: list[dict[str, Any]], *, every: bool = False
) -> tuple[list[dict[str, Any]], list[str]]:
    """Of registry rows, those the spec the study last ran with plans (`planned` 1, or empty
    in rows written before the column; with `every`, all of them), and the sorted names of
    the rest."""
    kept, gone = [], []
    for row in runs:
        if every or row.get("planned") != 0:
            kept.append(row)
        else:
            gone.append(row["name"] or row["run_id"])
    return kept, sorted(gone)


def load_runs(path: str | Path, *, stages: bool = False) -> list[dict[str, Any]]:
    """Every pretraining run of a study (a registry file or a study directory) as flat dicts;
    with `stages`, the stage runs too (their lineage in `stage`, `parent_run_id`,
    `parent_step`, `matches_run_id`).

    Keys: run_id, study, arch, objective, size, seed, status, params_total,
    params_non_embedding, flops_per_token, tokens, positions, flops, flops_6nd, loss (final
    validation loss), train_loss, wall_time_s, the stack shape, `recipe` (the config keys of
    how it was trained, study/report/comparisons.py) and `eval/<task>/<metric>`.
    """
    with Registry(_registry_path(path), create=False) as reg:
        finals = reg.finals()
        out = []
        for row in reg.runs(stages=stages):
            row["recipe"] = recipe(row.pop("config", None))
            row.update(
                {k: v for k, v in finals.get(row["run_id"], {}).items() if k.startswith("eval/")}
            )
            out.append(row)
        return out


def load_curves(path: str | Path) -> list[dict[str, Any]]:
    """Per-step training curves: run_id, arch, objective, size, params, step, tokens, flops,
    positions, loss (training loss at the step) and val_loss (None where not evaluated)."""
    with Registry(_registry_path(path), create=False) as reg:
        info = {r["run_id"]: r for r in reg.runs()}
        out = []
        for run_id, steps in reg.metrics().items():
            run = info.get(run_id)
            if run is None:
                continue
            for step, m in steps.items():
                out.append(
                    {
                        "run_id": run_id,
                        "arch": run["arch"],
                        "objective": run["objective"],
                        "size": run["size"],
                        "seed": run["seed"],
                        "params_total": run["params_total"],
                        "params_non_embedding": run["params_non_embedding"],
                        "step": step,
                        "tokens": m.get("tokens"),
                        "positions": m.get("positions"),
                        "flops": m.get("flops"),
                        "loss": m.get("train/loss"),
                        "val_loss": m.get("val/loss"),
                    }
                )
        return out
