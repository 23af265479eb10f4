"""Stop signals outside the training loop: one answer to SIGINT and SIGTERM at any moment.

While the training loop runs, its own handler (train/runtime/distributed.py) turns a signal into a
checkpoint at the next step boundary. Before it starts (imports, building the data, compiling,
restoring) and after it ends, the command line's handler raises `Stopped` where the process
is; the command prints one `stopped:` line and exits 128 + the signal. A signal whose
exception a library swallowed (one raised inside a garbage-collection callback is printed as
"exception ignored" and dropped) is still recorded: `pending()` gives it to the training
loop, which stops at its first step boundary instead of training on.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_caught: list[int] = []  # the first signal `catch`'s handler saw, in this process
_holding: list[bool] = []  # one entry per `held` block the process is inside
_deferred: list[int] = []  # a signal that arrived inside them, raised when they end


class Stopped(BaseException):
    """A stop signal outside the training loop. A BaseException, like KeyboardInterrupt: no
    `except Exception` on the way out may take it for an error of its own (a restore that
    failed, say)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    def __str__(self) -> str:
        return (
            f"{signal.Signals(self.signum).name} received: stopped at once (outside a "
            "training loop, so no new checkpoint was saved); the same command starts again "
            "from what was saved before"
        )


def catch() -> None:
    """From now on in this process, SIGINT and SIGTERM raise Stopped (outside the training
    loop's own handler). A SIGINT ignored by whoever started the process (a background job)
    stays ignored, as Python leaves it."""
    _caught.clear()
    _deferred.clear()
    for signum in SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, _handle)
    if sys.unraisablehook is not _unraisable:
        _unraisable.previous = sys.unraisablehook  # type: ignore[attr-defined]
        sys.unraisablehook = _unraisable


def _unraisable(unraisable: Any) -> None:
    """A Stopped that a callback could not raise is recorded already (`pending`); the rest
    as before."""
    if not isinstance(unraisable.exc_value, Stopped):
        _unraisable.previous(unraisable)  # type: ignore[attr-defined]


def _handle(signum: int, frame: Any) -> None:
    if not _caught:
        _caught.append(signum)
    if not _holding:
        raise Stopped(signum)
    if not _deferred:
        _deferred.append(signum)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """A stop signal inside the block is recorded and raised as Stopped once the block is
    over: for the import of a native library (JAX, TensorFlow), which an exception raised
    half-way through its initialisation can leave broken, so that the process crashes (a
    segfault, with no `stopped:` line) instead of stopping."""
    _holding.append(True)
    try:
        yield
    finally:
        _holding.pop()
    if _deferred and not _holding:
        raise Stopped(_deferred.pop())


def pending() -> int | None:
    """The first signal `catch`'s handler saw (also one whose Stopped a library swallowed)."""
    return _caught[0] if _caught else None


def leave(status: int) -> None:
    """End the command-line process at once with `status` after a stop, without Python's
    shutdown, where a native library that a signal interrupted can crash (a segfault after
    the `stopped:` line). Files are closed by then (the stop came through every `finally`);
    logging is flushed here. While child processes of this one run, it returns, and the
    process ends as usual (Python's shutdown ends them)."""
    import logging
    import multiprocessing
    import os

    if multiprocessing.active_children():
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status)
