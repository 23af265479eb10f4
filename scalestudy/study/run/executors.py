"""Where a study's runs execute here, and how cluster-trained runs are collected.

The local executor trains runs one after another in this process, with one progress bar over
the whole study's training FLOPs, evaluating each run zero-shot at the end of its training.
Cluster jobs (study/run/cluster.py) train and evaluate each run in its own job with
`scalestudy train --eval`; `collect` then records their summaries in the registry. Collecting
never trains and never evaluates: a run that is missing, unfinished or unevaluated is
reported as such, so no run is ever restored onto the collecting host's devices.
"""

from __future__ import annotations

import functools
import time
import traceback
from pathlib import Path
from typing import Any

from scalestudy.config.errors import ConfigError, ScalestudyError
from scalestudy.study.plan import groups
from scalestudy.study.record.registry import Registry
from scalestudy.study.run import interrupts
from scalestudy.study.run.interrupts import StopRequests, StudyInterrupted, signal_of
from scalestudy.study.run.study_progress import StudyProgress
from scalestudy.train.rundir import layout as rundir


class StudyRunError(ScalestudyError):
    """Some runs of a study failed (the others are kept)."""


def finished_summary(workdir: Path, steps: int) -> dict | None:
    """The run's summary.json if it exists and covers all `steps` (a finished run)."""
    summary = rundir.read_summary(workdir)
    if summary is None:
        return None
    finished = summary.get("complete", True) and summary.get("steps", steps) >= steps
    return summary if finished else None


def _default_train(cfg: Any, workdir: Path, evaluate: bool = True) -> dict:
    """Train and (with `evaluate`) evaluate one run; its per-example scores go to its own
    directory, as those of `scalestudy eval` do (evaluate/results.py)."""
    from scalestudy.evaluate import rank
    from scalestudy.train import loop

    return loop.train(cfg, workdir, eval_fn=rank.make_eval_fn(cfg, workdir) if evaluate else None)


def _needs_eval(cfg: Any, summary: dict) -> bool:
    """Whether a finished run lacks the zero-shot results its config asks for (none for an
    objective rank classification cannot score: bmlm)."""
    from scalestudy.data.objectives import scores_zero_shot

    asked = bool(cfg.eval.tasks or cfg.eval.custom_tasks) and not scores_zero_shot(cfg.objective)
    return asked and not summary.get("eval")


def _not_evaluated(workdir: Path) -> str:
    return (
        f"trained but not evaluated (no zero-shot results in {rundir.summary_path(workdir)}); "
        f"evaluate it on its own mesh with `scalestudy train --eval --workdir {workdir}` in a "
        "job with the run's resources"
    )


