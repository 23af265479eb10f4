"""How a study stops: on a signal to its process, and when that process dies.

The first SIGINT or SIGTERM asks every running run to save a checkpoint and stop (the
training loop does this at its next step boundary); no further run starts, the stopped runs
are marked `interrupted` and the study exits 128 + the signal number. A second Ctrl-C stops
at once. Worker processes (`--workers N`) die with the study that started them: each asks the
kernel for SIGTERM when its parent dies (Linux prctl PR_SET_PDEATHSIG) and also watches its
parent's pid, so a study killed with SIGKILL leaves no worker training on.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
from typing import Any

from scalestudy.config.errors import ScalestudyError
from scalestudy.train.rundir import logfile

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StudyInterrupted(ScalestudyError):
    """SIGINT/SIGTERM stopped the study; its running runs were checkpointed."""

    def __init__(self, message: str, signum: int):
        super().__init__(message, signum)  # both in args, so it survives pickling
        self.signum = signum

    def __str__(self) -> str:
        return str(self.args[0])


class RunInterrupted(ScalestudyError):
    """A run stopped on a signal: by its training loop after a checkpoint, or outside the loop
    (while building or compiling, when there is nothing newer than its last checkpoint)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message, signum)  # both in args, so it survives pickling
        self.signum = signum

    def __str__(self) -> str:
        return str(self.args[0])


_OUTSIDE_LOOP = "stopped outside its training loop; resumes from its last checkpoint"


def signal_of(error: BaseException) -> int | None:
    """The signal that stopped a run, when `error` says a run stopped on one (the training
    loop's Preempted, RunInterrupted, a KeyboardInterrupt); else None."""
    if isinstance(error, KeyboardInterrupt):
        return signal.SIGINT
    signum = getattr(error, "signum", None)
    return int(signum) if isinstance(signum, int) else None


class StopRequests:
    """Within `with`: SIGINT/SIGTERM handlers for the study's own process.

    `signum` is the first stop signal seen, also one that arrived while another handler (the
    training loop's) was installed: a wakeup fd records every signal whatever handles it, and
    `poll()` reads it. `on_stop(signum)` runs once, at the first signal. While `running` is
    true (a run is training in this process but outside its loop's own handler, e.g.
    compiling), the first signal raises RunInterrupted there, so the run stops now rather
    than after training to its end."""

    def __init__(self, on_stop: Any = None, write: Any = None) -> None:
        self.signum: int | None = None
        self._on_stop = on_stop
        self._write = write or (lambda line: print(line, file=sys.stderr))
        self._active = threading.current_thread() is threading.main_thread()
        self.running = False

    def __enter__(self) -> StopRequests:
        if not self._active:  # signal handlers can only be set from the main thread
            return self
        self._read, write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(write, False)
        self._write_fd = write
        self._old_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._old = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._active:
            return
        for s, h in self._old.items():
            signal.signal(s, h)
        signal.set_wakeup_fd(self._old_fd)
        os.close(self._read)
        os.close(self._write_fd)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        self.note(signum)
        if self.running:
            self.running = False
            raise RunInterrupted(_OUTSIDE_LOOP, signum)

    def note(self, signum: int) -> None:
        """Record a stop signal (the first one counts)."""
        if self.signum is not None:
            return
        self.signum = signum
        self._write(
            f"{signal.Signals(signum).name} received: stopping once the running run(s) have "
            "saved a checkpoint; press Ctrl-C again to stop at once"
        )
        if self._on_stop is not None:
            self._on_stop(signum)

    def poll(self) -> int | None:
        """The first stop signal so far (None: keep going)."""
        if self._active:
            try:
                data = os.read(self._read, 512)
            except BlockingIOError:
                data = b""
            for signum in data:
                if signum in SIGNALS:
                    self.note(signum)
        return self.signum


# ----------------------------------------------------------------------------- workers

NOT_STARTED = "not started: the study was stopping"
_worker: dict[str, Any] = {"parent": None, "stop": None, "in_task": False}


def _parent_gone() -> bool:
    return os.getppid() != _worker["parent"]


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM outside the training loop (which has its own handler while it runs)."""
    if _worker["in_task"]:
        raise RunInterrupted(_OUTSIDE_LOOP, signum)
    if _parent_gone():
        os._exit(128 + signum)


def _watch(grace_s: float) -> None:
    """Turn the study's stop request, or its death, into SIGTERM for this worker; a worker
    whose parent is gone exits `grace_s` later at the latest."""
    stop = _worker["stop"]
    while not (stop.wait(0.5) or _parent_gone()):
        pass
    os.kill(os.getpid(), signal.SIGTERM)
    while not _parent_gone():  # stopping with the study alive: it collects the results
        threading.Event().wait(0.5)
    threading.Event().wait(grace_s)
    os._exit(128 + signal.SIGTERM)


def set_parent_death_signal(signum: int) -> bool:
    """Ask the kernel to send `signum` to this process when its parent dies (Linux only);
    returns whether that was possible."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(1, int(signum), 0, 0, 0) == 0  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


# Where multiprocessing's resource tracker writes, in the study directory.
TRACKER_LOG = "workers.log"


def start_resource_tracker(log: Any) -> None:
    """Start multiprocessing's resource tracker (a process of its own that outlives a killed
    study and reports the semaphores its workers' queues left: "There appear to be 10 leaked
    semaphore objects") with its stderr on `log`, not the terminal. A tracker this process
    started earlier keeps its own."""
    from multiprocessing import resource_tracker

    with open(log, "a") as f:
        saved = os.dup(2)
        try:
            os.dup2(f.fileno(), 2)
            resource_tracker.ensure_running()
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def worker_init(parent: int, stop: Any, grace_s: float = 300.0) -> None:
    """Initializer of a study's worker process: die with the study, stop when it stops.

    Terminal Ctrl-C reaches every process of the foreground group; the study decides, so a
    worker ignores SIGINT outside the training loop."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # workers share a GPU
    logfile.quiet_terminal()  # a worker's library output goes to its runs' logs, as the study's
    _worker.update(parent=parent, stop=stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    set_parent_death_signal(signal.SIGTERM)
    threading.Thread(target=_watch, args=(grace_s,), daemon=True).start()


def train_in_worker(train_fn: Any, cfg: Any, workdir: Any) -> Any:
    """Run `train_fn(cfg, workdir)` in a worker: NOT_STARTED when the study is stopping, a
    RunInterrupted (picklable) when the run stopped on a signal."""
    if _worker["stop"].is_set():
        return NOT_STARTED
    _worker["in_task"] = True
    try:
        return train_fn(cfg, workdir)
    except BaseException as e:
        signum = signal_of(e)
        if signum is None:
            raise
        if _parent_gone():  # nobody to report to
            os._exit(128 + signum)
        raise RunInterrupted(str(e) or signal.Signals(signum).name, signum) from None
    finally:
        _worker["in_task"] = False
