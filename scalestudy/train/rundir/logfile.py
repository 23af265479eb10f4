"""Library output of a run goes to `<workdir>/train.log`, not the terminal: the user's
terminal shows the run's own lines (progress, warnings, the one error line), while
TensorFlow, absl, orbax, JAX, tensorstore and asyncio output stays available in the file.

Three kinds of library output are routed here:

- Python log records of the libraries' loggers (`library_logs_to_file`, while a run trains);
- tracebacks that library threads print without a logger: tensorstore's completion callbacks
  of a failed checkpoint write (`sys.excepthook` from a thread other than the main one) and
  exceptions in finalizers (`sys.unraisablehook`);
- on the command line (`quiet_terminal`), TensorFlow's C++ start-up lines, which its log level
  does not reach (they are written before TensorFlow reads it): the file descriptor 2 is held
  while TensorFlow is first imported, and what it received goes into the next run's log (or
  back to the terminal if the import fails). Records and tracebacks that arrive after the run
  (asyncio's never-retrieved futures of a failed save, logged at garbage collection or at
  exit) go to the same run's log.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.abc
import importlib.util
import logging
import logging.handlers
import os
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from scalestudy.config.errors import ScalestudyError
from scalestudy.train.rundir import layout as rundir
from scalestudy.train.runtime import stop_signals

# Loggers of the libraries under the loop; their records would otherwise reach the terminal.
LIBRARY_LOGGERS = (
    "absl",
    "orbax",
    "asyncio",
    "tensorflow",
    "jax",
    "etils",
    "tensorstore",
    "py.warnings",  # libraries' warnings on the command line (see `_show_warning`)
)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PACKAGE += os.sep

TF_LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL"
# Set beside TF_LOG_LEVEL when scalestudy chose the level (subprocesses inherit both): a level
# without it was set by the user, who then sees what TensorFlow prints at that level.
TF_LOG_LEVEL_DEFAULTED = "SCALESTUDY_TF_LOG_LEVEL_DEFAULT"
# TensorFlow's C++ log level on the command line: errors only (its info lines and warnings
# about the CPU build, CUDA drivers and ending iterators are no news to a user).
DEFAULT_TF_LOG_LEVEL = "2"

_held: list[str] = []  # native start-up output not yet written to a run's log
_cli = False  # quiet_terminal() was called: keep library output off the terminal after runs
_active: list[logging.Handler] = []  # the log of the run in progress
_after: list[Callable[[], None]] = []  # undoes the routing to the last run's log after it
_failed_saves = 0  # so far in this process; their futures log their exception when collected


def expect_late_records() -> None:
    """A save failed: its futures, garbage by now or soon, log their exception when collected.
    The run's log block that is open collects them before it closes."""
    global _failed_saves
    _failed_saves += 1