class LocalExecutor:
    """Trains a study's missing runs on this host, recording each in the registry; finished
    runs are skipped, unfinished ones resume from their checkpoints.

    With one worker the runs train one after another in this process. With `workers` > 1
    they train in that many worker processes at once (each a fresh interpreter with its own
    JAX runtime; this process alone writes the registry). On a CPU, tiny models leave cores
    idle between their small kernels, so two runs at a time finish a smoke study sooner; on
    an accelerator host keep one worker per device set.

    With `evaluate=False` the runs train without their zero-shot evaluation (a learning-rate
    search's runs, scored on validation loss alone). A finished run without its evaluation is
    reported, not evaluated here (it may need its own mesh)."""

    def __init__(
        self,
        registry: Registry,
        out: Path,
        *,
        train_fn: Any = None,
        workers: int = 1,
        members: int = 1,
        evaluate: bool = True,
    ) -> None:
        self.reg = registry
        self.out = Path(out)
        self.evaluate = evaluate
        self.train_fn = train_fn or functools.partial(_default_train, evaluate=evaluate)
        self.workers = workers
        # Runs per program (study/plan/groups.py); a study's own train_fn trains runs alone.
        self.members = members if train_fn is None else 1

    def run(self, runs: list) -> list[str]:
        """Train every run not yet done; returns the names of runs that failed. A signal
        stops the study (StudyInterrupted) once the running runs have checkpointed."""
        todo = self._todo(runs)
        if not todo:
            return []
        jobs, weights = self._jobs(todo)
        if self.workers > 1 and len(jobs) > 1:
            return self._run_parallel(jobs, weights)
        return self._run_here(jobs, weights)

    def _todo(self, runs: list) -> list:
        """The runs not yet done, once runs a gone study left running are reclaimed."""
        reclaimed = self.reg.reclaim_running(
            "left running by a study process that is gone; resumed from its checkpoint"
        )
        if reclaimed:
            print(f"reclaimed {len(reclaimed)} run(s) left running by a stopped study")
        status = {r["run_id"]: r["status"] for r in self.reg.runs()}
        todo = [r for r in runs if status.get(r.run_id) != "done"]
        skipped = len(runs) - len(todo)
        if skipped:
            print(f"{skipped} of {len(runs)} runs already done; {len(todo)} to go")
        return todo

    def _jobs(self, todo: list) -> tuple[list[list], list[float]]:
        """(the jobs that train `todo`, each job's share of the progress bar)."""
        total = sum(r.planned_flops for r in todo) or 1.0
        # Half the bar by run count, half by FLOPs: cheap runs still move it.
        weight = {r.run_id: 0.5 / len(todo) + 0.5 * r.planned_flops / total for r in todo}
        jobs = groups.plan_groups(todo, self.members)
        if self.members > 1:
            print(groups.describe(jobs))
        weights = [sum(weight[r.run_id] for r in job) for job in jobs]
        return jobs, weights

    def _run_here(self, jobs: list[list], weights: list[float]) -> list[str]:
        """Train `jobs` one after another in this process; returns the failed runs' names."""
        progress = StudyProgress(1.0, len(jobs))
        failed: list[str] = []
        stopped: list[str] = []
        try:
            with StopRequests(write=progress.bar.write) as stop:
                for i, job in enumerate(jobs, 1):
                    if stop.poll() is not None:
                        break
                    workdirs = [self.out / "runs" / run.dirname for run in job]
                    progress.start(
                        i, _job_name(job), workdirs[0], weights[i - 1], job[0].cfg.train.steps
                    )
                    live = [
                        (run, w) for run, w in zip(job, workdirs) if self._prepare(run, w) is None
                    ]
                    try:
                        job_failed, job_stopped = self._train_job(live, stop, progress.bar.write)
                        failed += job_failed
                        stopped += job_stopped
                    finally:
                        progress.end(weights[i - 1])
                signum = stop.poll()
        finally:
            progress.close()
        if signum is not None:
            raise _interrupted(signum, stopped, self.reg.path)
        return failed

    def _train_job(
        self, live: list[tuple[Any, Path]], stop: StopRequests, write: Any
    ) -> tuple[list[str], list[str]]:
        """Train one job's runs still to train here, recording each; returns the names of
        (failed, stopped) runs."""
        failed: list[str] = []
        stopped: list[str] = []
        try:
            if live:
                stop.running = True
                results = self._train(live)
                stop.running = False
                failed += self._record_all(live, results, write)
        except KeyboardInterrupt:  # the second Ctrl-C: no checkpoint was awaited
            for run, _ in live:
                self._interrupt(run, "stopped at once by a second Ctrl-C")
            raise
        except Exception as e:  # one bad run must not lose the rest of the study
            if signal_of(e) is not None or stop.poll() is not None:
                # Stopped by the signal, or failed on its way out (it resumes
                # from its last checkpoint all the same).
                for run, _ in live:
                    self._interrupt(run, _describe(e))
                    stopped.append(run.cfg.name)
                stop.note(signal_of(e) or stop.signum)
            else:
                for run, _ in live:
                    self._fail(run, e, write)
                    failed.append(run.cfg.name)
        finally:
            stop.running = False
        return failed, stopped

    def _train(self, live: list[tuple[Any, Path]]) -> list:
        """Train one job here: a run alone, or a group's members together."""
        if len(live) == 1:
            run, workdir = live[0]
            return [self.train_fn(run.cfg, workdir)]
        return groups.train_group([r.cfg for r, _ in live], [w for _, w in live], self.evaluate)

    def _record_all(self, live: list[tuple[Any, Path]], results: list, write: Any) -> list[str]:
        """Record each run's summary, or its own failure (a member stopped alone); returns
        the names of the failed runs."""
        failed = []
        for (run, workdir), result in zip(live, results, strict=True):
            if isinstance(result, Exception):
                detail = _describe(result)
                self.reg.mark_failed(run.run_id, detail)
                write(f"run {run.cfg.name} failed: {detail}")
                failed.append(run.cfg.name)
            else:
                self._record(run, workdir, result)
        return failed

    def _run_parallel(self, jobs: list[list], weights: list[float]) -> list[str]:
        """Train `jobs` (a run, or a group's members) in worker processes, at most
        self.workers at a time."""
        from concurrent.futures import FIRST_COMPLETED, wait

        progress = StudyProgress(1.0, len(jobs))
        failed: list[str] = []
        stopped: list[str] = []
        finished = 0
        halt, pool = self._start_pool()
        # Filled as jobs are submitted, so that a stop during submission reaches those sent.
        pending: dict = {}
        try:
            with StopRequests(lambda signum: halt.set(), progress.bar.write) as stop:
                self._submit_all(pool, jobs, weights, progress, pending)
                marked: set = set()
                while pending:
                    done, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                    self._mark_started(pending, marked)
                    if stop.poll() is not None:
                        halt.set()
                    for future in done:
                        live, weight = pending.pop(future)
                        finished += 1
                        job_failed, job_stopped = self._finish_job(
                            future, live, stop, progress.bar.write
                        )
                        failed += job_failed
                        stopped += job_stopped
                        progress.bar.set_description(
                            f"[{finished}/{len(jobs)}] {_job_name([r for r, _ in live])}"
                        )
                        progress.end(weight)
                signum = stop.poll()
        except BaseException:  # a second Ctrl-C, or the study itself failed: no waiting
            self._abandon(pool, pending)
            raise
        finally:
            progress.close()
        pool.shutdown(wait=True, cancel_futures=True)
        if signum is not None:
            raise _interrupted(signum, stopped, self.reg.path)
        return failed

    def _start_pool(self) -> tuple[Any, Any]:
        """(the event that halts every worker, a pool of self.workers fresh processes)."""
        import multiprocessing
        import os
        from concurrent.futures import ProcessPoolExecutor

        context = multiprocessing.get_context("spawn")  # no forked JAX runtime
        interrupts.start_resource_tracker(self.out / interrupts.TRACKER_LOG)
        halt = context.Event()  # set: every worker checkpoints its run and starts no other
        pool = ProcessPoolExecutor(
            self.workers,
            mp_context=context,
            initializer=interrupts.worker_init,
            initargs=(os.getpid(), halt),
        )
        return halt, pool

    def _submit_all(
        self,
        pool: Any,
        jobs: list[list],
        weights: list[float],
        progress: StudyProgress,
        pending: dict,
    ) -> None:
        """Submit every job with runs to train to `pool`, adding `{future: (live, weight)}`
        to `pending`; a job with none left only moves the progress bar."""
        # Costliest first (longest-processing-time order): the last jobs to start are
        # the cheap ones, so the workers finish close together.
        queue = sorted(
            zip(jobs, weights, strict=True),
            key=lambda jw: -sum(r.planned_flops for r in jw[0]),
        )
        for job, weight in queue:
            workdirs = [self.out / "runs" / run.dirname for run in job]
            live = [
                (run, w)
                for run, w in zip(job, workdirs)
                if self._prepare(run, w, mark=False) is None
            ]
            if not live:
                progress.end(weight)
                continue
            if len(live) == 1:
                fn, args = self.train_fn, (live[0][0].cfg, live[0][1])
            else:
                fn, args = (
                    functools.partial(groups.train_group, evaluate=self.evaluate),
                    ([r.cfg for r, _ in live], [w for _, w in live]),
                )
            future = pool.submit(interrupts.train_in_worker, fn, *args)
            pending[future] = (live, weight)

    def _mark_started(self, pending: dict, marked: set) -> None:
        """Mark running the runs of each job a worker has taken since the last look."""
        for future, (live, _) in pending.items():  # handed to a worker
            if future not in marked and (future.running() or future.done()):
                for run, _ in live:
                    self.reg.mark_running(run.run_id)
                marked.add(future)

    def _finish_job(
        self, future: Any, live: list[tuple[Any, Path]], stop: StopRequests, write: Any
    ) -> tuple[list[str], list[str]]:
        """Record a worker's finished job; returns the names of (failed, stopped) runs."""
        failed: list[str] = []
        stopped: list[str] = []
        try:
            result = future.result()
            if result == interrupts.NOT_STARTED:
                for run, _ in live:
                    self.reg.update(run.run_id, status="pending", started_at=None)
            else:
                results = result if len(live) > 1 else [result]
                failed += self._record_all(live, results, write)
        except Exception as e:  # one bad job must not lose the others
            for run, _ in live:
                if signal_of(e) is not None or stop.signum is not None:
                    self._interrupt(run, _describe(e))
                    stopped.append(run.cfg.name)
                else:
                    self._fail(run, e, write)
                    failed.append(run.cfg.name)
        return failed, stopped

    def _abandon(self, pool: Any, pending: dict) -> None:
        """Kill every worker at once and mark the runs they held interrupted."""
        import multiprocessing

        for process in multiprocessing.active_children():
            process.kill()
        for live, _ in pending.values():
            for run, _ in live:
                self._interrupt(run, "stopped at once; resumes from its last checkpoint")
        pool.shutdown(wait=False, cancel_futures=True)

    def _prepare(self, run: Any, workdir: Path, mark: bool = True) -> dict | None:
        """The summary of a run already trained (e.g. by a cluster job), recorded now; or
        None once the run has its directory (and with `mark`, is marked running): a run to
        train."""
        summary = finished_summary(workdir, run.cfg.train.steps)
        needs_eval = summary is not None and self.evaluate and _needs_eval(run.cfg, summary)
        if summary is not None:
            if needs_eval:
                print(f"warning: run {run.cfg.name} {_not_evaluated(workdir)}")
            self._record(run, workdir, summary)
            return summary
        if mark:
            self.reg.mark_running(run.run_id)
        workdir.mkdir(parents=True, exist_ok=True)
        return None

    def _record(self, run: Any, workdir: Path, summary: dict) -> None:
        self.reg.finish(run.run_id, summary, rundir.read_metrics(workdir))

    def _interrupt(self, run: Any, why: str) -> None:
        self.reg.update(run.run_id, status="interrupted", error=why, finished_at=time.time())

    def _fail(self, run: Any, error: Exception, write: Any) -> None:
        """Record a failed run (called while handling `error`, for its traceback)."""
        detail = _describe(error)
        self.reg.mark_failed(run.run_id, detail + "\n" + traceback.format_exc())
        write(f"run {run.cfg.name} failed: {detail}")


