"""The run directory: the names of the files a run leaves behind, how they are written, and
how they are read back. Every other module asks this one.

```
<workdir>/
  config.yaml            the resolved ExperimentConfig (written atomically)
  summary.json           final counts, losses, evaluation (written atomically)
  attention_rank.json    attention-rank and collapse measures of a checkpoint (atomically)
  experts/               `scalestudy experts`: MoE routing pictures and experts.json
  metrics.jsonl          one JSON object per logged step (appended; fsync'd at checkpoints)
  tensorboard/           TensorBoard scalar events
  checkpoints/<step>/    orbax checkpoints
  corrupt_checkpoints/   checkpoints set aside because they could not be restored
  train.log              library log output (TensorFlow, absl, orbax) of the run
  run.lock               held by the process training in this directory
```
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from scalestudy.config.errors import ScalestudyError

CONFIG = "config.yaml"
SUMMARY = "summary.json"
ATTENTION_RANK = "attention_rank.json"
EXPERTS = "experts"
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
CHECKPOINTS = "checkpoints"
CORRUPT = "corrupt_checkpoints"
LOG = "train.log"
LOCK = "run.lock"


def _in_run(name: str, what: str) -> Callable[[str | Path], Path]:
    """The accessor of one entry of the run directory: workdir -> workdir / name."""

    def path(workdir: str | Path) -> Path:
        return Path(workdir) / name

    path.__doc__ = f"The run's {what} ({name})."
    return path


config_path = _in_run(CONFIG, "resolved config file")
summary_path = _in_run(SUMMARY, "summary file")
attention_rank_path = _in_run(ATTENTION_RANK, "attention-rank measures")
experts_dir = _in_run(EXPERTS, "folder of MoE routing pictures")
metrics_path = _in_run(METRICS, "per-step metrics file")
tensorboard_dir = _in_run(TENSORBOARD, "TensorBoard event directory")
checkpoints_dir = _in_run(CHECKPOINTS, "orbax checkpoint directory")
corrupt_dir = _in_run(CORRUPT, "folder of checkpoints that could not be restored (never deleted)")
log_path = _in_run(LOG, "library log file")
lock_path = _in_run(LOCK, "lock file")


# What a run writes before its first step: a run stopped by an error with nothing more than
# these (made by that invocation) has nothing worth keeping.
START_UP = (CONFIG, LOCK, LOG, CHECKPOINTS)


def entries(workdir: str | Path) -> set[str] | None:
    """The names in `workdir`, or None when it does not exist (what `undo_start` compares)."""
    workdir = Path(workdir)
    return {p.name for p in workdir.iterdir()} if workdir.is_dir() else None


def undo_start(workdir: str | Path, before: set[str] | None) -> None:
    """After a run was refused before its first step: remove what it made in `workdir`
    (`before`: `entries` as it started), so that the disk is left as it was found. Nothing is
    removed when it made anything beyond its start-up files (a checkpoint, a metrics row)."""
    workdir = Path(workdir)
    made = (entries(workdir) or set()) - (before or set())
    if not made or not made <= set(START_UP):
        return
    steps = checkpoints_dir(workdir)
    if CHECKPOINTS in made and steps.is_dir() and any(steps.iterdir()):
        return
    with contextlib.suppress(OSError):
        for name in made:
            path = workdir / name
            path.rmdir() if path.is_dir() else path.unlink()
        if before is None:
            workdir.rmdir()


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


class RunLockError(ScalestudyError):
    """Another process is training in the same run directory."""


@contextlib.contextmanager
def run_lock(workdir: str | Path) -> Iterator[dict[str, Any]]:
    """Hold `<workdir>/run.lock` while training there; yields the holder record.

    An flock on the file (the kernel releases it when the holder dies, however it dies) plus
    a record naming the holder. A second process is refused with the holder's pid, host and
    start time; a lock whose holder on this host is dead is taken over. A record left by a
    process on another host, whose liveness cannot be checked from here, is refused too,
    naming the file to delete once that job is known to be gone.
    """
    path = lock_path(workdir)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunLockError(_held(workdir, path.read_text(errors="replace"))) from None
        text = path.read_text(errors="replace").strip()
        here = socket.gethostname()
        if text:  # a record without a live flock: its holder is gone, or on another host
            try:
                holder = json.loads(text)
            except json.JSONDecodeError:
                holder = {}
            if isinstance(holder, dict) and holder.get("host", here) != here:
                raise RunLockError(
                    f"{_held(workdir, text)}. It cannot be checked from {here}: once that job "
                    f"is gone, delete {path}"
                )
        me = {
            "pid": os.getpid(),
            "host": here,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        try:
            yield me
        finally:
            os.ftruncate(fd, 0)  # the file stays: none may lock a file another just unlinked
    finally:
        os.close(fd)  # releases the flock


def _held(workdir: str | Path, text: str) -> str:
    try:
        h = json.loads(text)
        who = f"pid {h['pid']} on {h['host']}, started {h['started']}"
    except (json.JSONDecodeError, KeyError, TypeError):
        who = "another process"
    return (
        f"the run directory {workdir} is in use by {who}; two processes training one run "
        "would overwrite each other's checkpoints and summary. Wait for it to finish (or stop "
        "it), or use another --workdir"
    )


class RunNotUpdated(ScalestudyError):
    """Results were computed, but the run directory could not be updated with them."""

    def __init__(self, message: str, results: dict[str, Any]):
        super().__init__(message)
        self.results = results


def record_results(
    workdir: str | Path,
    results: dict[str, Any],
    write_into_run: Callable[[], None],
    out: str | Path | None = None,
) -> None:
    """Keep `results` computed from a run: in the file `out` (JSON) when given, else through
    `write_into_run()`. A run directory that cannot be written (read-only, full) raises
    RunNotUpdated carrying the results, so that the caller can still show them."""
    if out is not None:
        write_atomic(Path(out), json.dumps(results, indent=2, sort_keys=True) + "\n")
        return
    # All or nothing: a file the results go to that is not a file stops them before any write.
    blocked = [
        n for n in (SUMMARY, METRICS) if (p := Path(workdir) / n).exists() and not p.is_file()
    ]
    if blocked:
        raise RunNotUpdated(
            f"could not update the run directory {workdir}: {', '.join(blocked)} is not a file; "
            "nothing was written there: give --out FILE to write the results elsewhere",
            results,
        )
    try:
        write_into_run()
    except OSError as e:
        raise RunNotUpdated(
            f"could not update the run directory {workdir} ({e.strerror or e}); the results "
            "were not saved there: give --out FILE to write them elsewhere",
            results,
        ) from None