class _QuietFileHandler(logging.FileHandler):
    """A file handler that drops what it cannot write (on the disk the run filled) instead of
    printing logging's own traceback on the terminal or raising over the run's error."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            super().flush()

    def close(self) -> None:
        # The file is closed even when its last buffer cannot be written: the run's own error
        # (a failed save on the disk this log shares) is the one to report.
        with contextlib.suppress(OSError, ValueError):
            super().close()


def _handler(path: Path, delay: bool = False) -> _QuietFileHandler:
    handler = _QuietFileHandler(path, mode="a", encoding="utf-8", delay=delay)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    return handler


_accept: list[Callable[[], None]] = []  # open run logs whose run has not passed its checks


@contextlib.contextmanager
def library_logs_to_file(workdir: str | Path) -> Iterator[Path]:
    """Send the libraries' log records and thread tracebacks to the run's log file while the
    block runs (and, on the command line, after it). Until the run passes its checks
    (`run_accepted`), they are held: a run refused on resume leaves its log as it was."""
    path = rundir.log_path(workdir)
    while _after:
        _after.pop()()
    handler = _handler(path, delay=True)
    held = logging.handlers.MemoryHandler(1 << 30, flushLevel=logging.CRITICAL + 1)
    restore, swap = _route(held)

    def accept() -> None:
        _write_held(handler)
        held.setTarget(handler)
        held.flush()
        swap(handler)

    _accept.append(accept)
    _active.append(handler)
    saves_failed_before, failed = _failed_saves, True
    try:
        yield path
        failed = False
    except ScalestudyError:
        if accept in _accept:  # refused before its checks passed: nothing of it is written
            _accept.remove(accept)
            held.buffer.clear()
        raise
    finally:
        if accept in _accept:
            _accept.remove(accept)
            accept()
        _active.remove(handler)
        # Futures of a failed save that nobody retrieved log their exception when collected:
        # collect them while their records still go to the file. (Only then: a collection
        # of a long-lived process's heap costs up to a second, after every run.)
        if failed or _failed_saves != saves_failed_before:
            gc.collect()
        if _cli:  # the process ends soon; what the libraries say until then is the run's.
            # Swapped, never unrouted in between: a failed save's threads are still talking.
            swap(_handler(path, delay=True))
            _after.append(restore)
        else:
            restore()
        handler.close()


def run_accepted() -> None:
    """The run (or every member of a group) passed the checks made before anything is
    written: its held log records go to its file, and from now on straight there."""
    while _accept:
        _accept.pop(0)()


@contextlib.contextmanager
def library_logs_of(workdir: str | Path) -> Iterator[None]:
    """The libraries' notes (orbax opening checkpoints read-only, ...) to the run's log, as in
    training (`eval` on a finished run); none of them from a directory that cannot be written.
    They are held until the block ends and dropped when it refuses (a ScalestudyError): a
    refused command leaves the run's log as it found it."""
    if not os.access(workdir, os.W_OK):
        with library_logs_dropped():
            yield
        return
    held = logging.handlers.MemoryHandler(capacity=1 << 30, flushLevel=logging.CRITICAL + 1)
    restore, _ = _route(held)
    try:
        yield
    except ScalestudyError:
        held.buffer.clear()
        raise
    finally:
        restore()
        if held.buffer:
            target = _handler(rundir.log_path(workdir))
            held.setTarget(target)
            held.flush()
            target.close()
        held.close()


@contextlib.contextmanager
def library_logs_dropped() -> Iterator[None]:
    """Drop the libraries' log records while the block runs: checks made before a run has a
    log of its own (and that must write nothing), such as orbax's notes on opening a run's
    checkpoints read-only."""
    restore, _ = _route(logging.NullHandler())
    try:
        yield
    finally:
        restore()


def _write_held(handler: logging.FileHandler) -> None:
    """Write the held start-up output into `handler`'s file (opening it: the run's log
    exists from here on)."""
    with contextlib.suppress(OSError, ValueError):
        if handler.stream is None:
            handler.stream = handler._open()
        while _held:
            handler.stream.write(_held[0])
            _held.pop(0)
        handler.flush()


def _route(
    handler: logging.Handler,
) -> tuple[Callable[[], None], Callable[[logging.Handler], None]]:
    """Point the library loggers and the thread traceback hooks at `handler`; returns what
    undoes it, and what points them at another handler instead."""
    current = [handler]
    propagate = {}
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        propagate[name] = logger.propagate
        logger.addHandler(handler)
        logger.propagate = False
    hooks = sys.excepthook, sys.unraisablehook
    log = logging.getLogger("tensorstore")

    def excepthook(kind: Any, value: Any, tb: Any) -> None:
        if threading.current_thread() is threading.main_thread():
            hooks[0](kind, value, tb)
        else:  # printed by a library's callback thread (tensorstore), not raised to us
            log.error("exception in a library thread", exc_info=(kind, value, tb))

    def unraisablehook(unraisable: Any) -> None:
        exc = unraisable.exc_value
        log.error(
            "%s: %s",
            unraisable.err_msg or "exception ignored",
            unraisable.object,
            exc_info=(type(exc), exc, unraisable.exc_traceback) if exc is not None else None,
        )

    sys.excepthook, sys.unraisablehook = excepthook, unraisablehook

    def restore() -> None:
        for name, was in propagate.items():
            logger = logging.getLogger(name)
            logger.removeHandler(current[0])
            logger.propagate = was
        if (sys.excepthook, sys.unraisablehook) == (excepthook, unraisablehook):
            sys.excepthook, sys.unraisablehook = hooks

    def swap(new: logging.Handler) -> None:
        for name in propagate:
            logger = logging.getLogger(name)
            logger.addHandler(new)  # added before the old one goes: no record finds neither
            logger.removeHandler(current[0])
        current[0] = new

    return restore, swap


