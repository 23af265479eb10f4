"""Where a study's runs execute: here (sequentially), on SLURM, or on a TPU pod.

The local executor trains runs one after another in this process, with one progress bar over
the whole study's training FLOPs. The cluster executors render real commands (an sbatch job
array; gcloud TPU VM / queued-resource commands), written beside the study and printed; they
are submitted only when asked. Cluster jobs train with `scalestudy train` into the run
directories; running `scalestudy study` on the same spec and directory afterwards collects
their summaries into the registry (it never retrains a finished run), then fits and reports.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import threading
import traceback
from pathlib import Path
from string import Template
from typing import Any

from scalestudy.config import ScalestudyError, StudySpec, to_yaml
from scalestudy.study.registry import Registry, read_metrics_jsonl


class StudyRunError(ScalestudyError):
    """Some runs of a study failed (the others are kept)."""


class LaunchError(ScalestudyError):
    """A cluster launch could not be rendered or submitted."""


def _finished_summary(workdir: Path, steps: int) -> dict | None:
    """The run's summary.json if it exists and covers all `steps` (a finished run)."""
    path = workdir / "summary.json"
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    finished = summary.get("complete", True) and summary.get("steps", steps) >= steps
    return summary if finished else None


def _default_train(cfg: Any, workdir: Path) -> dict:
    from scalestudy.evaluate import rank
    from scalestudy.train import loop

    return loop.train(cfg, workdir, eval_fn=rank.make_eval_fn(cfg))


def _evaluate_if_missing(cfg: Any, workdir: Path, summary: dict) -> dict:
    """Cluster runs trained with `scalestudy train` have no eval: evaluate at collection."""
    if summary.get("eval") or not cfg.eval.tasks:
        return summary
    from scalestudy.evaluate import rank

    results = rank.evaluate_run(workdir, tasks=list(cfg.eval.tasks))
    return {**summary, "eval": results}


class _Progress:
    """A study-wide progress bar fed by the running run's metrics.jsonl (polled in a thread,
    so the trainer needs no callback). Each run weighs half an equal share (fixed costs:
    compilation, evaluation) and half its share of the study's training FLOPs."""

    def __init__(self, total: float, n_runs: int) -> None:
        from tqdm import tqdm

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
            target=self._poll, args=(workdir / "metrics.jsonl", weight, steps), daemon=True
        )
        self._thread.start()

    def _poll(self, path: Path, weight: float, steps: int) -> None:
        while not self._stop.wait(1.0):
            recs = read_metrics_jsonl(path)
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

    def close(self) -> None:
        self.bar.close()


_BAR = "{desc} {percentage:5.1f}%|{bar}| [{elapsed}<{remaining}] {postfix}"


class LocalExecutor:
    """Trains a study's missing runs sequentially in this process, recording each in the
    registry; finished runs are skipped, unfinished ones resume from their checkpoints."""

    def __init__(self, registry: Registry, out: Path, *, train_fn: Any = None) -> None:
        self.reg = registry
        self.out = Path(out)
        self.train_fn = train_fn or _default_train

    def run(self, runs: list) -> list[str]:
        """Train every run not yet done; returns the names of runs that failed."""
        status = {r["run_id"]: r["status"] for r in self.reg.runs()}
        todo = [r for r in runs if status.get(r.run_id) != "done"]
        skipped = len(runs) - len(todo)
        if skipped:
            print(f"{skipped} of {len(runs)} runs already done; {len(todo)} to go")
        if not todo:
            return []
        total = sum(r.planned_flops for r in todo) or 1.0
        weights = [0.5 / len(todo) + 0.5 * r.planned_flops / total for r in todo]
        progress = _Progress(1.0, len(todo))
        failed: list[str] = []
        try:
            for i, run in enumerate(todo, 1):
                workdir = self.out / "runs" / run.dirname
                progress.start(
                    i,
                    run.cfg.name.split(".", 1)[-1],
                    workdir,
                    weights[i - 1],
                    run.cfg.train.steps,
                )
                try:
                    self._one(run, workdir)
                except (KeyboardInterrupt, SystemExit):
                    raise
                except Exception as e:  # one bad run must not lose the rest of the study
                    detail = "".join(traceback.format_exception_only(type(e), e)).strip()
                    self.reg.mark_failed(run.run_id, detail + "\n" + traceback.format_exc())
                    failed.append(run.cfg.name)
                    progress.bar.write(f"run {run.cfg.name} failed: {detail}")
                finally:
                    progress.end(weights[i - 1])
        finally:
            progress.close()
        return failed

    def _one(self, run: Any, workdir: Path) -> None:
        summary = _finished_summary(workdir, run.cfg.train.steps)
        if summary is None:
            self.reg.mark_running(run.run_id)
            workdir.mkdir(parents=True, exist_ok=True)
            summary = self.train_fn(run.cfg, workdir)
        summary = _evaluate_if_missing(run.cfg, workdir, summary)
        self.reg.finish(run.run_id, summary, read_metrics_jsonl(workdir / "metrics.jsonl"))


