"""`train(cfg, workdir)`: build, compile, run, checkpoint, resume; stop on NaN or a signal.

The loop never waits for the device except at log steps (metrics of step t are read after
step t+1 is dispatched), evaluation and checkpoints. Running totals (tokens, positions, wall
time, best validation loss) are host-side numbers saved with the data iterator state in every
checkpoint, so a resumed run continues them exactly.

Faults: a config that changes the run is refused before anything is written
(train/rundir/resume_check.py); a failed write (disk full, unwritable directory) stops the run with
one error naming it, at that save or the next step boundary; SIGTERM/SIGINT save and stop at a step
boundary, on several processes at the same step (JAX's preemption sync point: the step after the
furthest).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scalestudy.config.errors import ScalestudyError, path_kind
from scalestudy.config.experiment import ExperimentConfig, to_yaml
from scalestudy.data import pipeline
from scalestudy.models import counting
from scalestudy.train import datasheets, expert_load, hooks, progress_bar, sharding, step
from scalestudy.train.rundir import (
    checkpoint,
    checkpoint_recovery,
    logfile,
    metrics_writer,
    resume_check,
    saved_run,
)
from scalestudy.train.rundir import layout as rundir
from scalestudy.train.rundir.summary import run_summary
from scalestudy.train.runtime import distributed

EvalFn = hooks.EvalFn


class NonFiniteLoss(ScalestudyError):
    """The training loss became NaN or infinite."""


class RunDirError(ScalestudyError):
    """The run directory cannot be used or written (a file, read-only, full)."""


class Preempted(ScalestudyError):
    """SIGTERM/SIGINT arrived; a checkpoint was saved and the run can be resumed."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


def _prepare_workdir(cfg: ExperimentConfig, workdir: Path, primary: bool) -> None:
    """Refuse a workdir that holds a different run; record the config."""
    resume_check.check_resume(cfg, workdir)  # before anything is written
    logfile.run_accepted()  # the run's log, held until here, is written from now on
    # No process creates the checkpoint directory or config.yaml before every process has
    # looked for them: one that looked later would take another branch and another barrier.
    distributed.barrier("scalestudy_workdir_checked")
    if primary:
        rundir.write_config(workdir, to_yaml(cfg))


def train(cfg: ExperimentConfig, workdir: Path, *, eval_fn: EvalFn | None = None) -> dict[str, Any]:
    """Train (or resume) the run in `workdir`; returns what it writes to summary.json."""
    workdir = Path(workdir)
    if workdir.exists() and not workdir.is_dir():
        raise RunDirError(f"--workdir {workdir} is {path_kind(workdir)}; give a directory")
    sharding.check_host_batch(cfg, distributed.process_layout()[1])
    datasheets.check_params_fit(cfg)
    before = rundir.entries(workdir)
    try:
        with claim(workdir):
            return _train(cfg, workdir, eval_fn)
    except ScalestudyError as e:  # refused (a config the data, vocabulary or init_from reject)
        if distributed.is_primary() and not isinstance(e, Preempted):
            rundir.undo_start(workdir, before)
        raise
    except OSError as e:  # a file could not be read or written: one line, checkpoints kept
        latest = None
        # orbax's notes on opening them read-only go nowhere: the log may be what failed
        with contextlib.suppress(Exception), logfile.library_logs_dropped():
            latest = saved_run.latest_step(workdir)
        kept = f"checkpoints up to step {latest} are intact" if latest else "no checkpoint yet"
        raise RunDirError(
            f"the run in {workdir} stopped on a file error: {e}; {kept}. Free space or fix "
            "permissions, then run the same command again"
        ) from None


@contextlib.contextmanager
def claim(workdir: Path) -> Iterator[None]:
    """The run directory, created, locked by the primary process (a second `train` on it is
    refused naming the holder) and receiving the libraries' log output.

    Only the primary, the one writer of run files, takes the lock: a second job is refused
    through its own primary, and every process of that job stops with it (the others would
    otherwise wait for it in their next collective)."""
    workdir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        refused: rundir.RunLockError | None = None
        if distributed.is_primary():
            try:
                stack.enter_context(rundir.run_lock(workdir))
            except rundir.RunLockError as e:
                refused = e
        if not distributed.agreed(int(refused is None)):
            raise refused or rundir.RunLockError(
                f"the run directory {workdir} is in use by another job: process 0 of this "
                "job was refused its lock (it names the holder)"
            )
        stack.enter_context(logfile.library_logs_to_file(workdir))
        yield