def _job_name(job: list) -> str:
    name = job[0].cfg.name.split(".", 1)[-1]
    return name if len(job) == 1 else f"{name} (+{len(job) - 1} members)"


def _describe(error: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(error), error)).strip()


def _interrupted(signum: int, stopped: list[str], registry: Path) -> StudyInterrupted:
    import signal

    what = (
        f"{len(stopped)} run(s) stopped and are marked interrupted in {registry} (each "
        "resumes from its last checkpoint)"
        if stopped
        else "no run was training"
    )
    return StudyInterrupted(
        f"{signal.Signals(signum).name} received: {what}; run the same command again to "
        "resume (finished runs are kept)",
        signum,
    )


def unfinished(workdir: Path, steps: int) -> tuple[bool, str]:
    """(whether the run ever started, what is missing) for a run with no final summary."""
    logged = [int(r["step"]) for r in rundir.read_metrics(workdir)]
    ckpts = rundir.checkpoints_dir(workdir)
    saved = (
        sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) if ckpts.is_dir() else []
    )
    if not logged and not saved:
        return False, f"never trained (no metrics, no checkpoint in {workdir})"
    where = f"the latest checkpoint is step {saved[-1]}" if saved else "no checkpoint was saved"
    return True, (
        f"unfinished: logged up to step {max(logged, default=0)} of {steps} and {where}; "
        "re-submit its job to resume it"
    )


