"""`train_group(cfgs, workdirs)`: runs of one shape trained together as the members of one
compiled program (train/members.py), each writing its own run directory exactly as it would
alone (config, metrics, TensorBoard, checkpoints, summary, evaluation files).

The loop is the single run's (train/loop.py): dispatch step t, read step t-1's metrics,
run the hooks due at t. Each member is a `loop.Run` without a program of its own: its data
iterator, metrics, checkpoints, totals and summary are its own; the group holds the stacked
train state and calls the program once per step for all of them. The hooks run once for the
group (one validation pass over every member) and write into each member's row.

Faults are per member. A member whose loss is not finite stops alone: its last good
checkpoint is kept, its error names it, the others go on. A signal saves every member at
one step and stops the group (Preempted); the same command resumes it. A checkpoint does not
know whether it was written by a group, so a member can resume alone and a run trained alone
can resume in a group.

Members whose checkpoints stand at different steps (a member's directory deleted, its newest
checkpoint set aside as damaged) resume in their one group: the group starts from the
earliest member's step, and a member ahead of it waits until the group reaches its step, then
joins; its losses then equal the uninterrupted group's bit for bit (docs/faults.md).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax

from scalestudy.config.errors import ConfigError, path_kind
from scalestudy.config.experiment import ExperimentConfig
from scalestudy.train import hooks, loop, members, sharding
from scalestudy.train import program as group_program
from scalestudy.train.rundir import checkpoint_recovery, logfile, metrics_writer, resume_check
from scalestudy.train.rundir import layout as rundir
from scalestudy.train.runtime import distributed

Result = dict[str, Any] | Exception  # a member's summary, or why it stopped


class Member(loop.Run):
    """One run of a group: its files and tallies; its state is its slice of the group's."""

    def __init__(self, group: Group, index: int, cfg: ExperimentConfig, workdir: Path, eval_fn):
        super().__init__(cfg, workdir, eval_fn, build=False)
        self.group, self.member_index = group, index
        self.error: Exception | None = None
        # Its own state while it waits for the group to reach its step (None once it trains
        # in its slot of the group's state).
        self.restored: Any = None
        self.summary: dict[str, Any] | None = None  # a finished member's, read on resume
        self.measured: dict[str, Any] = {}  # what the hooks measured at the latest hook step

    @property
    def program(self) -> group_program.GroupProgram:
        return self.group.program

    @property
    def state(self) -> Any:
        if self.restored is not None:  # waiting: its slot holds what is discarded
            return self.restored
        return self.program.member(self.group.state, self.member_index)

    @state.setter
    def state(self, value: Any) -> None:  # Run.start_from: the restored or fresh state
        self.restored = value

    def fresh_state(self) -> None:
        return None  # the group initialises every fresh member in one call

    def measure(self, values: dict[str, Any]) -> None:
        self.row |= values
        self.measured |= values

    def close(self, failing: bool) -> None:
        if self.summary is not None:  # finished before: no writers were opened
            self.ckpt.close()
        else:
            super().close(failing)