# ----------------------------------------------------------------------------- cluster

SLURM_TEMPLATE = """#!/bin/bash
# Study $study: $n_runs runs as one SLURM job array (one run per array task).
# Rendered by `scalestudy launch --executor slurm`; submit with `sbatch $script`.
#SBATCH --job-name=$study
#SBATCH --array=0-$last_index$throttle
#SBATCH --nodes=$nodes
#SBATCH --gpus-per-node=$gpus
#SBATCH --cpus-per-task=$cpus
#SBATCH --time=$time
#SBATCH --output=$out/slurm/%x-%A_%a.out
$extra_sbatch
set -euo pipefail
$setup
RUN_DIR=$$(sed -n "$$((SLURM_ARRAY_TASK_ID + 1))p" $runs_list)
# Every task of a multi-node run joins one JAX job (JAX reads the SLURM environment).
export SCALESTUDY_DISTRIBUTED=auto
# Resumes from RUN_DIR's checkpoints when the task is requeued or re-submitted.
srun $scalestudy train --config "$$RUN_DIR/config.yaml" --workdir "$$RUN_DIR"
"""

SLURM_COLLECT = """#!/bin/bash
# Collects the finished runs into the registry, then fits, plots and writes the report.
#SBATCH --job-name=$study-collect
#SBATCH --time=02:00:00
#SBATCH --output=$out/slurm/%x-%j.out
$extra_sbatch
set -euo pipefail
$setup
$scalestudy study --spec $spec --out $out
"""

TPU_TEMPLATE = """#!/bin/bash
# Study $study on a TPU VM ($accelerator, $zone): $n_runs runs, one after another, each
# using the whole slice (every worker runs the same command; JAX joins them into one mesh).
# Rendered by `scalestudy launch --executor tpu`; run this file to execute it.
set -euo pipefail
$create
gcloud compute tpus tpu-vm ssh $name $project_flag--zone=$zone --worker=all --command=$remote
# Collect into the registry, fit, plot and report (worker 0 only).
gcloud compute tpus tpu-vm ssh $name $project_flag--zone=$zone --worker=0 --command=$collect
"""


def _write_run_configs(runs: list, out: Path) -> Path:
    """Write each run's resolved config.yaml; returns the file listing run directories."""
    lines = []
    for run in runs:
        workdir = out / "runs" / run.dirname
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "config.yaml").write_text(to_yaml(run.cfg))
        lines.append(str(workdir.resolve()))
    listing = out / "runs.txt"
    listing.write_text("\n".join(lines) + "\n")
    return listing


def render_slurm(study: StudySpec, spec: Path, runs: list, out: Path) -> tuple[str, str]:
    """(array script, collect script) for a study's runs."""
    s = study.slurm
    extra = [f"#SBATCH --partition={s.partition}"] if s.partition else []
    extra += [f"#SBATCH --account={s.account}"] if s.account else []
    extra += [f"#SBATCH --mem={s.mem}"] if s.mem else []
    common = {
        "study": study.name,
        "out": shlex.quote(str(out.resolve())),
        "extra_sbatch": "\n".join(extra),
        "setup": "\n".join(s.setup),
        "scalestudy": s.scalestudy,
    }
    array = Template(SLURM_TEMPLATE).substitute(
        common,
        n_runs=len(runs),
        script=shlex.quote(str(out / "study.sbatch")),
        last_index=len(runs) - 1,
        throttle=f"%{s.max_parallel}" if s.max_parallel else "",
        nodes=s.nodes,
        gpus=s.gpus_per_node,
        cpus=s.cpus_per_task,
        time=s.time,
        runs_list=shlex.quote(str(out.resolve() / "runs.txt")),
    )
    collect = Template(SLURM_COLLECT).substitute(common, spec=shlex.quote(str(spec.resolve())))
    return array, collect


