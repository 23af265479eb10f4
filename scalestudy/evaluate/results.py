"""Where a run directory keeps its zero-shot results.

- `summary.json["eval"]`: the aggregates of the latest evaluation (flat "<task>/<metric>"),
  `summary.json["eval_config"]`: the evaluation settings they were scored with, and
  `summary.json["eval_configs"]`: every settings key this run was evaluated with -> settings;
- `metrics.jsonl`: one line per evaluation, keys "eval/<task>/<metric>" and `eval_settings`,
  the key of its settings (so two evaluations of one step say which settings made which);
- `eval_examples/step_<step>/<task>.jsonl`: the per-example scores (`records.py`) of the
  latest evaluation of that step, `settings.json` beside them naming each task's settings.
  An evaluation with other settings never overwrites silently: the earlier file is kept as
  `<task>.<its settings key>.jsonl` first.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from scalestudy.train import rundir

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
    line to metrics.jsonl (through train/rundir.py, which owns those files)."""
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
    if key is not None:
        rundir.write_atomic(index_path, json.dumps(index, indent=1, sort_keys=True) + "\n")
    return paths