def check_collect(out: Path, n_runs: int) -> None:
    """Refuse --collect, before anything is written, where no cluster run can be found."""
    if not (out / "runs").is_dir():
        raise ConfigError(
            f"--collect: {n_runs} of {n_runs} run(s) are not complete ({out / 'runs'} does "
            "not exist). Collecting never trains: run the cluster jobs, then collect"
        )


def collect(reg: Registry, out: Path, runs: list) -> list[str]:
    """Record every finished run's summary in the registry without training or evaluating
    anything; returns one line per run that is missing, unfinished or not evaluated."""
    status = {r["run_id"]: r["status"] for r in reg.runs()}
    problems: list[str] = []
    recorded = 0
    for run in runs:
        workdir = Path(out) / "runs" / run.dirname
        name = run.cfg.name.split(".", 1)[-1]
        summary = finished_summary(workdir, run.cfg.train.steps)
        if summary is None:
            started, why = unfinished(workdir, run.cfg.train.steps)
            if started:
                reg.mark_failed(run.run_id, why)
            else:  # still pending: nothing ran
                reg.update(run.run_id, status="pending", error=why)
            problems.append(f"{name}: {why}")
            continue
        if status.get(run.run_id) != "done":
            reg.finish(run.run_id, summary, rundir.read_metrics(workdir))
            recorded += 1
        if _needs_eval(run.cfg, summary):
            problems.append(f"{name}: {_not_evaluated(workdir)}")
    print(f"collected {recorded} new run(s); {len(runs) - len(problems)} of {len(runs)} complete")
    for line in problems:
        print(f"  not complete: {line}")
    return problems
