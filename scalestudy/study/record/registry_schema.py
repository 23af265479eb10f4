"""The study registry's schema and its migrations (the queries are in `study/record/registry.py`).

Tables
- runs:    one row per run (id = ExperimentConfig.hash()), its resolved config, cell, size,
           matching numbers (total / non-embedding parameters, stack shape, FLOPs), status,
           timestamps, final losses and, for a run made by a stage after pretraining, its
           lineage (stage, parent run id and step).
- finals:  (run_id, name, value) final scalars, notably `eval/<task>/<metric>`.
- metrics: (run_id, step, name, value) copied from the run's metrics.jsonl.

The schema version is SQLite's `user_version`. Opening a registry written by an older version
brings it up to date in place (new columns are added, empty for the rows already there), so
every registry a study ever wrote stays readable; opening one written by a newer version that
this one does not know is refused with one line.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

from scalestudy.config.errors import ScalestudyError

# `interrupted`: stopped by a signal after saving a checkpoint (resumed by the next run).
STATUSES = ("pending", "running", "done", "failed", "interrupted")

# 1: the columns up to `error` below; 2: lineage of stage runs (`stage` ... `matches_run_id`);
# 3: mixture-of-experts shape (`params_active`, `experts`, `granularity`); 4: `planned`.
SCHEMA_VERSION = 4

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
    # Planned at expansion (study/plan/matching.py): document tokens, and inference cost as
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
    # Lineage (schema 2), empty for pretraining runs. `stage`: adapt, finetune or scratch (a
    # run from scratch matched in compute to an adapted run, `matches_run_id`). A stage run
    # starts from `parent_run_id`'s checkpoint at `parent_step`; its `flops` count only its
    # own steps, `planned_flops` likewise.
    "stage": "TEXT",
    "parent_run_id": "TEXT",
    "parent_step": "INTEGER",
    "matches_run_id": "TEXT",
    # Mixture of experts (schema 3): non-embedding parameters one token uses, routed experts
    # (1: dense) and granularity d_ff / d_expert (1: dense), the MoE laws' inputs.
    "params_active": "INTEGER",
    "experts": "INTEGER",
    "granularity": "REAL",
    # Whether the spec the study last ran with plans this pretraining run (schema 4): 1 it
    # does, 0 it no longer does (a size or seed since removed: the row and its run directory
    # are kept, and left out of the report, `fit` and `plot`); empty in rows written before.
    "planned": "INTEGER",
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


def connect(path: Path, create: bool = True) -> sqlite3.Connection:
    """An open, migrated connection to the registry at `path` (created when missing). With
    `create` False the file must already be a registry: another SQLite file is refused
    before anything is written to it."""
    try:
        conn = sqlite3.connect(path, timeout=30.0, isolation_level=None)
        if not create:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
            if "runs" not in tables:
                conn.close()
                raise RegistryError(
                    f"{path} is an SQLite file but not a study registry (no `runs` table); "
                    "give a study's registry.sqlite or its directory"
                )
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        (version,) = conn.execute("PRAGMA user_version").fetchone()
        if version > SCHEMA_VERSION:
            conn.close()
            raise RegistryError(
                f"{path} was written by a newer scalestudy (registry schema {version}; this "
                f"version reads up to {SCHEMA_VERSION}); upgrade scalestudy to read it"
            )
        conn.executescript(_SCHEMA)
        migrate(conn)
    except sqlite3.DatabaseError as e:
        raise RegistryError(f"{path}: not a usable SQLite registry ({e})") from None
    return conn


def migrate(conn: sqlite3.Connection) -> None:
    """Bring an older registry's `runs` table up to SCHEMA_VERSION, in one transaction."""
    have = {r[1] for r in conn.execute("PRAGMA table_info(runs)")}
    missing = [(c, kind) for c, kind in RUN_COLUMNS.items() if c not in have]
    (version,) = conn.execute("PRAGMA user_version").fetchone()
    if not missing:
        # On read-only storage the registry stays readable as it is: its columns are all there.
        with contextlib.suppress(sqlite3.OperationalError):
            if version < SCHEMA_VERSION:
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        for column, kind in missing:
            conn.execute(f"ALTER TABLE runs ADD COLUMN {column} {kind}")
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
