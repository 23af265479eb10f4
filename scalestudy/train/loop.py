"""One training loop for K >= 1 members: `train(cfg, workdir)` is a group of one.

`train_group(cfgs, workdirs)` trains runs of one shape as the members of one compiled program
(train/program.py; which runs may be members: train/members.py). The loop dispatches step t,
reads step t-1's metrics meanwhile, and runs the hooks due at t (train/hooks.py). It never
waits for the device except at log steps, evaluation and checkpoints.

Each member is a `Run`: its run directory, data iterator, metrics writers, checkpoints, and the
host-side totals (tokens, positions, wall time, best validation loss) saved with the data
iterator state in every checkpoint, so a resumed run continues them exactly. Its train state
is its slot of the group's state; a run alone has no member axis and its program is the single
run's. A checkpoint does not know whether a group wrote it: a member can resume alone and a
run trained alone can resume in a group.

Faults: a config that changes the run is refused before anything is written
(train/rundir/resume_check.py); a failed write (disk full, unwritable directory) stops the
loop with one error naming it, at that save or the next step boundary; SIGTERM/SIGINT save
every member at one step and stop (Preempted), on several processes at the same step (JAX's
preemption sync point: the step after the furthest); the same command resumes. A member whose
loss is not finite stops alone (a run alone stops with NonFiniteLoss): its last good checkpoint
is kept, its error names it, the others go on.

Members whose checkpoints stand at different steps (a member's directory deleted, its newest
checkpoint set aside as damaged) resume in their one group: the group starts from the earliest
member's step, and a member ahead of it waits until the group reaches its step, then joins;
its losses then equal the uninterrupted group's bit for bit (docs/faults.md).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax

from scalestudy.config.errors import ConfigError, ScalestudyError, path_kind
from scalestudy.config.experiment import ExperimentConfig, to_yaml
from scalestudy.data import pipeline
from scalestudy.models import counting
from scalestudy.train import datasheets, expert_load, hooks, members, progress_bar, sharding
from scalestudy.train.program import Program, build_program
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
Result = dict[str, Any] | Exception  # a member's summary, or why it stopped alone


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
    """Train (or resume) the run in `workdir`, a group of one; returns what it writes to
    summary.json."""
    (summary,) = train_group([cfg], [workdir], [eval_fn])
    return summary


def train_group(
    cfgs: Sequence[ExperimentConfig],
    workdirs: Sequence[str | Path],
    eval_fns: Sequence[EvalFn | None] | None = None,
) -> list[Result]:
    """Train (or resume) the runs `cfgs` in `workdirs` as members of one program; returns each
    member's summary, or (in a group of several) the exception that stopped it alone (a
    non-finite loss). A run alone raises it.

    Nothing is written before every member's directory has been checked against its config."""
    cfgs, workdirs = list(cfgs), [Path(w) for w in workdirs]
    eval_fns = list(eval_fns) if eval_fns is not None else [None] * len(cfgs)
    if not (len(cfgs) == len(workdirs) == len(eval_fns)):
        raise ValueError("train_group: one workdir and one eval_fn per config")
    _check_before_writing(cfgs, workdirs)
    before = [rundir.entries(w) for w in workdirs]
    try:
        with contextlib.ExitStack() as stack:
            for workdir in workdirs:
                stack.enter_context(claim_workdir(workdir))
            return Group(cfgs, workdirs, eval_fns).train()
    except ScalestudyError as e:  # refused (a config the data, vocabulary or init_from reject)
        if distributed.is_primary() and not isinstance(e, Preempted):
            for workdir, entries in zip(workdirs, before):
                rundir.undo_start(workdir, entries)
        raise
    except OSError as e:  # a file could not be written: one line, checkpoints kept
        raise RunDirError(_file_error(workdirs, e)) from None


