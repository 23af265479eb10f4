"""A run's progress: a tqdm bar on a terminal, plain lines for machines off one."""

from __future__ import annotations

import sys
import time
from typing import Any

from scalestudy.config.experiment import ExperimentConfig


def progress_bar(cfg: ExperimentConfig, start: int, stop: int) -> Any:
    """A tqdm bar on a terminal; off one (a CI log, nohup, a SLURM output file) a plain
    line every PLAIN_EVERY_S seconds, since carriage-return updates read as one endless
    line there."""
    if not cfg.train.progress:
        return None
    if not sys.stderr.isatty():
        return PlainProgress(cfg.name, start, stop)
    from tqdm import tqdm

    return tqdm(total=stop, initial=start, desc=cfg.name, unit="step", dynamic_ncols=True)


# Seconds between two plain progress lines off a terminal.
PLAIN_EVERY_S = 30.0


class PlainProgress:
    """Progress as plain lines on stderr (step, loss, tokens/s, ETA) from the metrics rows
    as they are written: at most one every PLAIN_EVERY_S seconds, and the last step's."""

    def __init__(self, name: str, start: int, stop: int) -> None:
        self.name, self.start, self.stop = name, start, stop
        self.t_start = self.t_last = time.monotonic()

    def update(self, n: int) -> None:
        pass  # the rows say how far the run is (tqdm's call)

    def set_postfix(self, **postfix: str) -> None:
        pass  # tqdm's call; the rows carry the same numbers

    def on_row(self, step: int, row: dict[str, Any]) -> None:
        """A metrics row was written (train/rundir/metrics_writer.py's watch): print it when it is
        time."""
        now = time.monotonic()
        if now - self.t_last >= PLAIN_EVERY_S or step >= self.stop:
            self.t_last = now
            sys.stderr.write(self.line(now, step, row) + "\n")
            sys.stderr.flush()

    def line(self, now: float, step: int, row: dict[str, Any]) -> str:
        rate = (step - self.start) / max(now - self.t_start, 1e-9)
        eta_text = "?"
        if rate > 0:
            minutes, seconds = divmod(round((self.stop - step) / rate), 60)
            eta_text = f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}"
        return (
            f"{self.name} step {step}/{self.stop} loss {row['train/loss']:.3f} "
            f"tokens/s {row['tokens_per_s']:.0f} eta {eta_text}"
        )

    def close(self) -> None:
        pass
