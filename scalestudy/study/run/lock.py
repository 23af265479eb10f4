"""The study lock: one process per study directory.

A study directory holds one registry and the run directories; two processes training there
would train every run twice and collide on checkpoint files, so `scalestudy study` holds
`<out>/study.lock` while it runs.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from scalestudy.config.errors import ScalestudyError

LOCK_NAME = "study.lock"


class StudyLockError(ScalestudyError):
    """Another process is running the same study directory."""


@contextmanager
def study_lock(out: str | Path) -> Iterator[dict[str, Any]]:
    """Hold `<out>/study.lock` while a study runs there; yields the holder record.

    The lock is an flock on the file (released by the kernel when the holder dies, however it
    dies) plus a record naming the holder (pid, host, start time). A second process refuses,
    naming the holder. A lock left by a dead process on this host is taken over. A record
    left by another host, whose liveness cannot be checked from here, is refused: the message
    says which file to delete once that job is known to be gone. Released: the record is
    emptied (the file stays, so no process can lock a file that another just unlinked).
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise StudyLockError(f"--out {out} is a file; give a directory (created when missing)")
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        text = ""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            text = path.read_text(errors="replace").strip()
            raise StudyLockError(_held_message(out, path, text)) from None
        text = path.read_text(errors="replace").strip()
        if text:  # a record without a live flock: the holder is gone, or on another host
            try:
                holder = json.loads(text)
            except json.JSONDecodeError:
                holder = {}
            here = socket.gethostname()
            # On this host the free flock proves the holder dead: take the lock over.
            if holder.get("host", here) != here:
                raise StudyLockError(
                    _held_message(out, path, text)
                    + f". It cannot be checked from {here}: once that job is gone, delete {path}"
                )
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "started_at": time.time(),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        try:
            yield {**me, "took_over": json.loads(text) if text.startswith("{") else None}
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the flock


def _held_message(out: Path, path: Path, text: str) -> str:
    try:
        h = json.loads(text)
        who = f"pid {h['pid']} on {h['host']}, started {h['started']}"
    except (json.JSONDecodeError, KeyError, TypeError):
        who = f"a process that left no record in {path}"
    return (
        f"the study directory {out} is in use by {who}; two processes on one directory would "
        "train every run twice and collide on checkpoint files. Wait for it to finish (or "
        "stop it), or use another --out"
    )
