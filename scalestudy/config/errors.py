"""The errors meant for a user: the CLI prints them as one line, without a traceback."""

from __future__ import annotations

import os
import stat
from pathlib import Path


class ScalestudyError(Exception):
    """Base of every error meant for the user: the CLI prints it without a traceback."""


class ConfigError(ScalestudyError, ValueError):
    """A config key or value is wrong; the message names the key, value and accepted values."""


class PathError(ScalestudyError, ValueError):
    """A path given to a command is of the wrong kind, missing, too long or not writable."""


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISREG, "a file"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def path_kind(path: str | os.PathLike) -> str:
    """What is at `path`, in words for a message: "a directory", "a file", "a named pipe", ...,
    "a link to nothing", or "nothing"."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a link to nothing" if os.path.islink(path) else "nothing"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    return next((word for test, word in _KINDS if test(mode)), "not a file")


def not_found(path: str | os.PathLike, what: str, expected: str = "a file") -> str:
    """The message for `what` at `path` that is not there: "not found" when nothing is, else
    the kind found and the kind expected (a directory where a file is meant, a pipe, ...)."""
    kind = path_kind(path)
    if kind == "nothing":
        return f"{what} not found: {path}"
    return f"{what} {path} is {kind}; expected {expected}"


def _too_long(path: Path) -> str | None:
    """Why `path` is longer than the file system takes (a name past NAME_MAX, the whole past
    PATH_MAX), or None: an OSError (errno 36) deep inside the work would say it later."""
    existing = next((p for p in path.parents if os.path.isdir(p)), Path("."))
    try:
        name_max = os.pathconf(existing, "PC_NAME_MAX")
        path_max = os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    for part in path.parts:
        if len(os.fsencode(part)) > name_max:
            return f"has a name of {len(os.fsencode(part))} bytes; the file system takes {name_max}"
    if len(os.fsencode(str(path.absolute()))) >= path_max:
        return f"is longer than the file system takes ({path_max} bytes)"
    return None


def checked_path(
    text: str | os.PathLike,
    flag: str,
    expect: str,
    *,
    must_exist: bool = False,
    parent_must_exist: bool = False,
    writable: bool = False,
) -> Path:
    """Every path a command takes, checked for kind before any work: not empty, not too long,
    no link to nothing, under no file, `expect` (words ending in "file" or "directory")
    where something is, there when `must_exist`, its folder there when `parent_must_exist`,
    and (`writable`) its nearest existing folder writable. One `PathError` naming the
    flag otherwise."""
    if not str(text).strip():
        raise PathError(f"{flag} is empty; give {expect}")
    path = Path(text)
    if (why := _too_long(path)) is not None:
        raise PathError(f"{flag} {shown_path(path)} {why}; give a shorter path")
    for p in (path, *path.parents):
        if os.path.islink(p) and not p.exists():
            where = "" if p == path else f" (in {path})"
            raise PathError(
                f"{flag} {path}: {p} is a link to nothing (-> {os.readlink(p)}){where}; "
                f"give {expect}, or make the link's target first"
            )
    for p in path.parents:
        if p.exists() and not p.is_dir():
            raise PathError(
                f"{flag} {path}: {p} is {path_kind(p)}, so nothing can be under it; give "
                f"{expect} in a directory"
            )
    wanted = Path.is_dir if expect.endswith("directory") else Path.is_file
    if path.exists() and not wanted(path):
        raise PathError(f"{flag} {path} is {path_kind(path)}; expected {expect}")
    if must_exist and not path.exists():
        raise PathError(f"{flag} {path}: not found; give {expect} that exists")
    if parent_must_exist and not path.parent.exists():
        raise PathError(f"{flag} {path}: its folder {path.parent} does not exist; create it first")
    if writable:
        existing = next(p for p in (path, *path.parents) if p.exists() or p == Path(p.anchor))
        if not os.access(existing, os.W_OK):
            raise PathError(f"{flag} {path}: {existing} is not writable")
    return path


def shown_path(path: Path, limit: int = 80) -> str:
    """A path for an error line, its middle cut when long (a name of 300 bytes is not read)."""
    text = str(path)
    return text if len(text) <= limit else f"{text[: limit // 2]}...{text[-limit // 2 :]}"