class Run:
    """A run in progress: its compiled program, train state, data, and the host-side tallies
    (tokens, positions, wall time, best validation loss) that checkpoints carry along.

    With `build=False` the run has no program of its own: it is a member of a group, whose
    program trains it (train/group.py); `val_host` keeps its validation batches."""

    def __init__(
        self, cfg: ExperimentConfig, workdir: Path, eval_fn: EvalFn | None, *, build: bool = True
    ):
        self.t_start = time.perf_counter()
        self.cfg, self.workdir = cfg, workdir
        self.primary = distributed.is_primary()  # one writer of run files on multi-host
        _prepare_workdir(cfg, workdir, self.primary)
        tc = cfg.train
        self.stop = min(tc.steps, tc.stop_after_steps or tc.steps)
        index, count = distributed.process_layout()
        self.processes = count
        self.train_it = pipeline.make_iterator(
            cfg, "train", process_index=index, process_count=count
        )
        val_it = pipeline.make_iterator(cfg, "validation", process_index=index, process_count=count)
        self.val_host = [next(val_it) for _ in range(tc.eval_batches)]
        if build:
            self.program = step.build_program(cfg, self.val_host[0])
            self.val_batches = [self.program.shard_batch(b) for b in self.val_host]
        self.ckpt = checkpoint.Checkpointer(
            rundir.checkpoints_dir(workdir),
            keep_last=tc.keep_last,
            keep_every=tc.keep_every,
            async_save=tc.async_checkpoint,
        )
        compile_s = self.program.compile_s if build else 0.0
        self.timing = {"compile_s": compile_s, "checkpoint_s": 0.0, "eval_s": 0.0}
        self.eval_fn = eval_fn
        self.row: dict[str, Any] = {}  # the hooks' metrics of the current step, not yet written
        self.member_index: int | None = None  # a group's member: its index on the member axis

    def start_from(self, restored: tuple[Any, dict, int] | None, own: bool) -> None:
        """Take the restored (state, data state, step) (`own`: from this run's checkpoints,
        not `train.init_from`), or initialise at step 0."""
        self.resumed = restored is not None and own
        if restored is None:
            self.state, self.start = self.fresh_state(), 0
            self.totals: dict[str, Any] = {"tokens": 0.0, "positions": 0.0, "wall_time_s": 0.0}
        else:
            self.state, data_state, self.start = restored
            # A branch on other data or another objective (finetuning, adaptation) starts its
            # own stream; a resume, or a branch on the same stream (a cooldown), continues it.
            theirs = data_state["iterator"].get("fingerprint")
            if own or theirs == self.train_it.state().get("fingerprint"):
                self.train_it.restore(data_state["iterator"])
            self.totals = data_state["totals"]
        self.tokens0 = self.totals["tokens"]
        self.totals.setdefault("document_tokens", None if self.start else 0.0)
        self.documents = 0  # this process's document tokens not yet in the totals

    def fresh_state(self) -> Any:
        """The state of step 0, from the run's seed."""
        return self.program.init(self.cfg.train.seed)

    def open_writers(self) -> None:
        """Metrics files, deferred metrics, hooks and progress bar for steps after `start`."""
        if self.primary:
            rundir.truncate_metrics_after(self.workdir, self.start)
            if self.resumed:
                checkpoint_recovery.warn_missing_rows(
                    self.workdir, self.start, self.totals.get("train_rows")
                )
        self.writer = metrics_writer.MetricsWriter(self.workdir, active=self.primary)
        per_step = self.cfg.train.batch_size * counting.flops(self.cfg)["flops_per_example"]
        moe = self.cfg.model.moe
        self.bar = progress_bar.progress_bar(self.cfg, self.start, self.stop)
        watchers = []
        if expert_load.watched(moe) and self.primary:
            watchers.append(expert_load.LoadWatch(moe, self.totals))
        if isinstance(self.bar, progress_bar.PlainProgress):
            watchers.append(self.bar.on_row)
        self.metrics = metrics_writer.DeferredMetrics(
            self.writer,
            self.totals,
            per_step,
            self.wall_time,
            self.member_index,
            watch=metrics_writer.each(watchers),
        )
        self.checkpointer = hooks.CheckpointHook(self.ckpt)
        self.checkpointer.last_saved = self.start
        self.hooks = hooks.Hooks()
        self.hooks.add_hook(hooks.validate, every=self.cfg.train.eval_every)
        if self.eval_fn is not None:
            self.hooks.add_hook(hooks.ZeroShot(self.eval_fn), every=self.cfg.eval.every_steps)
        self.hooks.add_hook(self.checkpointer, every=self.cfg.train.checkpoint_every)

    def wall_time(self) -> float:
        """Seconds this run has taken over all its invocations, up to now."""
        return self.totals["wall_time_s"] + time.perf_counter() - self.t_start

    def steps_in_call(self, t: int) -> int:
        """Steps from `t` to run in one call: train.steps_per_call when none of them but the
        last is a log step, a hook's step or the stop (on one process), else 1."""
        k, every = self.program.steps_per_call, self.cfg.train.log_every
        if k == 1 or t + k - 1 > self.stop or self.processes > 1:
            return 1  # several processes: JAX's preemption sync point is checked every step
        inner = range(t, t + k - 1)
        return 1 if any(s % every == 0 or self.hooks.due(s) for s in inner) else k

    def dispatch(self, t: int, n: int = 1) -> None:
        """Start steps `t .. t + n - 1` on the device in one call; write the previous log
        step's row."""
        batches = []
        for _ in range(n):
            batches.append(next(self.train_it))
            self.documents += self.train_it.last_document_tokens
        if n == 1:
            batch = self.program.shard_batch(batches[0])
            self.state, step_metrics = self.program.train_step(self.state, batch)
        else:
            stacked = self.program.shard_batches(batches)
            self.state, step_metrics = self.program.multi_step(self.state, stacked)
        t += n - 1
        log = t % self.cfg.train.log_every == 0 or t == self.stop
        row = self.metrics.push(t, step_metrics, log=log)
        if self.bar is not None:
            self.bar.update(n)
            if row is not None:
                self.bar.set_postfix(
                    loss=f"{row['train/loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}"
                )

    def run_hooks(self, t: int, *, force: bool = False) -> dict[str, Any]:
        """The hooks due at step `t` (all with `force`), after step `t`'s metrics; returns
        the metrics they measured (one metrics.jsonl row)."""
        self.metrics.flush(t)
        measured: dict[str, Any] = {}
        for hook_metrics in self.hooks.each(self, t, force=force):
            self.row |= hook_metrics
            measured |= hook_metrics
        self.write_row(t)
        return measured

    def write_row(self, t: int) -> None:
        if self.row:
            self.metrics.write(t, self.row)
            self.row = {}

    def sync(self, t: int) -> None:
        """Every metric of steps up to `t` on the host and checked finite, and on disk."""
        self.metrics.flush(t)
        self.metrics.check_last(t)
        self.write_row(t)
        self.writer.sync()
        self.count_documents()

    def count_documents(self) -> None:
        """Add every process's document tokens read since the last call to the totals (a
        collective: called at the same steps on every process)."""
        read = distributed.total(self.documents)
        self.documents = 0
        if (
            self.totals["document_tokens"] is not None
        ):  # None: resumed from a run that did not count
            self.totals["document_tokens"] += read

    def close(self, failing: bool) -> None:
        if self.bar is not None:
            self.bar.close()
        try:
            self.writer.close()
        except OSError:  # flushing onto a full disk: the error on its way says more
            if not failing:
                raise
        self.ckpt.close()


