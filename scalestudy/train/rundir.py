"""The run directory: the names of the files a run leaves behind, how they are written, and
how they are read back. Every other module asks this one.

```
<workdir>/
  config.yaml            the resolved ExperimentConfig (written atomically)
  summary.json           final counts, losses, evaluation (written atomically)
  probes.json            attention-rank and collapse probes of a checkpoint (atomically)
  metrics.jsonl          one JSON object per logged step (appended; fsync'd at checkpoints)
  tensorboard/           TensorBoard scalar events
  checkpoints/<step>/    orbax checkpoints
  corrupt_checkpoints/   checkpoints set aside because they could not be restored
  train.log              library log output (TensorFlow, absl, orbax) of the run
  run.lock               held by the process training in this directory
```
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CONFIG = "config.yaml"
SUMMARY = "summary.json"
PROBES = "probes.json"
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
CHECKPOINTS = "checkpoints"
CORRUPT = "corrupt_checkpoints"
LOG = "train.log"
LOCK = "run.lock"


def config_path(workdir: str | Path) -> Path:
    """The run's resolved config file."""
    return Path(workdir) / CONFIG


def summary_path(workdir: str | Path) -> Path:
    """The run's summary file."""
    return Path(workdir) / SUMMARY


def probes_path(workdir: str | Path) -> Path:
    """The run's probe results."""
    return Path(workdir) / PROBES


def metrics_path(workdir: str | Path) -> Path:
    """The run's per-step metrics file."""
    return Path(workdir) / METRICS


def tensorboard_dir(workdir: str | Path) -> Path:
    """The run's TensorBoard event directory."""
    return Path(workdir) / TENSORBOARD


def checkpoints_dir(workdir: str | Path) -> Path:
    """The run's orbax checkpoint directory."""
    return Path(workdir) / CHECKPOINTS


def corrupt_dir(workdir: str | Path) -> Path:
    """Where checkpoints that cannot be restored are moved (never deleted)."""
    return Path(workdir) / CORRUPT


def log_path(workdir: str | Path) -> Path:
    """The run's library log file."""
    return Path(workdir) / LOG


def lock_path(workdir: str | Path) -> Path:
    """The run's lock file."""
    return Path(workdir) / LOCK


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a reader (or a crash) sees the old file or the new
    one, never half of one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def write_config(workdir: str | Path, yaml_text: str) -> None:
    """Record the resolved config (YAML text) of the run in `workdir`."""
    write_atomic(config_path(workdir), yaml_text)


def write_summary(workdir: str | Path, summary: dict[str, Any]) -> None:
    """Write summary.json atomically."""
    write_atomic(summary_path(workdir), json.dumps(summary, indent=2))


def read_summary(workdir: str | Path) -> dict[str, Any] | None:
    """The run's summary, or None when there is none (or it is not a JSON object)."""
    path = summary_path(workdir)
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return summary if isinstance(summary, dict) else None


def _rows(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(line, row) for every complete row of a metrics.jsonl text.

    A line that does not parse (torn by a full disk or a power cut while it was written) is
    dropped: its step is re-run on resume, so its row is written again.
    """
    out = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            out.append((line, row))
    return out


def read_metrics_file(path: str | Path) -> list[dict[str, Any]]:
    """All complete rows of a metrics.jsonl file (torn lines skipped; [] when absent)."""
    path = Path(path)
    if not path.is_file():
        return []
    return [row for _, row in _rows(path.read_text(errors="replace"))]


def read_metrics(workdir: str | Path) -> list[dict[str, Any]]:
    """All complete rows of a run's metrics.jsonl."""
    return read_metrics_file(metrics_path(workdir))


def append_metrics(workdir: str | Path, row: dict[str, Any]) -> None:
    """Append one row (with an int "step") to the run's metrics.jsonl, durably."""
    with metrics_path(workdir).open("a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def truncate_metrics_after(workdir: str | Path, step: int) -> None:
    """Drop metrics.jsonl rows after `step` (work lost at a preemption) and torn lines; the
    file is replaced atomically so a crash here loses nothing."""
    path = metrics_path(workdir)
    if not path.exists():
        return
    kept = [line for line, row in _rows(path.read_text(errors="replace")) if row["step"] <= step]
    write_atomic(path, "".join(line + "\n" for line in kept))
