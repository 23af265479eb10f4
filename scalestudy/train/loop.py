"""`train(cfg, workdir)`: build, compile, run, checkpoint, resume; stop on NaN or a signal.

The loop never waits for the device except at log steps (metrics of step t are read after
step t+1 has been dispatched), evaluation and checkpoints. Running totals (tokens,
positions, wall time, best validation loss) are host-side Python numbers saved with the data
iterator state in every checkpoint, so a resumed run continues them exactly.

Faults: a config that changes what the run is is refused before anything is written
(train/resume.py); a write that fails (disk full, unwritable directory) stops the run with one
error naming it, at that save or the next step boundary; SIGTERM/SIGINT save and stop at a
step boundary, on several processes at the same step on every process (JAX's preemption sync
point: the signal reaches any one process, all of them stop at the step after the furthest).
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from scalestudy.config import ExperimentConfig, to_yaml
from scalestudy.data import pipeline
from scalestudy.errors import ScalestudyError
from scalestudy.models import counting
from scalestudy.train import checkpoint, metrics, resume, step

EvalFn = Callable[[Any, Any, int], dict[str, float]]


class NonFiniteLoss(ScalestudyError):
    """The training loss became NaN or infinite."""


class RunDirError(ScalestudyError):
    """The run directory cannot be used or written (a file, read-only, full)."""


class Preempted(ScalestudyError):
    """SIGTERM/SIGINT arrived; a checkpoint was saved and the run can be resumed."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


