"""Per-step metrics: the metrics.jsonl + TensorBoard writer and a throughput meter."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from scalestudy.train.rundir import layout as rundir
from scalestudy.train.rundir.tensorboard import EventWriter


def _newest(value: Any) -> float:
    """The last step's value of a metric: itself for one step, the last entry of a metric
    stacked over the steps of one call (train.steps_per_call)."""
    return float(np.asarray(value).reshape(-1)[-1])


def _plain(value: Any) -> Any:
    """A JSON-able Python scalar from a numpy/jax scalar (NaN stays NaN)."""
    if isinstance(value, np.ndarray | np.generic | jax.Array):
        value = np.asarray(value).item()
    return value


class MetricsWriter:
    """Appends one JSON object per log step to metrics.jsonl and mirrors scalars to TensorBoard.

    Appending (rather than rewriting) keeps earlier steps when a run resumes; on resume the
    loop truncates lines past the restored step so the file has no duplicates. Only process 0
    writes (`active=False` elsewhere).
    """

    def __init__(self, workdir: Path, *, tensorboard: bool = True, active: bool = True):
        self.path = rundir.metrics_path(workdir)
        self._file = self._tb = None
        if not active:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        if tensorboard:
            self._tb = EventWriter(rundir.tensorboard_dir(workdir))

    def write(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Record `metrics` at `step`; returns them as plain Python values."""
        row = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        if self._tb is not None:
            self._tb.scalars(
                int(step),
                {
                    k: float(v)
                    for k, v in row.items()
                    if k != "step" and isinstance(v, int | float) and math.isfinite(v)
                },
            )
        return row

    def sync(self) -> None:
        """Make every row written so far durable (called before a checkpoint is saved, so
        that the rows of every checkpointed step survive a crash)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


class Throughput:
    """Tokens/s over the steps since the last call, from wall-clock time."""

    def __init__(self) -> None:
        self._t, self._count = time.perf_counter(), 0.0

    def update(self, count: float) -> float:
        now = time.perf_counter()
        rate = (count - self._count) / max(now - self._t, 1e-9)
        self._t, self._count = now, count
        return rate


class NonFiniteMetric(Exception):
    """The training loss of `step` is NaN or infinite."""

    def __init__(self, loss: float, step: int):
        super().__init__(f"training loss is {loss} at step {step}")
        self.loss, self.step = loss, step


def each(watchers: list[Any]) -> Any:
    """One `watch(step, row)` calling every one of `watchers` in turn (None: none)."""
    if not watchers:
        return None

    def watch(step: int, row: dict[str, Any]) -> None:
        for watcher in watchers:
            watcher(step, row)

    return watch


class DeferredMetrics:
    """The device metrics of dispatched steps, brought to the host late so that the device
    can run ahead: the loop pushes step t's metrics after dispatching it and flushes those of
    an earlier step. Every step's token counts go into `totals`; log steps also become a
    metrics.jsonl row. A non-finite loss raises NonFiniteMetric when it reaches the host.
    The metrics pushed at a step may be stacked over several steps ending at it (one call of
    `Program.multi_step`); the row then holds the last of them, the totals count them all.
    A member of a group (train/loop.py) reads its own `member` index of metrics that carry
    a leading member axis. `watch(step, row)`, when given, reads every training row written
    (the MoE load warning, train/expert_load.py).
    """

    def __init__(
        self,
        writer: MetricsWriter,
        totals: dict,
        flops_per_step: float,
        clock: Any,
        member: int | None = None,
        watch: Any = None,
    ):
        self.writer, self.totals = writer, totals
        self.member = member
        self.watch = watch
        self.flops_per_step = flops_per_step
        self.clock = clock  # () -> the run's wall time so far
        self.throughput = Throughput()
        self.pending: list[tuple[int, Any]] = []  # (step, device metrics) not yet on the host
        self.to_log: tuple[int, Any] | None = None  # the newest log step not yet written
        self.last: Any = None  # the newest step's device metrics
        self.logged: dict[str, Any] = {}  # the latest value of every metric written

    def push(self, step: int, metrics: Any, *, log: bool) -> dict[str, Any] | None:
        """Queue the device metrics of the step (or steps ending at `step`) just dispatched;
        then write the previous log step's row (its step is done by now, this one is queued
        behind it) and return it."""
        self.pending.append((step, metrics))
        self.last = metrics
        row = self.flush(self.to_log[0]) if self.to_log is not None else None
        if log:
            self.to_log = (step, metrics)
        return row

    def flush(self, upto: int) -> dict[str, Any] | None:
        """Bring metrics of steps <= `upto` to the host: totals always, a row at a log step
        (returned)."""
        ready = [p for p in self.pending if p[0] <= upto]
        self.pending = [p for p in self.pending if p[0] > upto]
        counts = jax.device_get([(m["step_tokens"], m["step_positions"]) for _, m in ready])
        # Added one step at a time, as floats, in order.
        for tokens, positions in (map(self._own, pair) for pair in counts):
            for t, p in zip(np.ravel(tokens), np.ravel(positions), strict=True):
                self.totals["tokens"] += float(t)
                self.totals["positions"] += float(p)
        if self.to_log is None or self.to_log[0] > upto:
            return None
        step, metrics = self.to_log
        self.to_log = None
        row = {
            k: _newest(self._own(v))
            for k, v in jax.device_get(metrics).items()
            if not k.startswith("step_")
        }
        if not math.isfinite(row["train/loss"]):
            raise NonFiniteMetric(row["train/loss"], step)
        row |= {
            "tokens": self.totals["tokens"],
            "positions": self.totals["positions"],
            "flops": step * self.flops_per_step,
            "wall_time_s": self.clock(),
            "tokens_per_s": self.throughput.update(self.totals["tokens"]),
        }
        # Counted in the totals a checkpoint saves: a resume can tell whether rows were lost.
        self.totals["train_rows"] = self.totals.get("train_rows", 0) + 1
        row = self.write(step, row)
        if self.watch is not None:
            self.watch(step, row)
        return row

    def check_last(self, step: int) -> None:
        """Raise NonFiniteMetric when the newest dispatched step's loss is not finite (waits
        for that step)."""
        if self.last is not None:
            loss = _newest(self._own(jax.device_get(self.last["train/loss"])))
            if not math.isfinite(loss):
                raise NonFiniteMetric(loss, step)

    def _own(self, value: Any) -> Any:
        """This run's part of a host metric: all of it, or a member's index."""
        return value if self.member is None else np.asarray(value)[self.member]

    def write(self, step: int, row: dict[str, Any]) -> dict[str, Any]:
        """Write a row at `step` and remember its values."""
        row = self.writer.write(step, row)
        self.logged.update(row)
        return row