def train_group(
    cfgs: Sequence[ExperimentConfig],
    workdirs: Sequence[str | Path],
    eval_fns: Sequence[Any] | None = None,
) -> list[Result]:
    """Train (or resume) the runs `cfgs` in `workdirs` as members of one program; returns
    each member's summary, or the exception that stopped it alone (a non-finite loss).

    One member is an ordinary run (`loop.train`), bit for bit. Nothing is written before
    every member's directory has been checked against its config."""
    cfgs, workdirs = list(cfgs), [Path(w) for w in workdirs]
    eval_fns = list(eval_fns) if eval_fns is not None else [None] * len(cfgs)
    if not (len(cfgs) == len(workdirs) == len(eval_fns)):
        raise ValueError("train_group: one workdir and one eval_fn per config")
    members.check(cfgs)
    if len({w.resolve() for w in workdirs}) < len(workdirs):
        raise ConfigError("members need a run directory each; two members share one")
    with logfile.library_logs_dropped():  # no run log yet: nothing may be written
        for cfg, workdir in zip(cfgs, workdirs):
            if workdir.exists() and not workdir.is_dir():
                raise loop.RunDirError(
                    f"member {cfg.name}: {workdir} is {path_kind(workdir)}, not a directory"
                )
            resume_check.check_resume(cfg, workdir)  # a directory holding another run: refused
    if len(cfgs) == 1:
        return [loop.train(cfgs[0], workdirs[0], eval_fn=eval_fns[0])]
    mesh_cfg = cfgs[0].mesh  # checked before anything is written
    sharding.check_members_fit(
        mesh_cfg, sharding.mesh_shape(mesh_cfg, jax.device_count()), len(cfgs)
    )
    try:
        with contextlib.ExitStack() as stack:
            for workdir in workdirs:
                stack.enter_context(loop.claim(workdir))
            return Group(cfgs, workdirs, eval_fns).train()
    except OSError as e:  # a run file could not be written: one line, checkpoints kept
        raise loop.RunDirError(
            f"the group of {len(cfgs)} runs ({workdirs[0].parent}) stopped on a file error: "
            f"{e}; checkpoints already written are intact. Free space or fix permissions, "
            "then run the same command again"
        ) from None


