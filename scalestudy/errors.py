"""The errors meant for a user: the CLI prints them as one line, without a traceback."""

from __future__ import annotations

import os
import stat


class ScalestudyError(Exception):
    """Base of every error meant for the user: the CLI prints it without a traceback."""


class ConfigError(ScalestudyError, ValueError):
    """A config key or value is wrong; the message names the key, value and accepted values."""


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
