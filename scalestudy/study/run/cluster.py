"""Cluster launchers: a study rendered as a SLURM job array or a TPU VM script, and submitted.

Both render real scripts, written beside the study and printed; they are submitted only when
asked. Every run trains with `scalestudy train --eval` in its own job, so its zero-shot
evaluation runs on the run's own mesh; a final collect step (`scalestudy study --collect`)
records the runs' summaries in the registry, fits and reports, and never trains or evaluates.

What the scripts guarantee:
- SLURM: a task warned by SIGTERM (`--signal=B:TERM@N` before its time limit, or any
  `scancel --signal=TERM`) passes the signal to `scalestudy train`, which saves a checkpoint
  and exits 143; the task then requeues itself and resumes from that checkpoint. Preempted
  tasks are requeued by SLURM (`--requeue`). The collect job runs once every task has ended
  (`afterany`), whatever their outcome.
- TPU: a failed run does not stop the others or the collect step; failed runs are listed at
  the end and the script exits non-zero. A queued resource that turns FAILED or SUSPENDED, or
  is not ACTIVE within `tpu.queue_timeout_minutes`, ends the script with an error.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from string import Template
from typing import Any

from scalestudy.config.errors import ScalestudyError
from scalestudy.config.experiment import to_yaml
from scalestudy.study.plan.spec import StudySpec
from scalestudy.train.rundir import layout as rundir


class LaunchError(ScalestudyError):
    """A cluster launch could not be rendered or submitted."""


EXIT_SIGTERM = 128 + 15  # `scalestudy train` after saving a checkpoint on SIGTERM

SLURM_TEMPLATE = """#!/bin/bash
# Study $study: $n_runs runs as one SLURM job array (one run per array task).
# Rendered by `scalestudy launch --executor slurm`; submit with `sbatch $script`.
#SBATCH --job-name=$study
#SBATCH --array=0-$last_index$throttle
#SBATCH --nodes=$nodes
#SBATCH --ntasks-per-node=1
$gpus#SBATCH --cpus-per-task=$cpus
#SBATCH --time=$time
#SBATCH --output=$out/slurm/%x-%A_%a.out
#SBATCH --open-mode=append
# Requeue on preemption or node failure; $grace s before the time limit SIGTERM this script.
#SBATCH --requeue
#SBATCH --signal=B:TERM@$grace
$extra_sbatch
set -euo pipefail
$setup
RUN_DIR=$$(sed -n "$$((SLURM_ARRAY_TASK_ID + 1))p" $runs_list)
# This task alone (the bare SLURM_JOB_ID of one task is also the whole array's id).
TASK="$${SLURM_ARRAY_JOB_ID}_$${SLURM_ARRAY_TASK_ID}"
echo "run $$RUN_DIR: attempt $$(($${SLURM_RESTART_COUNT:-0} + 1)) as task $$TASK"
# Every task of a multi-node run joins one JAX job (JAX reads the SLURM environment).
export SCALESTUDY_DISTRIBUTED=auto
# srun kills its step when it gets SIGTERM itself, so the warning goes to the step's tasks:
# `scalestudy train` then saves a checkpoint and exits $exit_sigterm.
trap 'scancel --signal=TERM "$$TASK" || true' TERM
# Trains the task's run (resuming from its checkpoints), then evaluates it zero-shot on its mesh.
srun --kill-on-bad-exit=1 $command &
step=$$!
# A trapped signal interrupts `wait`: wait until the step has really ended, then take its
# exit status (bash keeps it for `wait` even once the step has been reaped).
while kill -0 "$$step" 2>/dev/null; do
  wait "$$step" || true
done
status=0
wait "$$step" || status=$$?
if [ "$$status" -eq $exit_sigterm ]; then
  echo "run $$RUN_DIR stopped by SIGTERM with a checkpoint saved: requeueing to resume it"
  scontrol requeue "$$TASK" || echo "requeue refused (cancelled?); the run stays unfinished"