def _check_before_writing(cfgs: list[ExperimentConfig], workdirs: list[Path]) -> None:
    """Refuse members that cannot train together, a run directory that is a file or holds
    another run, a batch or parameters the devices cannot hold: before anything is written."""
    members.check_group(cfgs)
    if len({w.resolve() for w in workdirs}) < len(workdirs):
        raise ConfigError("members need a run directory each; two members share one")
    with logfile.library_logs_dropped():  # no run log yet: nothing may be written
        for cfg, workdir in zip(cfgs, workdirs):
            if workdir.exists() and not workdir.is_dir():
                kind = path_kind(workdir)
                if len(cfgs) == 1:
                    raise RunDirError(f"--workdir {workdir} is {kind}; give a directory")
                raise RunDirError(f"member {cfg.name}: {workdir} is {kind}, not a directory")
            if len(cfgs) > 1:  # a run alone is checked as its directory is claimed
                resume_check.check_resume(cfg, workdir)
    sharding.check_host_batch(cfgs[0], distributed.process_layout()[1])
    datasheets.check_params_fit(cfgs[0])
    if len(cfgs) > 1:
        mesh_cfg = cfgs[0].mesh
        sizes = sharding.mesh_shape(mesh_cfg, jax.device_count())
        sharding.check_members_fit(mesh_cfg, sizes, len(cfgs))


def _file_error(workdirs: list[Path], e: OSError) -> str:
    """One line for a run file that could not be read or written, naming what is kept."""
    if len(workdirs) > 1:
        return (
            f"the group of {len(workdirs)} runs ({workdirs[0].parent}) stopped on a file error: "
            f"{e}; checkpoints already written are intact. Free space or fix permissions, "
            "then run the same command again"
        )
    latest = None
    # orbax's notes on opening them read-only go nowhere: the log may be what failed
    with contextlib.suppress(Exception), logfile.library_logs_dropped():
        latest = saved_run.latest_step(workdirs[0])
    kept = f"checkpoints up to step {latest} are intact" if latest else "no checkpoint yet"
    return (
        f"the run in {workdirs[0]} stopped on a file error: {e}; {kept}. Free space or fix "
        "permissions, then run the same command again"
    )


@contextlib.contextmanager
def claim_workdir(workdir: Path) -> Iterator[None]:
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
    """One run of the loop, a member of its group: its run directory, data, writers and
    checkpoints, and the host-side tallies (tokens, positions, wall time, best validation
    loss) that checkpoints carry along. Its train state is its slot of the group's state."""

    def __init__(
        self, group: Group, index: int, cfg: ExperimentConfig, workdir: Path, eval_fn: EvalFn | None
    ):
        self.t_start = time.perf_counter()
        self.group, self.index = group, index
        self.cfg, self.workdir = cfg, workdir
        self.primary = distributed.is_primary()  # one writer of run files on multi-host
        _prepare_workdir(cfg, workdir, self.primary)
        tc = cfg.train
        self.stop = min(tc.steps, tc.stop_after_steps or tc.steps)
        process, count = distributed.process_layout()
        self.train_it = pipeline.make_iterator(
            cfg, "train", process_index=process, process_count=count
        )
        val_it = pipeline.make_iterator(
            cfg, "validation", process_index=process, process_count=count
        )
        self.val_host = [next(val_it) for _ in range(tc.eval_batches)]
        self.ckpt = checkpoint.Checkpointer(
            rundir.checkpoints_dir(workdir),
            keep_last=tc.keep_last,
            keep_every=tc.keep_every,
            async_save=tc.async_checkpoint,
        )
        self.timing = {"compile_s": 0.0, "checkpoint_s": 0.0, "eval_s": 0.0}
        self.eval_fn = eval_fn
        self.row: dict[str, Any] = {}  # the hooks' metrics of the current step, not yet written
        self.measured: dict[str, Any] = {}  # what the hooks measured at the latest hook step
        self.error: Exception | None = None  # what stopped it alone (a non-finite loss)
        # Its own state while it waits for the group to reach its step (None once it trains
        # in its slot of the group's state).
        self.restored: Any = None
        self.summary: dict[str, Any] | None = None  # a finished run's, read on resume

    @property
    def member_index(self) -> int | None:
        """Its index on the member axis (None: a run alone, whose arrays have none)."""
        return self.index if len(self.group.members) > 1 else None

    @property
    def program(self) -> Program:
        return self.group.program

    @property
    def state(self) -> Any:
        if self.restored is not None:  # waiting: its slot holds what is discarded
            return self.restored
        return self.program.member(self.group.state, self.index)

    def start_from(self, restored: tuple[Any, dict, int] | None, own: bool) -> None:
        """Take the restored (state, data state, step) (`own`: from this run's checkpoints,
        not `train.init_from`), or start at step 0 (the group initialises its state)."""
        self.resumed = restored is not None and own
        if restored is None:
            self.restored, self.start = None, 0
            self.totals: dict[str, Any] = {"tokens": 0.0, "positions": 0.0, "wall_time_s": 0.0}
        else:
            self.restored, data_state, self.start = restored
            # A branch on other data or another objective (finetuning, adaptation) starts its
            # own stream; a resume, or a branch on the same stream (a cooldown), continues it.
            theirs = data_state["iterator"].get("fingerprint")
            if own or theirs == self.train_it.state().get("fingerprint"):
                self.train_it.restore(data_state["iterator"])
            self.totals = data_state["totals"]
        self.tokens0 = self.totals["tokens"]
        self.totals.setdefault("document_tokens", None if self.start else 0.0)
        self.documents = 0  # this process's document tokens not yet in the totals

    def measure(self, values: dict[str, Any]) -> None:
        self.row |= values
        self.measured |= values

    def read_batches(self, n: int) -> list:
        """Its next `n` training batches (host rows), counting their document tokens."""
        batches = []
        for _ in range(n):
            batches.append(next(self.train_it))
            self.documents += self.train_it.last_document_tokens
        return batches

    def show_progress(self, n: int, row: dict[str, Any] | None) -> None:
        if self.bar is None:
            return
        self.bar.update(n)
        if row is not None:
            self.bar.set_postfix(
                loss=f"{row['train/loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}"
            )

    def open_writers(self) -> None:
        """Metrics files, deferred metrics, checkpointer and progress bar for steps after
        `start`."""
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
        self.checkpointer.last_saved = self.start  # the group's checkpoint hook calls it

    def wall_time(self) -> float:
        """Seconds this run has taken over all its invocations, up to now."""
        return self.totals["wall_time_s"] + time.perf_counter() - self.t_start

    def write_row(self, t: int) -> None:
        if self.row:
            self.metrics.write(t, self.row)
            self.row = {}

    def flush_to_disk(self, t: int) -> None:
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
        if self.summary is not None:  # finished before: no writers were opened
            self.ckpt.close()
            return
        if self.bar is not None:
            self.bar.close()
        try:
            self.writer.close()
        except OSError:  # flushing onto a full disk: the error on its way says more
            if not failing:
                raise
        self.ckpt.close()