class Group:
    """The members in progress, the group's compiled program and its stacked state."""

    def __init__(self, cfgs: list[ExperimentConfig], workdirs: list[Path], eval_fns: list):
        self.t_start = time.perf_counter()
        self.cfg = cfgs[0]  # the program and the cadence are every member's
        self.members = [
            Member(self, i, c, w, f) for i, (c, w, f) in enumerate(zip(cfgs, workdirs, eval_fns))
        ]
        self.program = group_program.build_group_program(cfgs, self.members[0].val_host[0])
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
    def active(self) -> list[Member]:
        """The members still training: not stopped by a fault, not finished before."""
        return [m for m in self.members if m.error is None and m.summary is None]

    @property
    def live(self) -> list[Member]:
        """The active members training in their slots (not waiting for the group's step)."""
        return [m for m in self.active if m.restored is None]

    def restore(self) -> int:
        """Every member's state from its checkpoints (or fresh); returns the step the group
        starts from: the earliest member's (the others wait for it, `join`)."""
        for m in self.members:
            m.timing["compile_s"] = self.program.compile_s
            restored = checkpoint_recovery.restore_run(
                m.cfg, m.ckpt, self.program.member_abstract_state
            )
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
        start = self.restore()
        if not self.active:  # every member finished: at most their evaluations to add
            for m in self.members:
                m.ckpt.close()
            return [loop.add_evaluation(m, m.summary) for m in self.members]
        for m in self.active:
            m.open_writers()
        try:
            with distributed.stop_requests(self.cfg.train.log_every) as stop_requested:
                done, signum, train_time = self._loop(start, stop_requested)
                if signum is not None:
                    self._preempted(done, signum)
                self.join(None)  # a member saved at or past the stop: its final hooks
                self.run_hooks(done, force=True)
                for m in self.active:
                    t = time.perf_counter()
                    m.ckpt.wait()
                    m.timing["checkpoint_s"] += time.perf_counter() - t
        except OSError:
            for m in self.members:
                m.ckpt.wait()
            raise
        finally:
            failing = sys.exc_info()[1] is not None
            for m in self.members:
                m.close(failing=failing)
        results: list[Result] = []
        for m in self.members:
            if m.error is not None:
                results.append(m.error)
                continue
            if m.summary is not None:
                results.append(loop.add_evaluation(m, m.summary))
                continue
            m.timing["members"] = float(len(self.members))
            results.append(loop.summarise(m, done, train_time, m.measured))
        return results

    def _loop(self, start: int, stop_requested: Any) -> tuple[int, int | None, float]:
        """Steps `start + 1 .. stop` of every member, as `loop._loop` runs one run's."""
        t_loop = time.perf_counter()
        aside0 = self._aside()
        done, signum = self.stop, None
        t = start + 1
        while t <= self.stop and self.active:
            signum = stop_requested(t - 1)
            if signum is not None:
                done = t - 1
                break
            for m in self.active:
                m.ckpt.poll()
            self.join(t - 1)
            n = self.steps_in_call(t)
            self.dispatch(t, n)
            t += n
            if t - 1 != self.stop and self.hooks.due(t - 1):
                self.run_hooks(t - 1)
        for m in self.active:
            with self.guard(m):
                m.metrics.flush(done)
        return done, signum, time.perf_counter() - t_loop - (self._aside() - aside0)

    def _aside(self) -> float:
        """Seconds the hooks took so far (evaluation and checkpoints, every member's)."""
        return sum(m.timing["eval_s"] + m.timing["checkpoint_s"] for m in self.members)

    def steps_in_call(self, t: int) -> int:
        """As `Run.steps_in_call`, with the group's hooks; a member that joins after one of
        the steps also breaks the call there."""
        k, every = self.program.steps_per_call, self.cfg.train.log_every
        if k == 1 or t + k - 1 > self.stop or jax.process_count() > 1:
            return 1
        inner = range(t, t + k - 1)
        joins = {m.start for m in self.active if m.restored is not None}
        return 1 if any(s % every == 0 or self.hooks.due(s) or s in joins for s in inner) else k

    def dispatch(self, t: int, n: int) -> None:
        """Steps `t .. t + n - 1` of every member in one call (a stopped member still reads
        its data, so the others' batches keep their places; a waiting or finished member's
        data stays where it is, its slot fed a validation batch whose step is discarded)."""
        live = self.live
        batches = []
        for m in self.members:
            if m.restored is not None or m.summary is not None:
                # Any batch of the right shape: what the step makes of this slot is discarded.
                batches.append([m.val_host[0]] * n)
                continue
            own = []
            for _ in range(n):
                own.append(next(m.train_it))
                m.documents += m.train_it.last_document_tokens
            batches.append(own)
        hyper = self.program.hyper
        if n == 1:
            batch = self.program.shard([b[0] for b in batches])
            self.state, step_metrics = self.program.train_step(self.state, batch, hyper)
        else:
            stacked = self.program.shard_steps(batches)
            self.state, step_metrics = self.program.multi_step(self.state, stacked, hyper)
        t += n - 1
        log = t % self.cfg.train.log_every == 0 or t == self.stop
        for m in live:
            with self.guard(m):
                m.metrics.push(t, step_metrics, log=log)

    def run_hooks(self, t: int, *, force: bool = False) -> None:
        """The group's hooks due at `t` (all with `force`); each member's row written."""
        for m in self.active:
            m.measured = {}
            with self.guard(m):
                m.metrics.flush(t)
        for _ in self.hooks.each(self, t, force=force):
            pass
        for m in self.active:
            with self.guard(m):
                m.write_row(t)

    def validate(self, step: int) -> None:
        """Every member's validation metrics from one pass of the group's program over
        their batches."""
        t = time.perf_counter()
        params = self.state["params"]
        sums = jax.device_get([self.program.eval_step(params, b) for b in self.val_batches])
        active = self.live
        for m in active:
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
            with self.guard(m):
                m.checkpointer(m, step)

    @contextlib.contextmanager
    def guard(self, m: Member) -> Iterator[None]:
        """A non-finite loss reaching the host stops member `m` alone."""
        try:
            yield
        except metrics_writer.NonFiniteMetric as e:
            try:
                loop.raise_nonfinite(m, e)
            except loop.NonFiniteLoss as stopped:
                m.error = loop.NonFiniteLoss(f"member {m.cfg.name} ({m.workdir.name}): {stopped}")
                print(f"error: {m.error}; the other members go on", file=sys.stderr)

    def _preempted(self, done: int, signum: int) -> None:
        """Save every member at step `done`, then stop the group with Preempted."""
        lines = []
        for m in self.active:
            with self.guard(m):
                try:
                    loop.raise_preempted(m, done, signum)
                except loop.Preempted as e:
                    lines.append(f"{m.cfg.name} ({m.workdir.name}): {e}")
        raise loop.Preempted(
            f"stopped a group of {len(self.members)} members at step {done}:\n  "
            + "\n  ".join(lines),
            signum,
        )