fi
exit "$$status"
"""

SLURM_COLLECT = """#!/bin/bash
# Collects the runs into the registry, then fits, plots and writes the report. It never
# trains or evaluates: missing or unfinished runs are listed, and the job then fails.
#SBATCH --job-name=$study-collect
#SBATCH --ntasks=1
#SBATCH --time=02:00:00
#SBATCH --output=$out/slurm/%x-%j.out
$extra_sbatch
set -euo pipefail
$setup
$scalestudy study --collect --spec $spec --out $out
"""

TPU_TEMPLATE = """#!/bin/bash
# Study $study on a TPU VM ($accelerator, $zone): $n_runs runs, one after another, each
# using the whole slice (every worker runs the same command; JAX joins them into one mesh),
# each trained then evaluated zero-shot on that mesh, then the collect step on worker 0.
# Rendered by `scalestudy launch --executor tpu`; run this file to execute it.
# A failed run does not stop the others or the collect step; failures are listed at the end
# and the script exits non-zero. Running it again resumes unfinished runs.
set -uo pipefail
LOCATION=($location)

$create
failed=()

# on_slice LABEL WORKER COMMAND: run COMMAND on the slice's WORKER(s); record a failure.
on_slice() {
  echo "== $$1"
  if ! gcloud compute tpus tpu-vm ssh $name "$${LOCATION[@]}" --worker="$$2" --command="$$3"; then
    echo "error: $$1 failed" >&2
    failed+=("$$1")
    return 1
  fi
}

# Each worker writes the run configs itself (deterministic: the same files everywhere).
if on_slice prepare all $prepare; then
$runs
else
  echo "error: the workers could not be prepared; no run was started" >&2
fi
on_slice collect 0 $collect

if [ "$${#failed[@]}" -gt 0 ]; then
  echo "error: $${#failed[@]} step(s) failed: $${failed[*]}" >&2
  echo "fix the cause and run this script again: finished runs are kept" >&2
  exit 1
fi
echo "study $study: all $n_runs runs finished and collected"
"""

QUEUED_CREATE = """# Create the queued resource unless it exists, then wait until it is ACTIVE.
QR=$qr
if ! gcloud compute tpus queued-resources describe "$$QR" "$${LOCATION[@]}" >/dev/null 2>&1; then
  gcloud compute tpus queued-resources create "$$QR" "$${LOCATION[@]}" --node-id=$name \\
    --accelerator-type=$accelerator --runtime-version=$runtime$spot || exit 1
fi
deadline=$$((SECONDS + $timeout_s))
while true; do
  state=$$(gcloud compute tpus queued-resources describe "$$QR" "$${LOCATION[@]}" \\
    --format='value(state.state)') || state=UNKNOWN
  case "$$state" in
    ACTIVE) break ;;
    FAILED | SUSPENDING | SUSPENDED | DELETING)
      echo "error: queued resource $$QR is $$state; delete it" \\
        "(gcloud compute tpus queued-resources delete $$QR $${LOCATION[*]} --force)" \\
        "and run this script again" >&2
      exit 1 ;;
  esac
  if [ "$$SECONDS" -ge "$$deadline" ]; then
    echo "error: queued resource $$QR is still $$state after $timeout_min min" \\
      "(tpu.queue_timeout_minutes); giving up" >&2
    exit 1
  fi
  sleep $poll_s
done"""

VM_CREATE = """# Create the TPU VM unless it exists.
if ! gcloud compute tpus tpu-vm describe $name "$${LOCATION[@]}" >/dev/null 2>&1; then
  gcloud compute tpus tpu-vm create $name "$${LOCATION[@]}" --accelerator-type=$accelerator \\
    --version=$runtime$spot || exit 1
fi"""


def write_run_configs(runs: list, out: Path) -> Path:
    """Write each run's resolved config.yaml; returns the file listing run directories."""
    lines = []
    for run in runs:
        workdir = out / "runs" / run.dirname
        workdir.mkdir(parents=True, exist_ok=True)
        rundir.write_config(workdir, to_yaml(run.cfg))
        lines.append(str(workdir.resolve()))
    listing = out / "runs.txt"
    listing.write_text("\n".join(lines) + "\n")
    return listing


def _common(study: StudySpec, out: Path, job_name: str) -> dict:
    s = study.slurm
    extra = [f"#SBATCH --partition={s.partition}"] if s.partition else []
    extra += [f"#SBATCH --account={s.account}"] if s.account else []
    extra += [f"#SBATCH --mem={s.mem}"] if s.mem else []
    return {
        "study": job_name,
        "out": shlex.quote(str(out.resolve())),
        "extra_sbatch": "\n".join(extra),
        "setup": "\n".join(s.setup),
        "scalestudy": s.scalestudy,
    }


