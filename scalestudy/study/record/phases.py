"""The lines a study's log records as each of its phases starts and ends (`phase`): where a
long study is, read back from a CI log or a SLURM output file."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def phase(name: str, plain: bool | None = None) -> Iterator[None]:
    """One line as a phase of a study (learning-rate search, pretraining, experiments, stages,
    fits, report) starts and one as it ends, when `plain` (default: stderr is not a
    terminal): a CI log or a SLURM output file shows where a long study is. On a terminal the
    bar says it; a phase that raises says it did not finish (the error follows)."""
    if not (not sys.stderr.isatty() if plain is None else plain):
        yield
        return
    print(f"study: {name} started", flush=True)
    began = time.monotonic()
    try:
        yield
    except BaseException:
        print(f"study: {name} did not finish ({time.monotonic() - began:.1f}s)", flush=True)
        raise
    print(f"study: {name} finished ({time.monotonic() - began:.1f}s)", flush=True)
