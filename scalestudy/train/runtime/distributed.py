"""Several processes, one run: who writes, how processes agree, and when they stop.

Process 0 is the primary: the one writer of run files. Decisions that must be the same on
every process (which checkpoint to restore, whether one is unreadable, when to stop on a
signal) are taken on the primary or gathered from all, through the helpers here. On one
process each helper is the identity and costs nothing.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from scalestudy.train.runtime import stop_signals


def is_primary() -> bool:
    """Whether this process writes the run's files."""
    return jax.process_index() == 0


def process_layout() -> tuple[int, int]:
    """(this process's index, number of processes)."""
    return jax.process_index(), jax.process_count()


def agreed(value: int) -> int:
    """The primary process's `value`, on every process."""
    if jax.process_count() == 1:
        return value
    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def on_all(flag: bool) -> bool:
    """Whether `flag` holds on every process."""
    if jax.process_count() == 1:
        return flag
    return bool(np.all(multihost_utils.process_allgather(np.int32(flag))))


def largest(value: int) -> int:
    """The largest of every process's `value`."""
    if jax.process_count() == 1:
        return value
    return int(np.max(multihost_utils.process_allgather(np.int32(value))))


def total(value: int) -> int:
    """The sum of every process's `value`."""
    if jax.process_count() == 1:
        return value
    # Two int32 halves: JAX without x64 would cut an int64 to 32 bits.
    halves = np.array([value >> 31, value & (2**31 - 1)], np.int32)
    high, low = np.asarray(multihost_utils.process_allgather(halves), np.int64).sum(axis=0)
    return int(high << 31) + int(low)


def barrier(name: str) -> None:
    """Wait until every process has reached the barrier called `name`."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


@contextlib.contextmanager
def stop_requests(check_every: int) -> Iterator[Callable[[int], int | None]]:
    """`stop(step)`: the signal (SIGTERM/SIGINT) that asks to save and stop after `step`, or
    None. Called at every step boundary with increasing steps.

    One process: a Python handler sets a flag. Several processes: JAX's preemption sync
    manager (started by jax.distributed.initialize) catches SIGTERM on whichever process gets
    it and makes `reached_preemption_sync_point` true on every process at the same step;
    SIGINT is turned into SIGTERM for it. Without the manager, the processes all-gather the
    flag every `check_every` steps instead.
    """
    if threading.current_thread() is not threading.main_thread():
        yield lambda at: None
        return
    stopper = _Stopper(check_every)
    # With the manager, SIGTERM stays with its handler: a Python one would replace it.
    signums = (signal.SIGINT,) if stopper.manager else (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.signal(s, stopper.handler) for s in signums}
    try:
        yield stopper.stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class _Stopper:
    """The signal flag of `stop_requests` and the per-step check of it."""

    def __init__(self, check_every: int):
        from jax._src import distributed as jax_distributed

        # A signal seen before the loop whose exception a library swallowed: stop at once.
        self.signum: int | None = stop_signals.pending()
        self.check_every = check_every
        self.multi = jax.process_count() > 1
        self.manager = (
            self.multi and jax_distributed.global_state.preemption_sync_manager is not None
        )
        if self.manager and self.signum is not None:
            signal.raise_signal(signal.SIGTERM)  # to the manager's own (C++) handler

    def handler(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.signum is not None:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the checkpoint
        self.signum = signum
        if self.manager and signum != signal.SIGTERM:
            signal.raise_signal(signal.SIGTERM)  # to the manager's own (C++) handler

    def stop(self, at: int) -> int | None:
        if not self.multi:
            return self.signum
        if self.manager:
            reached = multihost_utils.reached_preemption_sync_point(at)
            return (self.signum or signal.SIGTERM) if reached else None
        if at % self.check_every:
            return None
        return largest(self.signum or 0) or None