class Group:
    """The loop: its members in progress, their compiled program and the program's state."""

    def __init__(self, cfgs: list[ExperimentConfig], workdirs: list[Path], eval_fns: list):
        self.t_start = time.perf_counter()
        self.cfg = cfgs[0]  # the program and the cadence are every member's
        self.members: list[Run] = []
        for i, (c, w, f) in enumerate(zip(cfgs, workdirs, eval_fns)):
            self.members.append(Run(self, i, c, w, f))
        self.program = build_program(cfgs, self.members[0].val_host[0])
        eval_batches = len(self.members[0].val_host)
        self.val_batches = [
            self.program.shard([m.val_host[j] for m in self.members]) for j in range(eval_batches)
        ]
        self.stop = self.members[0].stop
        self.hooks = hooks.Hooks()
        self.hooks.add_hook(Group.validate, every=self.cfg.train.eval_every)
        if any(f is not None for f in eval_fns):
            self.hooks.add_hook(Group.zero_shot, every=self.cfg.eval.every_steps)
        self.hooks.add_hook(Group.checkpoint, every=self.cfg.train.checkpoint_every)

    @property
    def alone(self) -> bool:
        """A run trained by itself: its faults are the loop's."""
        return len(self.members) == 1

    @property
    def active(self) -> list[Run]:
        """The members still training: not stopped by a fault, not finished before."""
        return [m for m in self.members if m.error is None and m.summary is None]

    @property
    def live(self) -> list[Run]:
        """The active members training in their slots (not waiting for the group's step)."""
        return [m for m in self.active if m.restored is None]

    def restore(self) -> int:
        """Every member's state from its checkpoints (or fresh); returns the step the group
        starts from: the earliest member's (the others wait for it, `join`)."""
        for m in self.members:
            m.timing["compile_s"] = self.program.compile_s
            restored = checkpoint_recovery.restore_run(m.cfg, m.ckpt, self.program.abstract_state)
            m.start_from(*restored)
            if m.start >= self.stop:
                m.summary = rundir.read_summary(m.workdir)
        # The earliest member's step: a member ahead waits for it rather than training alone
        # (another program). A member's step depends on its own slot only, so one that joins
        # computes what it computed in the uninterrupted group (same program, same slot).
        start = min(m.start for m in self.members)
        seeds = [m.cfg.train.seed for m in self.members]
        if all(m.restored is None for m in self.members):
            self.state = self.program.init(seeds)
        else:
            init = self.program.init(seeds)  # only the fresh members' slices are used
            self.state = self.program.stack(
                [
                    m.restored if m.restored is not None else self.program.member(init, i)
                    for i, m in enumerate(self.members)
                ]
            )
        for m in self.members:
            if m.start == start:
                m.restored = None
        return start

    def join(self, step: int | None) -> None:
        """The waiting members whose step is `step` or earlier (every one with None) take
        their slots of the group's state; every waiting member's slot is reset to its own
        state."""
        joining = [
            m for m in self.active if m.restored is not None and (step is None or m.start <= step)
        ]
        if not joining:
            return
        self.state = self.program.stack([m.state for m in self.members])
        for m in joining:
            m.restored = None

    def train(self) -> list[Result]:
        """Every member's summary (or the error that stopped it alone); a run alone raises
        its error."""
        start = self.restore()
        if not self.active:  # every member finished: at most their evaluations to add
            for m in self.members:
                m.ckpt.close()
            return [add_evaluation(m, m.summary) for m in self.members]
        for m in self.active:
            m.open_writers()
        try:
            done, train_time = self._train_from(start)
        except OSError:
            for m in self.members:
                m.ckpt.wait()
            raise
        finally:
            failing = sys.exc_info()[1] is not None
            for m in self.members:
                m.close(failing=failing)
        if self.alone and self.members[0].error is not None:
            raise self.members[0].error
        return [self._result(m, done, train_time) for m in self.members]

    def _train_from(self, start: int) -> tuple[int, float]:
        """Steps after `start` to the stop, the final hooks and the last saves."""
        with distributed.stop_requests(self.cfg.train.log_every) as stop_requested:
            done, signum, train_time = self._loop(start, stop_requested)
            if signum is not None:
                self._preempted(done, signum)
            self.join(None)  # a member saved at or past the stop: its final hooks
            self.run_hooks(done, force=True)  # evaluation, then the last save
            for m in self.active:
                t = time.perf_counter()
                m.ckpt.wait()
                m.timing["checkpoint_s"] += time.perf_counter() - t
        return done, train_time

    def _result(self, m: Run, done: int, train_time: float) -> Result:
        if m.error is not None:
            return m.error
        if m.summary is not None:
            return add_evaluation(m, m.summary)
        if not self.alone:
            m.timing["members"] = float(len(self.members))
        return summarise(m, done, train_time, m.measured)

    def _loop(self, start: int, stop_requested: Any) -> tuple[int, int | None, float]:
        """Steps `start + 1 .. stop`: dispatch step t (metrics of t-1 read meanwhile), then
        the hooks due at t. Returns (last step done, the signal that stopped it or None,
        seconds of train steps: the loop less the hooks inside it)."""
        t_loop = time.perf_counter()
        aside0 = self._hook_seconds()
        done, signum = self.stop, None
        t = start + 1
        while t <= self.stop and self.active:
            signum = stop_requested(t - 1)
            if signum is not None:
                done = t - 1
                break
            for m in self.active:
                m.ckpt.poll()  # a failed asynchronous save stops the loop here, not later
            self.join(t - 1)
            n = self.steps_in_call(t)
            self.dispatch(t, n)
            t += n
            if t - 1 != self.stop and self.hooks.due(t - 1):
                self.run_hooks(t - 1)
        for m in self.active:
            with self.stop_alone_on_nan(m):
                m.metrics.flush(done)
        return done, signum, time.perf_counter() - t_loop - (self._hook_seconds() - aside0)

    def _hook_seconds(self) -> float:
        """Seconds the hooks took so far (evaluation and checkpoints, every member's)."""
        return sum(m.timing["eval_s"] + m.timing["checkpoint_s"] for m in self.members)

    def steps_in_call(self, t: int) -> int:
        """Steps from `t` to run in one call: train.steps_per_call when none of them but the
        last is a log step, a hook's step, the stop or a waiting member's step (on one
        process), else 1."""
        k, every = self.program.steps_per_call, self.cfg.train.log_every
        if k == 1 or t + k - 1 > self.stop or jax.process_count() > 1:
            return 1  # several processes: JAX's preemption sync point is checked every step
        inner = range(t, t + k - 1)
        joins = {m.start for m in self.active if m.restored is not None}
        return 1 if any(s % every == 0 or self.hooks.due(s) or s in joins for s in inner) else k

    def dispatch(self, t: int, n: int) -> None:
        """Start steps `t .. t + n - 1` of every member in one call; write the previous log
        step's rows. A stopped member still reads its data, so the others' batches keep their
        places; a waiting or finished member's data stays where it is, its slot fed a
        validation batch whose step is discarded."""
        live = self.live
        batches = []
        for m in self.members:
            if m.restored is not None or m.summary is not None:
                batches.append([m.val_host[0]] * n)  # any batch of the right shape
            else:
                batches.append(m.read_batches(n))
        if n == 1:
            batch = self.program.shard([b[0] for b in batches])
            self.state, step_metrics = self.program.step(self.state, batch)
        else:
            stacked = self.program.shard_steps(batches)
            self.state, step_metrics = self.program.steps(self.state, stacked)
        t += n - 1
        log = t % self.cfg.train.log_every == 0 or t == self.stop
        for m in live:
            with self.stop_alone_on_nan(m):
                m.show_progress(n, m.metrics.push(t, step_metrics, log=log))

    def run_hooks(self, t: int, *, force: bool = False) -> None:
        """The hooks due at `t` (all with `force`), after step `t`'s metrics; each member's
        row written."""
        if not self.active:
            return
        for m in self.active:
            m.measured = {}
            with self.stop_alone_on_nan(m):
                m.metrics.flush(t)
        for _ in self.hooks.each(self, t, force=force):
            pass
        for m in self.active:
            with self.stop_alone_on_nan(m):
                m.write_row(t)

    def validate(self, step: int) -> None:
        """Every member's validation metrics from one pass of the program over their
        held-out batches."""
        t = time.perf_counter()
        params = self.state["params"]
        sums = jax.device_get([self.program.eval_step(params, b) for b in self.val_batches])
        active = self.live
        for m in active:
            own = sums
            if m.member_index is not None:
                own = [{k: v[m.member_index] for k, v in s.items()} for s in sums]
            m.measure(hooks.validation_metrics(m, own))
        for m in active:
            m.timing["eval_s"] += (time.perf_counter() - t) / len(active)

    def zero_shot(self, step: int) -> None:
        for m in self.live:
            if m.eval_fn is not None:
                m.measure(hooks.ZeroShot(m.eval_fn)(m, step))

    def checkpoint(self, step: int) -> None:
        for m in self.live:
            with self.stop_alone_on_nan(m):
                m.checkpointer(m, step)

    @contextlib.contextmanager
    def stop_alone_on_nan(self, m: Run) -> Iterator[None]:
        """A non-finite loss reaching the host stops member `m` alone."""
        try:
            yield
        except metrics_writer.NonFiniteMetric as e:
            try:
                raise_nonfinite(m, e)
            except NonFiniteLoss as stopped:
                if self.alone:
                    m.error = stopped
                    return
                m.error = NonFiniteLoss(f"member {m.cfg.name} ({m.workdir.name}): {stopped}")
                print(f"error: {m.error}; the other members go on", file=sys.stderr)

    def _preempted(self, done: int, signum: int) -> None:
        """Save every member at step `done`, then stop with Preempted."""
        stops: list[Preempted] = []
        for m in self.active:
            with self.stop_alone_on_nan(m):
                try:
                    raise_preempted(m, done, signum)
                except Preempted as e:
                    stops.append(e)
        if self.alone:
            raise self.members[0].error or stops[0]
        lines = [f"{m.cfg.name} ({m.workdir.name}): {e}" for m, e in zip(self.active, stops)]
        raise Preempted(
            f"stopped a group of {len(self.members)} members at step {done}:\n  "
            + "\n  ".join(lines),
            signum,
        )


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