def _train(cfg: ExperimentConfig, workdir: Path, eval_fn: EvalFn | None) -> dict[str, Any]:
    run = Run(cfg, workdir, eval_fn)
    run.start_from(*checkpoint_recovery.restore_run(cfg, run.ckpt, run.program.abstract_state))
    finished = rundir.read_summary(workdir)
    if run.start >= run.stop and finished is not None:  # already done: at most the eval to add
        run.ckpt.close()
        return add_evaluation(run, finished)
    run.open_writers()
    try:
        with distributed.stop_requests(cfg.train.log_every) as stop_requested:
            done, signum, train_time = _loop(run, stop_requested)
            if signum is not None:
                raise_preempted(run, done, signum)
            final_eval = run.run_hooks(done, force=True)  # evaluation, then the last save
            t = time.perf_counter()
            run.ckpt.wait()
            run.timing["checkpoint_s"] += time.perf_counter() - t
    except metrics_writer.NonFiniteMetric as e:
        raise_nonfinite(run, e)
    except OSError:  # a run file could not be written; a save that failed first is older news
        run.ckpt.wait()
        raise
    finally:
        run.close(failing=sys.exc_info()[1] is not None)
    return summarise(run, done, train_time, final_eval)


def _loop(run: Run, stop_requested: Any) -> tuple[int, int | None, float]:
    """Steps `start + 1 .. stop`: dispatch step t (metrics of t-1 read meanwhile), then the
    hooks due at t. Returns (last step done, the signal that stopped it or None, seconds of
    train steps: the loop less the hooks inside it)."""
    t_loop = time.perf_counter()
    aside0 = run.timing["eval_s"] + run.timing["checkpoint_s"]
    done, signum = run.stop, None
    t = run.start + 1
    while t <= run.stop:
        signum = stop_requested(t - 1)
        if signum is not None:
            done = t - 1
            break
        run.ckpt.poll()  # a failed asynchronous save stops the run here, not later
        n = run.steps_in_call(t)
        run.dispatch(t, n)
        t += n
        if t - 1 != run.stop and run.hooks.due(t - 1):
            run.run_hooks(t - 1)
    run.metrics.flush(done)
    aside = run.timing["eval_s"] + run.timing["checkpoint_s"] - aside0
    return done, signum, time.perf_counter() - t_loop - aside