def quiet_terminal() -> None:
    """For the command line: TensorFlow's C++ log level (unless the user set one) with its
    start-up lines held, warnings as one `warning:` line each, and library output that
    arrives after a run in that run's log."""
    global _cli
    _cli = True
    warnings.showwarning = _show_warning
    _hold_import("jax", output=False)
    user_level = TF_LOG_LEVEL in os.environ and TF_LOG_LEVEL_DEFAULTED not in os.environ
    if user_level or "tensorflow" in sys.modules:
        return
    os.environ[TF_LOG_LEVEL] = DEFAULT_TF_LOG_LEVEL
    os.environ[TF_LOG_LEVEL_DEFAULTED] = "1"
    _hold_import("tensorflow", output=True)


def _hold_import(name: str, output: bool) -> None:
    """Hold stop signals (and with `output`, file descriptor 2) while `name` is first
    imported (`_HeldImport`)."""
    if name not in sys.modules and not any(
        isinstance(f, _HeldImport) and f.name == name for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _HeldImport(name, output))


def _show_warning(
    message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None
) -> None:
    """A warning of this package (raised where its code called) as one line on the terminal;
    a library's to the library log, with where it came from."""
    text = " ".join(str(message).split())
    if not os.path.abspath(filename).startswith(_PACKAGE):
        where = f"{category.__name__} at {filename}:{lineno}"
        logging.getLogger("py.warnings").warning("%s: %s", where, text)
        return
    with contextlib.suppress(OSError, ValueError):
        print(f"warning: {text}", file=file or sys.stderr)


@contextlib.contextmanager
def native_output_held(what: str) -> Iterator[None]:
    """While the block runs, what is written to file descriptor 2 (C++ libraries, and
    Python's stderr) is held in a temporary file; afterwards it waits for the next run's log,
    or, if the block raised, goes to the terminal after all."""
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
    saved = os.dup(2)
    failed = True
    try:
        with tempfile.TemporaryFile() as held:
            os.dup2(held.fileno(), 2)
            try:
                yield
                failed = False
            finally:
                with contextlib.suppress(OSError, ValueError):
                    sys.stderr.flush()
                os.dup2(saved, 2)
                held.seek(0)
                text = held.read().decode(errors="replace")
                if failed:
                    os.write(2, text.encode())
                elif text:
                    _held.append(f"--- output of {what} on start-up\n{text}")
                    if _active:  # imported while a run starts: straight into its log
                        _write_held(_active[-1])
    finally:
        os.close(saved)


class _HeldImport(importlib.abc.MetaPathFinder):
    """Runs the first import of one module with stop signals held (`stops.held`: a signal
    is answered once the import is over) and, with `output`, file descriptor 2 held (see
    `native_output_held`); later imports are the normal ones."""

    def __init__(self, name: str, output: bool = True):
        self.name, self.output = name, output

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        spec = None
        for finder in sys.meta_path:  # the spec the other finders give, with this loader
            find = getattr(finder, "find_spec", None)
            spec = None if finder is self or find is None else find(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _HeldLoader(spec.loader, self)
        return spec


class _HeldLoader(importlib.abc.Loader):
    """The loader of `_HeldImport`'s module: the real one, run with file descriptor 2 held."""

    def __init__(self, loader: Any, finder: _HeldImport):
        self.loader, self.finder = loader, finder

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self.finder)  # imported once: later imports are the normal ones
        module.__spec__.loader = module.__loader__ = self.loader
        output = (
            native_output_held(module.__name__) if self.finder.output else contextlib.nullcontext()
        )
        with stop_signals.held(), output:
            self.loader.exec_module(module)
            if module.__name__ == "tensorflow":
                _host_only(module)


def _host_only(tf: Any) -> None:
    """TensorFlow only feeds data here, on the host: hide its GPUs. Listing them starts CUDA,
    which prints its failure on a host without a GPU (so this runs inside the import's held
    output), and on a host with one TensorFlow would take the memory JAX trains in."""
    with contextlib.suppress(RuntimeError, ValueError):  # devices already in use: leave them
        tf.config.set_visible_devices([], "GPU")
