"""Cluster launch scripts and collection, without a cluster.

The rendered scripts run here against stand-ins for `srun`/`scancel`/`scontrol` and `gcloud`
(small shell scripts on PATH that log their arguments), which checks what the scripts do with
signals, failures and queued-resource states; tests/study/test_slurm.py runs a real scheduler.
"""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from scalestudy.config.experiment import load_config
from scalestudy.study.record.registry import load_runs
from scalestudy.study.run import cluster, main_job
from scalestudy.study.run.executors import StudyRunError

REPO = Path(__file__).resolve().parents[2]


def _render(spec: Path, out: Path, executor: str, overrides=()) -> str:
    study = main_job.load_study(spec, overrides)
    runs = main_job.expand(study, spec.parent)
    return cluster.launch(study, spec, runs, executor, out, submit=False)


def _bin(tmp_path: Path, scripts: dict[str, str]) -> dict[str, str]:
    """An environment whose PATH starts with `scripts` (name -> bash body)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        path = bindir / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "LOG": str(tmp_path / "log")}


def _log(tmp_path: Path) -> list[str]:
    path = tmp_path / "log"
    return path.read_text().splitlines() if path.exists() else []


# ----------------------------------------------------------------------------- script syntax


@pytest.mark.parametrize("spec", ["smoke.yaml", "wang2022.yaml"])
def test_rendered_scripts_pass_bash_n_and_shellcheck(spec, tmp_path):
    path = REPO / "configs" / "studies" / spec
    scripts = []
    for executor, overrides in (("slurm", ()), ("tpu", ()), ("tpu", ("tpu.queued=false",))):
        out = tmp_path / f"{executor}{len(overrides)}"
        _render(path, out, executor, overrides)
        names = ["study.sbatch", "collect.sbatch"] if executor == "slurm" else ["study_tpu.sh"]
        scripts += [out / n for n in names] + sorted(out.glob("stages*.sbatch"))
    scripts += sorted((REPO / "launch").glob("*.sh"))
    for script in scripts:
        done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert done.returncode == 0, f"{script.name}: {done.stderr}"
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (Debian package `shellcheck`; .ci/run installs it)")
    done = subprocess.run(
        ["shellcheck", "--shell=bash", *map(str, scripts)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_slurm_script_requests_requeue_and_a_warning_signal(tiny_spec, tmp_path):
    text = _render(tiny_spec, tmp_path / "o", "slurm", ["slurm.signal_seconds=300"])
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=B:TERM@300" in text
    assert "train --eval --config" in text and "study --collect --spec" in text
    assert "--gpus-per-node=8" in text
    assert "--gpus-per-node" not in _render(
        tiny_spec, tmp_path / "p", "slurm", ["slurm.gpus_per_node=0"]
    )


# ----------------------------------------------------------------------------- SLURM task

FAKE_TRAIN = """
echo $$ > "$PIDFILE"
trap 'echo "train got TERM" >> "$LOG"; exit 143' TERM
echo "train $*" >> "$LOG"
[ -n "${TRAIN_EXIT:-}" ] && exit "$TRAIN_EXIT"
while true; do sleep 0.1; done
"""
FAKE_SRUN = """
while [[ "$1" == --* ]]; do shift; done
exec "$@"
"""


def _task(tmp_path: Path, tiny_spec: Path, train_exit: str = "") -> subprocess.Popen:
    """The array script of a tiny study, as task 1 of array job 77, on fake SLURM commands.
    (SLURM gives one task of an array the array's own job id: here task 1.)"""
    env = _bin(
        tmp_path,
        {
            "srun": FAKE_SRUN,
            "fake_train": FAKE_TRAIN,
            "scancel": 'echo "scancel $*" >> "$LOG"; kill -TERM "$(cat "$PIDFILE")"',
            "scontrol": 'echo "scontrol $*" >> "$LOG"',
        },
    )
    out = tmp_path / "study"
    _render(tiny_spec, out, "slurm", ["slurm.scalestudy=fake_train"])
    env |= {"SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "1", "SLURM_JOB_ID": "77"}
    env |= {"PIDFILE": str(tmp_path / "pid")}
    env |= {"TRAIN_EXIT": train_exit}
    return subprocess.Popen(
        ["bash", str(out / "study.sbatch")], env=env, stdout=subprocess.PIPE, text=True
    )


def test_slurm_task_passes_sigterm_to_training_and_requeues(tiny_spec, tmp_path):
    proc = _task(tmp_path, tiny_spec)
    deadline = time.time() + 20
    while not (tmp_path / "pid").exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # what --signal=B:TERM@N delivers before the time limit
    stdout, _ = proc.communicate(timeout=20)
    log = _log(tmp_path)
    assert proc.returncode == 143, stdout
    # Only this task is signalled and requeued, never the whole array (job 77).
    assert "scancel --signal=TERM 77_1" in log and "train got TERM" in log
    assert log[-1] == "scontrol requeue 77_1"
    second = (tmp_path / "study" / "runs.txt").read_text().split()[1]
    assert f"train train --eval --config {second}/config.yaml --workdir {second}" in log


@pytest.mark.parametrize("code", ["0", "1"])
def test_slurm_task_requeues_only_after_sigterm(tiny_spec, tmp_path, code):
    proc = _task(tmp_path, tiny_spec, train_exit=code)
    proc.communicate(timeout=20)
    assert proc.returncode == int(code)
    assert not any(line.startswith("scontrol") for line in _log(tmp_path))


# ----------------------------------------------------------------------------- TPU script

FAKE_GCLOUD = """
echo "gcloud $*" >> "$LOG"
case "$*" in
  *"queued-resources describe"*--format*) echo "$QR_STATE" ;;
  *"tpu-vm ssh"*) [[ -n "${FAIL:-}" && "$*" == *"$FAIL"* ]] && exit 1 ;;
esac
exit 0
"""


def _tpu(tmp_path, tiny_spec, overrides=(), **env) -> subprocess.CompletedProcess:
    out = tmp_path / "study"
    _render(tiny_spec, out, "tpu", overrides)
    full = _bin(tmp_path, {"gcloud": FAKE_GCLOUD}) | {"QR_STATE": "ACTIVE", **env}
    try:
        return subprocess.run(
            ["bash", str(out / "study_tpu.sh")],
            env=full,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the TPU script kept waiting")


def test_tpu_failed_run_does_not_stop_the_others_or_collect(tiny_spec, tmp_path):
    runs = main_job.expand(main_job.load_study(tiny_spec), tiny_spec.parent)
    bad = runs[1]
    done = _tpu(tmp_path, tiny_spec, FAIL=bad.dirname + "/config.yaml")
    ssh = [line for line in _log(tmp_path) if "tpu-vm ssh" in line]
    assert len(ssh) == 1 + len(runs) + 1  # prepare, every run, collect
    assert all(f"{r.dirname}/config.yaml" in line for r, line in zip(runs, ssh[1:]))
    assert "study --collect" in ssh[-1] and "--worker=0" in ssh[-1]
    assert done.returncode == 1
    name = bad.cfg.name.split(".", 1)[-1]
    assert f"1 step(s) failed: run {name}" in done.stderr


def test_tpu_all_runs_ok_exits_zero(tiny_spec, tmp_path):
    done = _tpu(tmp_path, tiny_spec)
    assert done.returncode == 0, done.stderr
    assert "all 4 runs finished and collected" in done.stdout


@pytest.mark.parametrize("state", ["FAILED", "SUSPENDED"])
def test_tpu_queued_resource_failure_ends_the_script(tiny_spec, tmp_path, state):
    done = _tpu(tmp_path, tiny_spec, QR_STATE=state)
    assert done.returncode == 1
    assert f"queued resource scalestudy-qr is {state}" in done.stderr
    assert not any("tpu-vm ssh" in line for line in _log(tmp_path))


def test_tpu_queued_resource_wait_times_out(tiny_spec, tmp_path):
    t = time.time()
    done = _tpu(
        tmp_path, tiny_spec, ["tpu.queue_timeout_minutes=0.02"], QR_STATE="WAITING_FOR_RESOURCES"
    )
    assert done.returncode == 1 and time.time() - t < 15
    assert "still WAITING_FOR_RESOURCES after 0.02 min" in done.stderr
    assert not any("tpu-vm ssh" in line for line in _log(tmp_path))


# ----------------------------------------------------------------------------- collect


def _no_training_or_restoring(monkeypatch) -> list[str]:
    """Make any training or single-device restore at collection fail the test."""
    from scalestudy.evaluate import rank
    from scalestudy.train.rundir import saved_run

    calls: list[str] = []

    def forbidden(name):
        def f(*a, **k):
            calls.append(name)
            raise AssertionError(f"{name} called during collection")

        return f

    monkeypatch.setattr(saved_run, "restore_params", forbidden("restore_params"))
    monkeypatch.setattr(rank, "evaluate_run", forbidden("evaluate_run"))
    return calls


def _fake_run(workdir: Path, steps: int, logged: int, *, summary: bool, evaluated: bool) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    rows = [{"step": s, "train/loss": 4.0 / s, "tokens": 10.0 * s} for s in range(1, logged + 1)]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if logged:
        (workdir / "checkpoints" / str(logged)).mkdir(parents=True)
    if summary:
        out = {"steps": steps, "complete": True, "tokens": 40.0, "flops": 4e6}
        out |= {"final_val_loss": 1.5, "final_train_loss": 1.4, "eval": {}}
        if evaluated:
            out["eval"] = {"synthetic_probes/acc": 0.5, "synthetic_probes/n": 8}
        (workdir / "summary.json").write_text(json.dumps(out))


def test_collect_never_trains_and_reports_what_is_missing(tiny_spec, tmp_path, monkeypatch):
    calls = _no_training_or_restoring(monkeypatch)
    out = tmp_path / "study"
    runs = main_job.expand(main_job.load_study(tiny_spec), tiny_spec.parent)
    dirs = [out / "runs" / r.dirname for r in runs]
    _fake_run(dirs[0], 4, 4, summary=True, evaluated=True)
    _fake_run(dirs[1], 4, 4, summary=True, evaluated=False)
    _fake_run(dirs[2], 4, 2, summary=False, evaluated=False)  # preempted, never resumed

    def train(cfg, workdir):
        calls.append(cfg.name)
        raise AssertionError("collect trained a run")

    with pytest.raises(StudyRunError, match="3 of 4 run"):
        main_job.run_study(tiny_spec, out, train_fn=train, collect=True)
    assert calls == []
    rows = {r["run_id"]: r for r in load_runs(out)}
    first, second, third, fourth = (rows[r.run_id] for r in runs)
    assert first["status"] == second["status"] == "done"
    assert first["eval/synthetic_probes/acc"] == 0.5
    assert third["status"] == "failed" and "step 2 of 4" in third["error"]
    assert "latest checkpoint is step 2" in third["error"]
    assert fourth["status"] == "pending" and "never trained" in fourth["error"]
    assert "2 of 4 runs finished" in (out / "report.md").read_text()
    assert not (dirs[3] / "summary.json").exists() and not (dirs[3] / "checkpoints").exists()

    # Once the cluster has finished them, collecting again records them and succeeds; the
    # unevaluated run is still reported (collect evaluates nothing).
    _fake_run(dirs[2], 4, 4, summary=True, evaluated=True)
    _fake_run(dirs[3], 4, 4, summary=True, evaluated=True)
    with pytest.raises(StudyRunError, match="1 of 4 run"):
        main_job.run_study(tiny_spec, out, train_fn=train, collect=True)
    assert calls == []
    assert all(r["status"] == "done" for r in load_runs(out))


def test_local_study_does_not_evaluate_runs_trained_elsewhere(tiny_spec, tmp_path, monkeypatch):
    """A finished run without zero-shot results is reported, never restored here to evaluate."""
    calls = _no_training_or_restoring(monkeypatch)
    out = tmp_path / "study"
    runs = main_job.expand(main_job.load_study(tiny_spec), tiny_spec.parent)
    for run in runs:
        _fake_run(out / "runs" / run.dirname, 4, 4, summary=True, evaluated=run is not runs[0])
    main_job.run_study(tiny_spec, out, train_fn=lambda cfg, workdir: calls.append("train"))
    assert calls == []
    assert all(r["status"] == "done" for r in load_runs(out))


def test_cli_collect_exits_nonzero_with_a_message(tiny_spec, tmp_path, capsys):
    from scalestudy.cli import main as cli

    out = tmp_path / "study"
    assert cli.main(["study", "--collect", "--spec", str(tiny_spec), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "4 of 4 run(s) are not complete" in err and "never trains" in err
    assert not out.exists()  # refused before anything is written


# ----------------------------------------------------------------------------- eval in the job


@pytest.mark.slow
def test_train_eval_evaluates_on_the_runs_mesh(tiny_spec, tmp_path, monkeypatch):
    """`scalestudy train --eval` (what the cluster jobs run) scores with the parameters as
    they are sharded over the run's mesh; it never restores them onto one device. A run
    already trained without evaluation gets its results without training further."""
    import jax

    from scalestudy.cli import main as cli
    from scalestudy.evaluate import rank

    _no_training_or_restoring(monkeypatch)
    seen: list[int] = []
    original = rank.evaluate_params

    def spy(cfg, model, params, **kw):
        seen.append(len({d for x in jax.tree.leaves(params) for d in x.sharding.device_set}))
        return original(cfg, model, params, **kw)

    monkeypatch.setattr(rank, "evaluate_params", spy)
    run = main_job.expand(main_job.load_study(tiny_spec), tiny_spec.parent)[0]
    workdir = tmp_path / "run"
    cluster.write_run_configs([run], tmp_path)
    config = tmp_path / "runs" / run.dirname / "config.yaml"
    assert load_config(config).hash() == run.run_id
    assert cli.main(["train", "--config", str(config), "--workdir", str(workdir)]) == 0
    assert seen == [] and not json.loads((workdir / "summary.json").read_text())["eval"]
    rows = (workdir / "metrics.jsonl").read_text()

    assert cli.main(["train", "--eval", "--workdir", str(workdir)]) == 0
    summary = json.loads((workdir / "summary.json").read_text())
    assert 0.0 <= summary["eval"]["synthetic_probes/acc"] <= 1.0
    assert summary["steps"] == run.cfg.train.steps
    assert seen == [len(jax.devices())] and len(jax.devices()) == 8
    assert (workdir / "metrics.jsonl").read_text() == rows  # nothing trained again
