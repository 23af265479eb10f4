"""The errors meant for a user: the CLI prints them as one line, without a traceback."""

from __future__ import annotations


class ScalestudyError(Exception):
    """Base of every error meant for the user: the CLI prints it without a traceback."""


class ConfigError(ScalestudyError, ValueError):
    """A config key or value is wrong; the message names the key, value and accepted values."""
