"""The study-wide progress bar: how far a study's training has gone, fed by the running runs'
metrics.jsonl (polled in a thread, so the trainer needs no callback)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

from scalestudy.train.rundir import layout as rundir


class StudyProgress:
    """A study-wide progress bar fed by the running run's metrics.jsonl (polled in a thread,
    so the trainer needs no callback). Each run weighs half an equal share (fixed costs:
    compilation, evaluation) and half its share of the study's training FLOPs."""

    def __init__(self, total: float, n_runs: int, plain: bool | None = None) -> None:
        """`plain` (default: stderr is not a terminal): one line per finished run instead of
        a bar, whose carriage-return updates would glue a log file's lines together."""
        from tqdm import tqdm

        self.plain = not sys.stderr.isatty() if plain is None else plain
        if self.plain:
            self.bar: Any = PlainBar()
        else:
            self.bar = tqdm(total=100.0, unit="%", bar_format=_BAR, dynamic_ncols=True)
        self.total = total
        self.done = 0.0
        self.n_runs = n_runs
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, index: int, name: str, workdir: Path, weight: float, steps: int) -> None:
        self.bar.set_description(f"[{index}/{self.n_runs}] {name}")
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._poll, args=(rundir.metrics_path(workdir), weight, steps), daemon=True
        )
        self._thread.start()

    def _poll(self, path: Path, weight: float, steps: int) -> None:
        while not self._stop.wait(1.0):
            recs = rundir.read_metrics_file(path)
            if recs:
                last = recs[-1]
                frac = min(1.0, float(last.get("step", 0)) / max(steps, 1))
                self._set(self.done + frac * weight)
                if "train/loss" in last:
                    self.bar.set_postfix_str(f"loss {last['train/loss']:.3f}")

    def _set(self, value: float) -> None:
        self.bar.n = round(100.0 * value / self.total, 2)
        self.bar.refresh()

    def end(self, weight: float) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.done += weight
        self._set(self.done)
        # A job with nothing left to train ends without a start (a worker pool's queue):
        # only a run named since the last line is announced.
        if self.plain and self.bar.desc:
            self.bar.write(
                f"{self.bar.desc} finished: study {100.0 * self.done / self.total:.1f}% done"
            )
            self.bar.desc = ""

    def close(self) -> None:
        self.bar.close()


class PlainBar:
    """The part of tqdm's bar the study uses, printing only what `write` is given, each on a
    line of its own (off a terminal)."""

    def __init__(self) -> None:
        self.n = 0.0
        self.desc = ""
        self.postfix = ""

    def set_description(self, desc: str) -> None:
        self.desc = desc

    def set_postfix_str(self, postfix: str) -> None:
        self.postfix = postfix

    def refresh(self) -> None:
        pass

    def write(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        pass


_BAR = "{desc} {percentage:5.1f}%|{bar}| [{elapsed}<{remaining}] {postfix}"
