"""Library log output of a run goes to `<workdir>/train.log`, not the terminal: the user's
terminal shows the run's own lines (progress, the one error line), while TensorFlow, absl,
orbax, JAX and asyncio messages (including tracebacks that background threads log before
the error reaches the loop) stay available in the file."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from scalestudy.train import rundir

# Loggers of the libraries under the loop; their records would otherwise reach the terminal.
LIBRARY_LOGGERS = ("absl", "orbax", "asyncio", "tensorflow", "jax", "etils", "tensorstore")


@contextlib.contextmanager
def library_logs_to_file(workdir: str | Path) -> Iterator[Path]:
    """Send the library loggers' records to the run's log file while the block runs."""
    path = rundir.log_path(workdir)
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    before = {}
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        before[name] = logger.propagate
        logger.addHandler(handler)
        logger.propagate = False
    try:
        yield path
    finally:
        for name, propagate in before.items():
            logger = logging.getLogger(name)
            logger.removeHandler(handler)
            logger.propagate = propagate
        handler.close()