def render_tpu(study: StudySpec, spec: Path, runs: list, out: Path) -> str:
    """The gcloud commands that create a TPU VM (or queued resource) and run the study."""
    t = study.tpu
    project_flag = f"--project={t.project} " if t.project else ""
    spot = " --spot" if t.spot else ""
    if t.queued:
        create = (
            f"gcloud compute tpus queued-resources create {t.name}-qr {project_flag}"
            f"--zone={t.zone} --node-id={t.name} --accelerator-type={t.accelerator_type} "
            f"--runtime-version={t.runtime_version}{spot}\n"
            f"until gcloud compute tpus queued-resources describe {t.name}-qr {project_flag}"
            f"--zone={t.zone} --format='value(state.state)' | grep -q ACTIVE; do sleep 60; done"
        )
    else:
        create = (
            f"gcloud compute tpus tpu-vm create {t.name} {project_flag}--zone={t.zone} "
            f"--accelerator-type={t.accelerator_type} --version={t.runtime_version}{spot}"
        )
    # Each worker first writes the run configs itself (deterministic: the same files everywhere).
    # Every worker joins one JAX job (JAX reads the TPU slice's topology).
    steps = [f"cd {t.repo_dir}", *t.setup, "export SCALESTUDY_DISTRIBUTED=auto"]
    steps.append(
        f"{t.scalestudy} launch --spec {shlex.quote(str(spec))} --executor tpu "
        f"--out {shlex.quote(str(out))} > /dev/null"
    )
    for run in runs:
        workdir = out / "runs" / run.dirname
        steps.append(
            f"{t.scalestudy} train --config {shlex.quote(str(workdir / 'config.yaml'))} "
            f"--workdir {shlex.quote(str(workdir))}"
        )
    collect = [f"cd {t.repo_dir}", *t.setup]
    collect.append(
        f"{t.scalestudy} study --spec {shlex.quote(str(spec))} --out {shlex.quote(str(out))}"
    )
    return Template(TPU_TEMPLATE).substitute(
        study=study.name,
        accelerator=t.accelerator_type,
        zone=t.zone,
        n_runs=len(runs),
        create=create,
        name=t.name,
        project_flag=project_flag,
        remote=shlex.quote(" && ".join(steps)),
        collect=shlex.quote(" && ".join(collect)),
    )


def launch(
    study: StudySpec, spec: Path, runs: list, executor: str, out: Path, *, submit: bool
) -> str:
    """Write run configs and the executor's script under `out`; submit it if asked."""
    out.mkdir(parents=True, exist_ok=True)
    _write_run_configs(runs, out)
    if executor == "slurm":
        array, collect = render_slurm(study, spec, runs, out)
        (out / "slurm").mkdir(exist_ok=True)
        (out / "study.sbatch").write_text(array)
        (out / "collect.sbatch").write_text(collect)
        text = array + "\n# --- collect.sbatch (submitted after the array) ---\n" + collect
        if submit:
            job = _submit(["sbatch", "--parsable", str(out / "study.sbatch")])
            _submit(["sbatch", f"--dependency=afterany:{job}", str(out / "collect.sbatch")])
        return text
    if executor == "tpu":
        script = render_tpu(study, spec, runs, out)
        (out / "study_tpu.sh").write_text(script)
        if submit:
            _submit(["bash", str(out / "study_tpu.sh")])
        return script
    raise LaunchError(
        f"executor: got {executor!r}; accepted: slurm, tpu (local: `scalestudy study`)"
    )


def _submit(cmd: list[str]) -> str:
    try:
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise LaunchError(
            f"{cmd[0]} not found on PATH; run without --submit to print the script"
        ) from None
    except subprocess.CalledProcessError as e:
        raise LaunchError(f"{' '.join(cmd)} failed ({e.returncode}): {e.stderr.strip()}") from None
    return done.stdout.strip().split(";")[0]