def raise_preempted(run: Run, done: int, signum: int) -> None:
    """Save step `done` (once) and stop with Preempted."""
    run.checkpointer(run, done)
    run.ckpt.wait()
    where = run.ckpt.latest_step()
    raise Preempted(
        f"{signal.Signals(signum).name} received: "
        + (
            f"saved a checkpoint at step {where} in {run.ckpt.directory}; run the same command "
            "again to resume"
            if where is not None
            else "no step had completed, so there is nothing to resume"
        ),
        signum,
    )


def raise_nonfinite(run: Run, e: metrics_writer.NonFiniteMetric) -> None:
    run.ckpt.wait()
    if run.resumed and run.checkpointer.last_saved == run.start:
        # No checkpoint since the restore: the restored state is the likelier culprit.
        where = run.ckpt.directory / str(run.start)
        raise NonFiniteLoss(
            f"training loss is {e.loss} at step {e.step}, before any checkpoint since resuming "
            f"from the one of step {run.start} ({where}): that checkpoint is suspect (damaged "
            f"on disk, or saved from a diverging state). Move it into "
            f"{rundir.corrupt_dir(run.workdir)} and run the same command again to resume from "
            "the one before it"
        ) from None
    good = run.ckpt.latest_step()
    where = f"step {good} in {run.ckpt.directory}" if good is not None else "none (none saved)"
    raise NonFiniteLoss(
        f"training loss is {e.loss} at step {e.step}; stopped without saving. The last good "
        f"checkpoint is {where}. Lower optim.learning_rate, set optim.grad_clip_norm or "
        "add warmup, then re-run to resume from it"
    ) from None


def summarise(run: Run, done: int, train_time: float, final_eval: dict) -> dict[str, Any]:
    run.count_documents()
    run.totals["wall_time_s"] += time.perf_counter() - run.t_start
    summary = run_summary(
        run.cfg,
        done,
        run.totals,
        run.metrics.logged,
        final_eval,
        train_time,
        run.start,
        run.tokens0,
    )
    run.timing["wall_s"] = time.perf_counter() - run.t_start  # this invocation
    summary["timing"] = {k: round(v, 3) for k, v in run.timing.items()}
    summary["timing"]["step_s"] = round(train_time, 6)  # what tokens_per_s and mfu divide by
    if run.primary:
        rundir.write_summary(run.workdir, summary)
    return summary


def add_evaluation(run: Run, summary: dict[str, Any]) -> dict[str, Any]:
    """A finished run: add the zero-shot evaluation when asked for and missing (on this
    run's mesh)."""
    if run.eval_fn is not None and not summary.get("eval"):
        summary["eval"] = dict(run.eval_fn(run.program.model, run.state["params"], run.start))
        if run.primary:
            rundir.write_summary(run.workdir, summary)
    return summary