def render_slurm(study: StudySpec, spec: Path, runs: list, out: Path) -> tuple[str, str]:
    """(array script, collect script) for a study's runs."""
    common = _common(study, out, study.name)
    # Trains (resuming from RUN_DIR's checkpoints), then evaluates zero-shot on the run's mesh.
    command = f'{study.slurm.scalestudy} train --eval --config "$RUN_DIR/config.yaml" \\\n'
    command += '  --workdir "$RUN_DIR"'
    array = _array(study, common, out / "study.sbatch", out / "runs.txt", len(runs), command)
    collect = Template(SLURM_COLLECT).substitute(common, spec=shlex.quote(str(spec.resolve())))
    return array, collect


def _array(study: StudySpec, common: dict, script: Path, listing: Path, n: int, command: str):
    s = study.slurm
    return Template(SLURM_TEMPLATE).substitute(
        common,
        n_runs=n,
        script=shlex.quote(str(script)),
        last_index=n - 1,
        throttle=f"%{s.max_parallel}" if s.max_parallel else "",
        nodes=s.nodes,
        gpus=f"#SBATCH --gpus-per-node={s.gpus_per_node}\n" if s.gpus_per_node else "",
        cpus=s.cpus_per_task,
        time=s.time,
        grace=s.signal_seconds,
        exit_sigterm=EXIT_SIGTERM,
        runs_list=shlex.quote(str(listing.resolve())),
        command=command,
    )


def render_slurm_stages(
    study: StudySpec, spec: Path, tiers: list[list], out: Path
) -> list[tuple[str, str]]:
    """(file name, array script) per group of stage runs (`pipeline.tiers`): one task per
    stage run, `scalestudy study --stage-run NAME`; writes each group's list of directories."""
    s = study.slurm
    scripts = []
    spec_q, out_q = shlex.quote(str(spec.resolve())), shlex.quote(str(out.resolve()))
    # The task's run is named by its directory's last part; the parent's run is on disk.
    command = (
        f'{s.scalestudy} study --spec {spec_q} --out {out_q} --stage-run "$(basename "$RUN_DIR")"'
    )
    for k, group in enumerate(tiers, start=1):
        listing = out / f"stages{k}.txt"
        listing.write_text("".join(f"{(out / 'stages' / r.name).resolve()}\n" for r in group))
        common = _common(study, out, f"{study.name}-stages{k}")
        name = f"stages{k}.sbatch"
        scripts.append((name, _array(study, common, out / name, listing, len(group), command)))
    return scripts


def _tpu_create(t: Any, fields: dict[str, str]) -> str:
    """The script's step that creates the TPU VM: a queued resource, or the VM at once."""
    if not t.queued:
        return Template(VM_CREATE).substitute(fields)
    timeout_s = max(1, round(t.queue_timeout_minutes * 60))
    return Template(QUEUED_CREATE).substitute(
        fields,
        qr=shlex.quote(f"{t.name}-qr"),
        timeout_s=timeout_s,
        timeout_min=f"{t.queue_timeout_minutes:g}",
        poll_s=min(60, timeout_s),
    )


def _tpu_train_lines(
    t: Any, head: list[str], spec: Path, out: Path, runs: list, stage_runs: list
) -> list[str]:
    """One `on_slice` line per run, then per stage run: each trains on every worker."""
    q = shlex.quote
    lines = []
    for run in runs:
        workdir = out / "runs" / run.dirname
        train = [
            *head,
            "export SCALESTUDY_DISTRIBUTED=auto",
            f"{t.scalestudy} train --eval --config {q(str(rundir.config_path(workdir)))} "
            f"--workdir {q(str(workdir))}",
        ]
        label = f"run {run.cfg.name.split('.', 1)[-1]}"
        lines.append(f"  on_slice {q(label)} all {q(' && '.join(train))}")
    for r in stage_runs:  # after their parents: a failed parent fails them in one line
        train = [
            *head,
            "export SCALESTUDY_DISTRIBUTED=auto",
            f"{t.scalestudy} study --spec {q(str(spec))} --out {q(str(out))} "
            f"--stage-run {q(r.name)}",
        ]
        lines.append(f"  on_slice {q(f'{r.stage} {r.name}')} all {q(' && '.join(train))}")
    return lines


