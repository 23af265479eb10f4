"""What happens between train steps, each piece owning its cadence: `Hooks.add_hook(fn,
every=N)` runs `fn(run, step)` at every N-th step. A hook that measures something returns a
dict of metrics; the dicts of one step become one metrics.jsonl row.

The loop's hooks (train/loop.py, `Group`), in the order they run at a step, each for every
member:

- validation: loss, cross-entropy and accuracy on the held-out batches (`val/...`,
  `validation_metrics`), and the best validation loss so far (kept in the run's totals, so
  it survives a resume);
- `ZeroShot`: the zero-shot evaluation function of `train(..., eval_fn=...)` (`eval/...`);
- `CheckpointHook`: brings every queued step's metrics to the host (never checkpointing a
  diverged state), makes metrics.jsonl durable, then saves the train state together with the
  data iterator's state and the run's totals. It never saves one step twice.

A hook's `every` of 0 or None turns it off. The loop skips hooks at the last step: the run's
end evaluates and saves once (`Group.train`, the final hooks).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

from scalestudy.train.rundir import checkpoint

# A hook's `run` is the loop's `Run` or `Group` (train/loop.py); loop.py imports this module,
# so hooks name it here without importing it back.
Run = Any
HookFn = Callable[[Run, int], "dict[str, float] | None"]
EvalFn = Callable[[Any, Any, int], dict[str, float]]


@dataclasses.dataclass(frozen=True)
class Hook:
    """`fn(run, step)` at every `every`-th step."""

    fn: HookFn
    every: int

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0


class Hooks:
    """An ordered list of hooks, each with its cadence."""

    def __init__(self) -> None:
        self._hooks: list[Hook] = []

    def add_hook(self, fn: HookFn, *, every: int | None) -> None:
        """Run `fn(run, step)` at every `every`-th step (never when `every` is 0 or None)."""
        self._hooks.append(Hook(fn, every or 0))

    def due(self, step: int) -> bool:
        return any(h.due(step) for h in self._hooks)

    def each(self, run: Run, step: int, *, force: bool = False) -> Iterator[dict[str, float]]:
        """Run the hooks due at `step` (every one with `force`) in order, yielding the
        metrics of each as it returns (so that a later hook can write them first)."""
        for hook in self._hooks:
            if force or hook.due(step):
                yield hook.fn(run, step) or {}


def validation_metrics(run: Run, sums: list[dict[str, Any]]) -> dict[str, float]:
    """The `val/...` metrics from the eval step's sums over the held-out batches (on the
    host), and the best validation loss so far in the run's totals."""
    tokens = max(sum(float(s["tokens"]) for s in sums), 1.0)
    out = {f"val/{k}": sum(float(s[k]) for s in sums) / tokens for k in ("loss", "ce", "accuracy")}
    best = run.totals.get("best_val_loss")
    run.totals["best_val_loss"] = out["val/loss"] if best is None else min(best, out["val/loss"])
    return out


@dataclasses.dataclass(frozen=True)
class ZeroShot:
    """Zero-shot evaluation of the current parameters with `eval_fn(model, params, step)`."""

    eval_fn: EvalFn

    def __call__(self, run: Run, step: int) -> dict[str, float]:
        t = time.perf_counter()
        scores = self.eval_fn(run.program.model, run.state["params"], step)
        run.timing["eval_s"] += time.perf_counter() - t
        return {f"eval/{k}": v for k, v in scores.items()}


class CheckpointHook:
    """Saves the train state, the data iterator state and the run's totals at its steps."""

    def __init__(self, ckpt: checkpoint.Checkpointer):
        self.ckpt = ckpt
        self.last_saved: int | None = None

    def __call__(self, run: Run, step: int) -> None:
        # Saved already (a stop request on a checkpoint step) or restored from there.
        if self.last_saved is not None and step <= self.last_saved:
            return
        run.flush_to_disk(step)  # every metric up to `step` on the host, checked finite, on disk
        t = time.perf_counter()  # after the sync: only the checkpoint's own cost
        data = {
            "iterator": run.train_it.state(),
            "totals": {**run.totals, "wall_time_s": run.wall_time()},
        }
        self.ckpt.save(step, run.state, data, run.cfg)
        self.last_saved = step
        run.timing["checkpoint_s"] += time.perf_counter() - t