@contextlib.contextmanager
def _stop_requests(check_every: int) -> Iterator[Callable[[int], int | None]]:
    """`stop(step)`: the signal (SIGTERM/SIGINT) that asks to save and stop after `step`, or
    None. Called at every step boundary with increasing steps.

    One process: a Python handler sets a flag. Several processes: JAX's preemption sync
    manager (started by jax.distributed.initialize) catches SIGTERM on whichever process gets
    it and makes `reached_preemption_sync_point` true on every process at the same step
    (measured ~7 us a call on CPU); SIGINT is turned into SIGTERM for it. Without the
    manager, the processes all-gather the flag every `check_every` steps instead.
    """
    flag: dict[str, int | None] = {"signum": None}
    multi = jax.process_count() > 1
    if threading.current_thread() is not threading.main_thread():
        yield lambda at: None
        return
    from jax._src import distributed
    from jax.experimental import multihost_utils

    manager = multi and distributed.global_state.preemption_sync_manager is not None

    def handler(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and flag["signum"] is not None:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the checkpoint
        flag["signum"] = signum
        if manager and signum != signal.SIGTERM:
            signal.raise_signal(signal.SIGTERM)  # to the manager's own (C++) handler

    def stop(at: int) -> int | None:
        if not multi:
            return flag["signum"]
        if manager:
            return (
                (flag["signum"] or signal.SIGTERM)
                if multihost_utils.reached_preemption_sync_point(at)
                else None
            )
        if at % check_every:
            return None
        flags = multihost_utils.process_allgather(np.int32(flag["signum"] or 0))
        return int(np.max(flags)) or None

    # With the manager, SIGTERM stays with its handler: a Python one would replace it.
    signums = (signal.SIGINT,) if manager else (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.signal(s, handler) for s in signums}
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _prepare_workdir(cfg: ExperimentConfig, workdir: Path, primary: bool) -> None:
    """Refuse a workdir that is a file or holds a different run; record the config."""
    if workdir.exists() and not workdir.is_dir():
        raise RunDirError(f"--workdir {workdir} is a file; give a directory (created when missing)")
    resume.check_resume(cfg, workdir)  # before anything is written
    if jax.process_count() > 1:
        # No process creates the checkpoint directory or config.yaml before every process has
        # looked for them: one that looked later would take another branch and another barrier.
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("scalestudy_workdir_checked")
    workdir.mkdir(parents=True, exist_ok=True)
    if primary:
        tmp = workdir / "config.yaml.tmp"
        tmp.write_text(to_yaml(cfg))
        tmp.replace(workdir / "config.yaml")


def _validate(program: step.Program, params: Any, batches: list[dict]) -> dict[str, float]:
    sums = [program.eval_step(params, b) for b in batches]
    sums = jax.device_get(sums)
    tokens = max(sum(float(s["tokens"]) for s in sums), 1.0)
    return {f"val/{k}": sum(float(s[k]) for s in sums) / tokens for k in ("loss", "ce", "accuracy")}


def _finite(value: float) -> bool:
    return math.isfinite(value)


def _progress_bar(cfg: ExperimentConfig, start: int, stop: int) -> Any:
    if not (cfg.train.progress and sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=stop, initial=start, desc=cfg.name, unit="step", dynamic_ncols=True)


def _restore(
    cfg: ExperimentConfig, ckpt: checkpoint.Checkpointer, program: step.Program
) -> tuple[Any, dict, int] | None:
    """(state, saved data dict, step) from this run, else from `train.init_from`, else None."""
    restored = ckpt.restore(program.abstract_state)
    if restored is None and cfg.train.init_from is not None:
        source = checkpoint.checkpoint_dir(Path(cfg.train.init_from))
        if not source.is_dir():
            raise checkpoint.CheckpointError(
                f"train.init_from={cfg.train.init_from!r}: no checkpoints directory there"
            )
        other = checkpoint.Checkpointer(source, read_only=True)
        restored = other.restore(program.abstract_state, step=cfg.train.init_step)
        if restored is None:
            raise checkpoint.CheckpointError(f"train.init_from: no checkpoint in {source}")
        restored = (restored[0], {**restored[1], "branched": True}, restored[2])
    return restored


def train(cfg: ExperimentConfig, workdir: Path, *, eval_fn: EvalFn | None = None) -> dict[str, Any]:
    """Train (or resume) the run in `workdir`; returns what it writes to summary.json."""
    workdir = Path(workdir)
    try:
        return _train(cfg, workdir, eval_fn)
    except OSError as e:  # a file could not be read or written: one line, checkpoints kept
        latest = None
        with contextlib.suppress(Exception):
            latest = checkpoint.latest_step(workdir)
        kept = f"checkpoints up to step {latest} are intact" if latest else "no checkpoint yet"
        raise RunDirError(
            f"the run in {workdir} stopped on a file error: {e}; {kept}. Free space or fix "
            "permissions, then run the same command again"
        ) from None


def _train(cfg: ExperimentConfig, workdir: Path, eval_fn: EvalFn | None) -> dict[str, Any]:
    t_start = time.perf_counter()
    primary = jax.process_index() == 0  # one writer of run files on multi-host
    _prepare_workdir(cfg, workdir, primary)
    tc = cfg.train
    stop = min(tc.steps, tc.stop_after_steps or tc.steps)

    process = {"process_index": jax.process_index(), "process_count": jax.process_count()}
    train_it = pipeline.make_iterator(cfg, "train", **process)
    val_it = pipeline.make_iterator(cfg, "validation", **process)
    val_batches = [next(val_it) for _ in range(tc.eval_batches)]
    program = step.build_program(cfg, val_batches[0])
    val_batches = [program.shard_batch(b) for b in val_batches]

    ckpt = checkpoint.Checkpointer(
        workdir / checkpoint.CHECKPOINTS,
        keep_last=tc.keep_last,
        keep_every=tc.keep_every,
        async_save=tc.async_checkpoint,
    )
    restored = _restore(cfg, ckpt, program)
    if restored is None:
        state, start = program.init(tc.seed), 0
        totals: dict[str, Any] = {"tokens": 0.0, "positions": 0.0, "wall_time_s": 0.0}
    else:
        state, saved, start = restored
        # A branch on other data or another objective (finetuning, adaptation) starts its
        # own stream; a branch on the same stream (a cooldown) continues it.
        theirs = saved["iterator"].get("fingerprint")
        if not saved.get("branched") or theirs == train_it.state().get("fingerprint"):
            train_it.restore(saved["iterator"])
        totals = saved["totals"]
        previous = workdir / "summary.json"
        if start >= stop and previous.exists():  # already done: at most the eval to add
            ckpt.close()
            summary = json.loads(previous.read_text())
            if eval_fn is not None and not summary.get("eval"):  # on this run's mesh
                summary["eval"] = dict(eval_fn(program.model, state["params"], start))
                if primary:
                    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
            return summary
    if primary:
        metrics.truncate_after(workdir, start)
    tokens0 = totals["tokens"]
    counts = counting.flops(cfg)
    flops_per_step = tc.batch_size * counts["flops_per_example"]
    writer = metrics.MetricsWriter(workdir, active=primary)
    timing = {"compile_s": program.compile_s, "checkpoint_s": 0.0, "eval_s": 0.0}
    last_logged: dict[str, float] = {}
    pending: list[tuple[int, Any]] = []  # (step, device metrics) not yet on the host
    to_log: tuple[int, Any] | None = None
    done = start

    def flush(upto: int) -> None:
        """Bring metrics of steps <= upto to the host: totals always, a row at log steps."""
        nonlocal pending, to_log
        ready = [p for p in pending if p[0] <= upto]
        pending = [p for p in pending if p[0] > upto]
        fetched = jax.device_get([(m["step_tokens"], m["step_positions"]) for _, m in ready])
        for tok, pos in fetched:
            totals["tokens"] += float(tok)
            totals["positions"] += float(pos)
        if to_log is None or to_log[0] > upto:
            return
        s, m = to_log
        to_log = None
        row = {k: float(v) for k, v in jax.device_get(m).items() if not k.startswith("step_")}
        if not _finite(row["train/loss"]):
            nonfinite(row["train/loss"], s)
        elapsed = totals["wall_time_s"] + time.perf_counter() - t_start
        row |= {
            "tokens": totals["tokens"],
            "positions": totals["positions"],
            "flops": s * flops_per_step,
            "wall_time_s": elapsed,
            "tokens_per_s": rate.update(totals["tokens"]),
        }
        last_logged.update(writer.write(s, row))
        if bar is not None:
            bar.set_postfix(loss=f"{row['train/loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")

    def nonfinite(loss: float, at: int) -> None:
        ckpt.wait()
        good = ckpt.latest_step()
        where = f"step {good} in {ckpt.directory}" if good is not None else "none (none saved)"
        raise NonFiniteLoss(
            f"training loss is {loss} at step {at}; stopped without saving. The last good "
            f"checkpoint is {where}. Lower optim.learning_rate, set optim.grad_clip_norm or "
            "add warmup, then re-run to resume from it"
        )

    def save(at: int) -> None:
        flush(at)
        if last_metrics is not None:  # never checkpoint a diverged state
            loss = float(jax.device_get(last_metrics["train/loss"]))
            if not _finite(loss):
                nonfinite(loss, at)
        t = time.perf_counter()  # after the sync above: only the checkpoint's own cost
        data = {
            "iterator": train_it.state(),
            "totals": {**totals, "wall_time_s": totals["wall_time_s"] + t - t_start},
        }
        ckpt.save(at, state, data, cfg)
        timing["checkpoint_s"] += time.perf_counter() - t

    def validation_due(at: int) -> bool:
        return bool(tc.eval_every) and at % tc.eval_every == 0

    def hook_due(at: int) -> bool:
        every = cfg.eval.every_steps
        return eval_fn is not None and bool(every) and at % every == 0

    def eval_due(at: int) -> bool:
        return validation_due(at) or hook_due(at)

    def evaluate(at: int, final: bool) -> dict[str, float]:
        t = time.perf_counter()
        out: dict[str, float] = {}
        if final or validation_due(at):
            out |= _validate(program, state["params"], val_batches)
            best = totals.get("best_val_loss")
            totals["best_val_loss"] = (
                out["val/loss"] if best is None else min(best, out["val/loss"])
            )
        if eval_fn is not None and (final or hook_due(at)):
            out |= {f"eval/{k}": v for k, v in eval_fn(program.model, state["params"], at).items()}
        if out:
            writer.write(at, out)
            last_logged.update(out)
        timing["eval_s"] += time.perf_counter() - t
        return out

    bar = _progress_bar(cfg, start, stop)
    rate = metrics.Throughput()
    last_metrics: Any = None
    t_loop = time.perf_counter()
    aside0 = timing["eval_s"] + timing["checkpoint_s"]  # compile_s is spent before t_loop
    try:
        with _stop_requests(tc.log_every) as stop_requested:
            signum = None
            for done in range(start + 1, stop + 1):
                signum = stop_requested(done - 1)
                if signum is not None:
                    done -= 1
                    break
                ckpt.poll()  # a failed asynchronous save stops the run here, not later
                batch = program.shard_batch(next(train_it))
                state, last_metrics = program.train_step(state, batch)
                pending.append((done, last_metrics))
                if to_log is not None:  # the previous log step's metrics, now this one is queued
                    flush(to_log[0])
                if done % tc.log_every == 0 or done == stop:
                    to_log = (done, last_metrics)
                if bar is not None:
                    bar.update(1)
                if done != stop and eval_due(done):
                    flush(done)
                    evaluate(done, final=False)
                if done % tc.checkpoint_every == 0 and done != stop:
                    save(done)
            else:
                done = stop
            flush(done)
            # Step time only: the loop less evaluation and checkpoint saves inside it (each
            # timed after its flush, so waiting for queued steps still counts as step time).
            aside = timing["eval_s"] + timing["checkpoint_s"] - aside0
            train_time = time.perf_counter() - t_loop - aside
            if signum is not None:
                if done > start:
                    save(done)
                ckpt.wait()
                name = signal.Signals(signum).name
                where = ckpt.latest_step()
                raise Preempted(
                    f"{name} received: "
                    + (
                        f"saved a checkpoint at step {where} in {ckpt.directory}; run the "
                        "same command again to resume"
                        if where is not None
                        else "no step had completed, so there is nothing to resume"
                    ),
                    signum,
                )
            final_eval = evaluate(done, final=True)
            if done > start:
                save(done)
            t = time.perf_counter()
            ckpt.wait()
            timing["checkpoint_s"] += time.perf_counter() - t
    except OSError:  # a run file could not be written; a save that failed first is older news
        ckpt.wait()
        raise
    finally:
        failing = sys.exc_info()[1] is not None
        if bar is not None:
            bar.close()
        try:
            writer.close()
        except OSError:  # flushing onto a full disk: the error on its way says more
            if not failing:
                raise
        ckpt.close()
    totals["wall_time_s"] += time.perf_counter() - t_start
    summary = metrics.run_summary(
        cfg, done, totals, last_logged, final_eval, train_time, start, tokens0
    )
    timing["wall_s"] = time.perf_counter() - t_start  # this invocation
    summary["timing"] = {k: round(v, 3) for k, v in timing.items()}
    summary["timing"]["step_s"] = round(train_time, 6)  # what tokens_per_s and mfu divide by
    if primary:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
