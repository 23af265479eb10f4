"""A failed checkpoint save, ended in this process before its error is raised.

When a save fails (disk full, read-only), orbax raises at the first write that failed while
the rest of that save is still running: the commit threads of its other items, and the array
writes tensorstore had started in the same batch (they finish on tensorstore's own threads, and
their completion callbacks find orbax's event loop closed). Left alone they race a resume in
the same process over the failed step's temporary directory, keep a file open so the disk
cannot be remounted, and log after the run's log routing has ended. `settle_failed_save` waits
for all of them and removes what the save left.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import shutil
import threading
import time
from pathlib import Path

from scalestudy.train import distributed

# orbax writes step N into `N.orbax-checkpoint-tmp...` and renames it once complete.
TMP_SUFFIX = ".orbax-checkpoint-tmp"
# A failed save is over when its files have not changed for QUIET_S and none is open; tensorstore
# workers starved of CPU can pause for a good fraction of a second between writes.
QUIET_S = 1.0
SETTLE_LIMIT_S = 60.0


def _orbax_threads() -> list[threading.Thread]:
    """orbax's save threads running in this process (the item commits, the finalizer)."""
    me = threading.current_thread()
    return [
        t
        for t in threading.enumerate()
        if t is not me
        and t.is_alive()
        and (type(t).__module__.startswith("orbax.") or t.name in ("async_save", "save_finalize"))
    ]


def open_files_under(directory: Path) -> list[str]:
    """Files under `directory` that this process holds open ([] where /proc is absent)."""
    fds = Path("/proc/self/fd")
    if not fds.is_dir():
        return []
    prefix = str(directory) + os.sep
    held = []
    for fd in os.listdir(fds):
        with contextlib.suppress(OSError):  # closed since the listing
            target = os.readlink(fds / fd)
            if target.startswith(prefix):
                held.append(target)
    return sorted(held)


def _tmp_state(directory: Path) -> tuple[list[str], list[tuple[str, int, int]]]:
    """(files of `directory`'s temporary step directories held open, and all their files)."""
    held = [path for path in open_files_under(directory) if TMP_SUFFIX in path]
    files = []
    for tmp in directory.glob(f"*{TMP_SUFFIX}*"):
        for root, _, names in os.walk(tmp):  # os.walk skips directories removed meanwhile
            for name in names:
                with contextlib.suppress(OSError):
                    st = os.stat(os.path.join(root, name))
                    files.append((os.path.join(root, name), st.st_size, st.st_mtime_ns))
    return held, sorted(files)


def settle_failed_save(directory: Path, step: int | None, limit_s: float = SETTLE_LIMIT_S) -> None:
    """End a failed save in this process: join orbax's save threads, wait until the writes
    left in flight stop (no file open under `directory`, the temporary directories unchanged
    for QUIET_S), then remove step `step`'s temporary directory (process 0 only: the other
    processes' writes are their own). Gives up waiting after `limit_s`; a directory that
    cannot be removed (read-only) is left to the next run's manager, which cleans it."""
    deadline = time.monotonic() + limit_s
    for thread in _orbax_threads():
        # Thread's own join: orbax's commit threads override it to re-raise their error.
        threading.Thread.join(thread, max(0.0, deadline - time.monotonic()))
    before, quiet_since = _tmp_state(directory), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = _tmp_state(directory)
        if now != before or now[0]:
            before, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since >= QUIET_S:
            break
    # The failed batch's asyncio tasks are garbage now; collected here, their "exception was
    # never retrieved" records reach the run's log while it is still routed there.
    gc.collect()
    if step is None or not distributed.is_primary():
        return
    for tmp in directory.glob(f"{step}{TMP_SUFFIX}*"):
        while True:
            try:
                shutil.rmtree(tmp)
                break
            except FileNotFoundError:
                break
            except OSError as e:  # ENOTEMPTY: a late write; EROFS/EACCES: nothing to do here
                if e.errno != errno.ENOTEMPTY or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
