"""Where a run directory keeps its zero-shot results.

- `summary.json["eval"]`: the aggregates of the latest evaluation (flat "<task>/<metric>"),
  and `summary.json["eval_config"]`: the evaluation settings they were scored with;
- `metrics.jsonl`: one line per evaluation, keys "eval/<task>/<metric>";
- `eval_examples/step_<step>/<task>.jsonl`: the per-example scores (`records.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

from scalestudy.train import rundir

EXAMPLES_DIR = "eval_examples"


def write_results(
    workdir: Path, step: int, results: dict[str, float], settings: dict | None = None
) -> None:
    """Merge into summary.json["eval"] (and the settings into ["eval_config"]) and append one
    line to metrics.jsonl (through train/rundir.py, which owns those files)."""
    summary = rundir.read_summary(workdir) or {}
    summary["eval"] = {**summary.get("eval", {}), **results, "step": step}
    if settings is not None:
        summary["eval_config"] = settings
    rundir.write_summary(workdir, summary)
    rundir.append_metrics(workdir, {"step": step, **{f"eval/{k}": v for k, v in results.items()}})


def examples_path(workdir: Path, step: int, task: str) -> Path:
    """The per-example JSONL of `task` scored at `step`."""
    return workdir / EXAMPLES_DIR / f"step_{step}" / f"{task.replace('/', '_')}.jsonl"


def write_examples(workdir: Path, step: int, records: dict[str, list[dict]]) -> list[Path]:
    """One JSONL file per task (one object per example), each written atomically."""
    paths = []
    for task, rows in records.items():
        path = examples_path(workdir, step, task)
        path.parent.mkdir(parents=True, exist_ok=True)
        rundir.write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))
        paths.append(path)
    return paths
