"""The study registry: one SQLite file per study holding runs, final results and curves.

Crash safety: the database runs in WAL mode with synchronous=FULL and every change is one
transaction, so a study killed at any instant (even with SIGKILL) leaves a consistent file;
a run caught mid-training is simply still `running` and is resumed on the next invocation.

Tables
- runs:    one row per run (id = ExperimentConfig.hash()), its resolved config, cell, size,
           matching numbers (total / non-embedding parameters, stack shape, FLOPs), status,
           timestamps and final losses.
- finals:  (run_id, name, value) final scalars, notably `eval/<task>/<metric>`.
- metrics: (run_id, step, name, value) copied from the run's metrics.jsonl.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import socket
import sqlite3
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from scalestudy.errors import ScalestudyError

# `interrupted`: stopped by a signal after saving a checkpoint (resumed by the next run).
STATUSES = ("pending", "running", "done", "failed", "interrupted")

# Columns of `runs` besides the id, in order; numbers are REAL/INTEGER, the rest TEXT.
RUN_COLUMNS: dict[str, str] = {
    "study": "TEXT",
    "name": "TEXT",
    "arch": "TEXT",
    "objective": "TEXT",
    "size": "TEXT",
    "size_index": "INTEGER",
    "budget": "TEXT",
    "seed": "INTEGER",
    "matching": "TEXT",
    "status": "TEXT",
    "workdir": "TEXT",
    "config": "TEXT",
    "d_model": "INTEGER",
    "n_layers": "INTEGER",
    "n_encoder_layers": "INTEGER",
    "n_heads": "INTEGER",
    "d_ff": "INTEGER",
    "params_total": "INTEGER",
    "params_non_embedding": "INTEGER",
    "params_embedding": "INTEGER",
    "flops_per_token": "REAL",
    "flops_per_example": "REAL",
    "positions_per_example": "INTEGER",
    "batch_size": "INTEGER",
    "steps": "INTEGER",
    "planned_flops": "REAL",
    "tokens": "REAL",
    "positions": "REAL",
    "flops": "REAL",
    "flops_6nd": "REAL",
    # What the run consumed (summary.json): document tokens read, loss-bearing tokens.
    "document_tokens": "REAL",
    "loss_tokens": "REAL",
    # Planned at expansion (study/matching.py): document tokens, and inference cost as
    # forward FLOPs per generated token at `inference_context` cached tokens.
    "planned_document_tokens": "REAL",
    "inference_flops_per_token": "REAL",
    "inference_context": "INTEGER",
    "data_seed": "INTEGER",
    "loss": "REAL",
    "train_loss": "REAL",
    "best_val_loss": "REAL",
    "wall_time_s": "REAL",
    "created_at": "REAL",
    "started_at": "REAL",
    "finished_at": "REAL",
    "error": "TEXT",
}

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS runs (
  run_id TEXT PRIMARY KEY,
  {", ".join(f"{k} {t}" for k, t in RUN_COLUMNS.items())}
);
CREATE TABLE IF NOT EXISTS finals (
  run_id TEXT NOT NULL, name TEXT NOT NULL, value REAL, PRIMARY KEY (run_id, name)
);
CREATE TABLE IF NOT EXISTS metrics (
  run_id TEXT NOT NULL, step INTEGER NOT NULL, name TEXT NOT NULL, value REAL,
  PRIMARY KEY (run_id, step, name)
);
"""


class RegistryError(ScalestudyError):
    """The registry file is missing, unreadable or not a scalestudy registry."""


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
        try:
            self._conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.executescript(_SCHEMA)
            have = {r[1] for r in self._conn.execute("PRAGMA table_info(runs)")}
            for column, kind in RUN_COLUMNS.items():  # a registry written by an older version
                if column not in have:
                    self._conn.execute(f"ALTER TABLE runs ADD COLUMN {column} {kind}")
        except sqlite3.DatabaseError as e:
            raise RegistryError(f"{self.path}: not a usable SQLite registry ({e})") from None
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

    def runs(self, status: str | None = None) -> list[dict[str, Any]]:
        """Run rows (plain dicts) in insertion order, optionally of one status."""
        q = "SELECT * FROM runs" + (" WHERE status = ?" if status else "") + " ORDER BY rowid"
        return [dict(r) for r in self._conn.execute(q, (status,) if status else ())]

    def status_counts(self) -> dict[str, int]:
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


# ----------------------------------------------------------------------------- study lock

LOCK_NAME = "study.lock"


class StudyLockError(ScalestudyError):
    """Another process is running the same study directory."""


@contextmanager
def study_lock(out: str | Path) -> Iterator[dict[str, Any]]:
    """Hold `<out>/study.lock` while a study runs there; yields the holder record.

    The lock is an flock on the file (released by the kernel when the holder dies, however it
    dies) plus a record naming the holder (pid, host, start time). A second process refuses,
    naming the holder. A lock left by a dead process on this host is taken over. A record
    left by another host, whose liveness cannot be checked from here, is refused: the message
    says which file to delete once that job is known to be gone. Released: the record is
    emptied (the file stays, so no process can lock a file that another just unlinked).
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise StudyLockError(f"--out {out} is a file; give a directory (created when missing)")
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        text = ""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            text = path.read_text(errors="replace").strip()
            raise StudyLockError(_held_message(out, path, text)) from None
        text = path.read_text(errors="replace").strip()
        if text:  # a record without a live flock: the holder is gone, or on another host
            try:
                holder = json.loads(text)
            except json.JSONDecodeError:
                holder = {}
            here = socket.gethostname()
            # On this host the free flock proves the holder dead: take the lock over.
            if holder.get("host", here) != here:
                raise StudyLockError(
                    _held_message(out, path, text)
                    + f". It cannot be checked from {here}: once that job is gone, delete {path}"
                )
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "started_at": time.time(),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        try:
            yield {**me, "took_over": json.loads(text) if text.startswith("{") else None}
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the flock


def _held_message(out: Path, path: Path, text: str) -> str:
    try:
        h = json.loads(text)
        who = f"pid {h['pid']} on {h['host']}, started {h['started']}"
    except (json.JSONDecodeError, KeyError, TypeError):
        who = f"a process that left no record in {path}"
    return (
        f"the study directory {out} is in use by {who}; two processes on one directory would "
        "train every run twice and collide on checkpoint files. Wait for it to finish (or "
        "stop it), or use another --out"
    )


def _registry_path(path: str | Path) -> Path:
    path = Path(path)
    return path / "registry.sqlite" if path.is_dir() else path


def load_runs(path: str | Path) -> list[dict[str, Any]]:
    """Every run of a study (a registry file or a study directory) as flat dicts.

    Keys: run_id, study, arch, objective, size, seed, status, params_total,
    params_non_embedding, flops_per_token, tokens, positions, flops, flops_6nd, loss (final
    validation loss), train_loss, wall_time_s, the stack shape, and `eval/<task>/<metric>`.
    """
    with Registry(_registry_path(path), create=False) as reg:
        finals = reg.finals()
        out = []
        for row in reg.runs():
            row.pop("config", None)
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
