"""Where a checkpoint save writes, and how a failed one is ended before its error is raised.

When a save fails (disk full, read-only), orbax raises at the first write that failed while
the rest of that save goes on: the commit threads of its other items, and the array writes
tensorstore had started. orbax awaits those writes no more (the event loops that awaited them
are closed), and tensorstore gives no handle on them: some end a moment later, once a
tensorstore thread has run the completion callbacks of the writes before them (Python code,
which under load waits for the interpreter: the next write of the failed save can come well
over a second after the last), others stay parked inside tensorstore and never end. No wait
can tell the late ones from the parked ones, and tensorstore's file driver makes any missing
directory on its way, so a late write recreates the directory it was meant for.

So a failed save is ended by facts, not by a quiet spell:

- its threads are joined (orbax's commit threads and finalizer);
- no file of it is open in this process (a write in progress holds its file and directory);
- its directory is sealed: every save writes into a directory of its own
  (`<checkpoints>/.save-<step>-<token>-<n>/<step>.orbax-checkpoint-tmp`, renamed to
  `<checkpoints>/<step>` once complete), and a failed save's directory is replaced by an
  empty regular file. Whatever tensorstore or a late thread still does for it can only fail
  (no directory can be made below a file): it can neither take space nor reach another save,
  such as the save of the same step by a run resumed in the same process.

The seals of this process stay while it runs (a parked write could wake in it); the first
Checkpointer of a later process removes them, with the directories of saves a crash cut off.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import shutil
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from etils import epath
from orbax.checkpoint.path import atomicity

from scalestudy.train.rundir import logfile
from scalestudy.train.runtime import distributed

# orbax writes step N into `N.orbax-checkpoint-tmp` and renames it once complete.
TMP_SUFFIX = atomicity.TMP_DIR_SUFFIX
# The directory of one save (a file once sealed): `.save-<step>-<token>-<n>`.
SAVE_PREFIX = ".save-"
# A save directory on its way out (renamed there so that its seal can take its place).
_REMOVED = ".removed-"
# Waiting on facts (threads, open files) still ends here, should one never come.
SETTLE_LIMIT_S = 60.0
_POLL_S = 0.05

# Save directories of this process (in flight, or sealed): never removed as stale.
_ours: set[Path] = set()


def save_dir_name(step: int, token: int, n: int) -> str:
    """The name of the directory of save `n` of a Checkpointer (`token`: the same on every
    process of a run, new for each Checkpointer) writing step `step`."""
    return f"{SAVE_PREFIX}{step}-{token:08x}-{n}"


def claim(save_dir: Path) -> None:
    """Record `save_dir` as a save directory of this process (never stale while it runs)."""
    _ours.add(Path(save_dir))


def release(save_dir: Path) -> None:
    """After a complete save: its directory, now empty, is not needed (process 0 removes it)."""
    _ours.discard(Path(save_dir))
    if distributed.is_primary():
        with contextlib.suppress(OSError):
            Path(save_dir).rmdir()


def save_path_class(saves: Mapping[str, Path]) -> type:
    """orbax's temporary path class for a Checkpointer: a step whose final directory is in
    `saves` ({str(final step directory): its save directory}) is written inside that save
    directory; anything else (the items inside a step, paths outside a save) where orbax
    writes it by default."""

    class SavePath(atomicity.AtomicRenameTemporaryPath):
        @classmethod
        def from_final(cls, final_path: Any, **kwargs: Any) -> Any:
            save_dir = saves.get(str(Path(final_path)))
            if save_dir is None:
                return super().from_final(final_path, **kwargs)
            final_path = epath.Path(final_path)
            return cls(epath.Path(save_dir) / (final_path.name + TMP_SUFFIX), final_path, **kwargs)

    return SavePath


def unfinished_saves(directory: Path) -> list[Path]:
    """Directories of saves under the checkpoint `directory` that never completed (a seal is
    a file, not one of them)."""
    if not directory.is_dir():
        return []
    return sorted(
        p
        for p in directory.iterdir()
        if p.is_dir() and (TMP_SUFFIX in p.name or p.name.startswith(SAVE_PREFIX))
    )


def remove_stale_saves(directory: Path) -> None:
    """Remove what saves of earlier processes left under `directory`: seals, and directories
    of saves a crash cut off (process 0; what cannot be removed, on a read-only disk, stays)."""
    if not distributed.is_primary() or not directory.is_dir():
        return
    for path in directory.glob(f"{SAVE_PREFIX}*"):
        if path in _ours:
            continue
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


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


def settle_failed_save(
    directory: Path, save_dir: Path | None, step: int | None, limit_s: float = SETTLE_LIMIT_S
) -> None:
    """End a failed save in this process: join orbax's save threads, wait until no file of
    the save is open (in its save directory `save_dir`, or in a temporary directory orbax
    made directly under the checkpoint `directory`), then seal `save_dir` and remove step
    `step`'s temporary directories (process 0 only: the other processes' writes are their
    own, and fail once the seal is in place). The waits end after `limit_s` at the latest;
    on a read-only disk nothing can be sealed or removed (nor written)."""
    deadline = time.monotonic() + limit_s
    for thread in _orbax_threads():
        # Thread's own join: orbax's commit threads override it to re-raise their error.
        threading.Thread.join(thread, max(0.0, deadline - time.monotonic()))
    places = [*([save_dir] if save_dir is not None else []), *directory.glob(f"*{TMP_SUFFIX}*")]
    while any(open_files_under(p) for p in places) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    # The failed batch's asyncio tasks are garbage now; collected here, their "exception was
    # never retrieved" records reach the run's log while it is still routed there.
    gc.collect()
    logfile.expect_late_records()
    if not distributed.is_primary():
        return
    if save_dir is not None and not seal(save_dir, deadline):
        _remove(save_dir, deadline)
    if step is not None:
        for tmp in directory.glob(f"{step}{TMP_SUFFIX}*"):
            _remove(tmp, deadline)


def seal(save_dir: Path, deadline: float | None = None) -> bool:
    """Replace the directory `save_dir` by an empty regular file, so that nothing can be
    written below its path again; what it held is removed. False when no file can be made
    there (a read-only disk)."""
    save_dir = Path(save_dir)
    deadline = time.monotonic() + SETTLE_LIMIT_S if deadline is None else deadline
    n = 0
    while time.monotonic() <= deadline:
        try:
            os.close(os.open(save_dir, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            break
        except FileExistsError:
            if save_dir.is_file():
                break
        except OSError:
            return False
        # Put the directory aside; a late write may make it again before the seal is in
        # place, then this goes round once more.
        aside = save_dir.with_name(f"{save_dir.name}{_REMOVED}{n}")
        n += 1
        try:
            os.rename(save_dir, aside)
        except FileNotFoundError:
            pass
        except OSError:
            return False
    _ours.add(save_dir)
    for aside in save_dir.parent.glob(f"{save_dir.name}{_REMOVED}*"):
        _remove(aside, deadline)
    return save_dir.is_file()


def _remove(path: Path, deadline: float) -> None:
    """Remove the directory `path` (ENOTEMPTY: a file made meanwhile, so again until the
    deadline; read-only or not permitted: left as it is)."""
    while True:
        try:
            shutil.rmtree(path)
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.ENOTEMPTY or time.monotonic() > deadline:
                return
            time.sleep(_POLL_S)