def render_tpu(study: StudySpec, spec: Path, runs: list, out: Path, stage_runs: list = ()) -> str:
    """A bash script: create (or reuse) the TPU VM, train and evaluate every run, then every
    stage run (`stage_runs`, parents first), collect."""
    t = study.tpu
    q = shlex.quote
    location = [f"--zone={t.zone}"] + ([f"--project={t.project}"] if t.project else [])
    fields = {
        "name": q(t.name),
        "accelerator": q(t.accelerator_type),
        "runtime": q(t.runtime_version),
        "spot": " --spot" if t.spot else "",
    }
    create = _tpu_create(t, fields)
    head = [f"cd {t.repo_dir}", *t.setup]  # repo_dir unquoted: `~` expands on the worker
    prepare = [
        *head,
        f"{t.scalestudy} launch --spec {q(str(spec))} --executor tpu --out {q(str(out))} "
        "> /dev/null",
    ]
    lines = _tpu_train_lines(t, head, spec, out, runs, stage_runs)
    collect = [
        *head,
        f"{t.scalestudy} study --collect --spec {q(str(spec))} --out {q(str(out))}",
    ]
    return Template(TPU_TEMPLATE).substitute(
        fields,
        study=study.name,
        zone=t.zone,
        n_runs=len(runs) + len(stage_runs),
        location=" ".join(q(a) for a in location),
        create=create,
        prepare=q(" && ".join(prepare)),
        runs="\n".join(lines),
        collect=q(" && ".join(collect)),
    )


def launch(
    study: StudySpec,
    spec: Path,
    runs: list,
    executor: str,
    out: Path,
    *,
    submit: bool,
    stage_tiers: list[list] = (),
) -> str:
    """Write run configs and the executor's scripts under `out`; submit them if asked.
    `stage_tiers`: the stage runs after pretraining, grouped as `pipeline.tiers` does; each
    group runs once the one before it (the first: pretraining) has succeeded."""
    if executor not in ("slurm", "tpu"):
        raise LaunchError(
            f"executor: got {executor!r}; accepted: slurm, tpu (local: `scalestudy study`)"
        )
    if out.exists() and not out.is_dir():
        raise LaunchError(
            f"--out {out} is a file; give a directory for the run configs and scripts"
        )
    out.mkdir(parents=True, exist_ok=True)
    write_run_configs(runs, out)
    if executor == "slurm":
        array, collect = render_slurm(study, spec, runs, out)
        staged = render_slurm_stages(study, spec, [t for t in stage_tiers if t], out)
        (out / "slurm").mkdir(exist_ok=True)
        (out / "study.sbatch").write_text(array)
        (out / "collect.sbatch").write_text(collect)
        text = array
        for name, script in staged:
            (out / name).write_text(script)
            text += f"\n# --- {name} (submitted after the job before it succeeded) ---\n{script}"
        text += "\n# --- collect.sbatch (submitted after every job above ended) ---\n" + collect
        if submit:
            text += "\n# submitted: " + _submit_slurm(out, [n for n, _ in staged])
        return text
    script = render_tpu(study, spec, runs, out, [r for tier in stage_tiers for r in tier])
    (out / "study_tpu.sh").write_text(script)
    if submit:  # runs for the whole study: its progress goes straight to the terminal
        _submit(["bash", str(out / "study_tpu.sh")], capture=False)
    return script


def _submit_slurm(out: Path, stage_scripts: list[str]) -> str:
    """Submit the pretraining array, each stage array after the one before it succeeded
    (`afterok`: every task of that array completed; a failure cancels the rest of the chain),
    and the collect job once every job has ended. Returns what was submitted."""
    job = _submit(["sbatch", "--parsable", str(out / "study.sbatch")])
    jobs, said = [job], [f"array job {job}"]
    for name in stage_scripts:
        job = _submit(
            [
                "sbatch",
                "--parsable",
                f"--dependency=afterok:{job}",
                "--kill-on-invalid-dep=yes",
                str(out / name),
            ]
        )
        jobs.append(job)
        said.append(f"{name.removesuffix('.sbatch')} job {job}")
    after = ":".join(jobs)
    done = _submit(
        ["sbatch", "--parsable", f"--dependency=afterany:{after}", str(out / "collect.sbatch")]
    )
    return ", ".join([*said, f"collect job {done}"])


def _submit(cmd: list[str], capture: bool = True) -> str:
    try:
        done = subprocess.run(cmd, check=True, capture_output=capture, text=True)
    except FileNotFoundError:
        raise LaunchError(
            f"{cmd[0]} not found on PATH; run without --submit to print the script"
        ) from None
    except subprocess.CalledProcessError as e:
        detail = (e.stderr or e.stdout or "").strip()
        raise LaunchError(f"{' '.join(cmd)} failed ({e.returncode}): {detail}") from None
    return (done.stdout or "").strip().split(";")[0]
