"""Where a run directory keeps its zero-shot results.

- `summary.json["eval"]`: the aggregates of the latest evaluation (flat "<task>/<metric>"),
  `summary.json["eval_config"]`: the evaluation settings they were scored with, and
  `summary.json["eval_configs"]`: every settings key this run was evaluated with -> settings;
- `metrics.jsonl`: one line per evaluation, keys "eval/<task>/<metric>" and `eval_settings`,
  the key of its settings (so two evaluations of one step say which settings made which);
- `tensorboard/`: the same numbers as `eval/<task>/<metric>` scalars at the run's step,
  one event file per evaluation beside the training's;
- `eval_examples/step_<step>/<task>.jsonl`: the per-example scores (`records.py`) of the
  latest evaluation of that step, `settings.json` beside them naming each task's settings.
  An evaluation with other settings never overwrites silently: the earlier file is kept as
  `<task>.<its settings key>.jsonl` first.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from scalestudy.train.rundir import layout as rundir
from scalestudy.train.rundir.tensorboard import EventWriter

EXAMPLES_DIR = "eval_examples"
SETTINGS_FILE = "settings.json"


def settings_key(settings: dict[str, Any]) -> str:
    """A short stable key of evaluation settings (the same settings, the same key)."""
    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def write_results(
    workdir: Path, step: int, results: dict[str, float], settings: dict | None = None
) -> None:
    """Merge into summary.json["eval"] (and the settings into ["eval_config"]) and append one
    line to metrics.jsonl (through train/rundir/layout.py, which owns those files)."""
    summary = rundir.read_summary(workdir) or {}
    summary["eval"] = {**summary.get("eval", {}), **results, "step": step}
    row: dict[str, Any] = {"step": step, **{f"eval/{k}": v for k, v in results.items()}}
    if settings is not None:
        key = settings_key(settings)
        summary["eval_config"] = settings
        summary["eval_configs"] = {**summary.get("eval_configs", {}), key: settings}
        row["eval_settings"] = key
    rundir.write_summary(workdir, summary)
    rundir.append_metrics(workdir, row)
    write_tensorboard(workdir, step, results)


def task_lines(step: int, results: dict[str, Any]) -> list[str]:
    """One plain line per task of flat "<task>/<metric>" results (what `eval` prints as each
    task's progress: one line a log file keeps whole)."""
    by_task: dict[str, list[str]] = {}
    for key, value in results.items():
        task, _, metric = key.rpartition("/")
        if task and isinstance(value, int | float) and not isinstance(value, bool):
            by_task.setdefault(task, []).append(f"{metric} {value:.4g}")
    return [f"eval step {step} {task}: {', '.join(parts)}" for task, parts in by_task.items()]


def print_task_lines(step: int, results: dict[str, Any]) -> None:
    """task_lines on stderr (stdout may carry the results as JSON)."""
    for line in task_lines(step, results):
        print(line, file=sys.stderr, flush=True)


def write_tensorboard(workdir: Path, step: int, results: dict[str, Any]) -> None:
    """The numeric results as `eval/<task>/<metric>` scalars at `step`, in an event file of
    its own beside the training's (TensorBoard reads every file in the run's directory)."""
    scalars = {
        f"eval/{k}": float(v)
        for k, v in results.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }
    if not scalars:
        return
    writer = EventWriter(rundir.tensorboard_dir(workdir), suffix=f"eval.{time.time_ns()}")
    try:
        writer.scalars(step, scalars)
    finally:
        writer.close()


def examples_path(workdir: Path, step: int, task: str) -> Path:
    """The per-example JSONL of `task` scored at `step`."""
    return workdir / EXAMPLES_DIR / f"step_{step}" / f"{task.replace('/', '_')}.jsonl"


def write_examples(
    workdir: Path, step: int, records: dict[str, list[dict]], settings: dict | None = None
) -> list[Path]:
    """One JSONL file per task (one object per example), each written atomically; with
    `settings`, their key recorded per task in the step's settings.json, and a file that
    other settings made kept under its own key rather than overwritten."""
    folder = workdir / EXAMPLES_DIR / f"step_{step}"
    index_path = folder / SETTINGS_FILE
    index = json.loads(index_path.read_text()) if index_path.is_file() else {}
    key = settings_key(settings) if settings is not None else None
    paths = []
    for task, rows in records.items():
        path = examples_path(workdir, step, task)
        path.parent.mkdir(parents=True, exist_ok=True)
        before = index.get(task, {}).get("key") if path.is_file() else None
        if path.is_file() and key is not None and before != key:
            # scored before with other (or unrecorded) settings: keep it under their key
            path.replace(path.with_name(f"{path.stem}.{before or 'unrecorded'}.jsonl"))
        rundir.write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))
        if key is not None:
            index[task] = {"key": key, "settings": settings}
        paths.append(path)
    if key is not None and paths:  # nothing scored: no folder, no index to update
        rundir.write_atomic(index_path, json.dumps(index, indent=1, sort_keys=True) + "\n")
    return paths
