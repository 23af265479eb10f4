"""Cluster launches of a study's stages after pretraining (adaptation, runs from scratch,
finetuning), without a cluster: the rendered scripts run against stand-in `sbatch`, `srun`
and `gcloud` commands that log their arguments (tests/study/test_slurm.py runs a real
scheduler)."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from scalestudy.cli.main import main
from scalestudy.study.record.registry import load_runs
from scalestudy.study.run import after_pretraining, main_job

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "configs" / "studies" / "wang2022_smoke.yaml"


def staged_spec(folder: Path, **slurm) -> Path:
    """The smoke Wang spec at 4 + 1 + 2 steps, its relative paths made absolute, in `folder`."""
    spec = yaml.safe_load(SMOKE.read_text())
    spec["budget"]["steps"] = 4
    spec["stages"]["finetune"]["steps"] = 2
    spec["stages"]["finetune"]["mixture"] = str(
        SMOKE.parent / spec["stages"]["finetune"]["mixture"]
    )
    spec["stages"]["published"] = str(SMOKE.parent / spec["stages"]["published"])
    spec["slurm"] = {"gpus_per_node": 0, **slurm}
    spec["tpu"] = {"name": "wang", "zone": "us-central2-b"}
    path = folder / "wang.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _bin(tmp_path: Path, scripts: dict[str, str]) -> dict[str, str]:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        (bindir / name).write_text("#!/bin/bash\n" + body)
        (bindir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "LOG": str(tmp_path / "log")}


def _log(tmp_path: Path) -> list[str]:
    path = tmp_path / "log"
    return path.read_text().splitlines() if path.exists() else []


def _planned(spec: Path, out: Path) -> list[after_pretraining.StageRun]:
    study = main_job.load_study(spec)
    return after_pretraining.plan_stages(study, spec.parent, out)


def test_stage_tiers_put_every_run_after_its_parent(tmp_path):
    spec = staged_spec(tmp_path)
    planned = _planned(spec, tmp_path / "o")
    tiers = after_pretraining.tiers(planned)
    assert sorted(r.name for t in tiers for r in t) == sorted(r.name for r in planned)
    first = {r.name for r in tiers[0]}
    for r in tiers[0]:  # needs the pretrained runs only
        assert r.parent is None or r.parent.parent.name == "runs"
    # The finetuning of adapted and from-scratch runs waits for them (the second group).
    assert len(tiers) == 2 and len(tiers[1]) == 4
    assert all(r.stage == "finetune" and r.parent.name in first for r in tiers[1])


FAKE_SBATCH = """
n=$(( $(wc -l < "$LOG" 2>/dev/null || echo 0) + 101 ))
echo "sbatch $*" >> "$LOG"
echo "$n;cluster"
"""


def test_slurm_launch_submits_each_stage_after_its_parents(tmp_path, monkeypatch, capsys):
    spec = staged_spec(tmp_path)
    out = tmp_path / "study"
    env = _bin(tmp_path, {"sbatch": FAKE_SBATCH})
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("LOG", env["LOG"])
    argv = ["launch", "--spec", str(spec), "--executor", "slurm", "--out", str(out), "--submit"]
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert "array job 101, stages1 job 102, stages2 job 103, collect job 104" in said
    log = _log(tmp_path)
    assert log == [
        f"sbatch --parsable {out / 'study.sbatch'}",
        f"sbatch --parsable --dependency=afterok:101 --kill-on-invalid-dep=yes "
        f"{out / 'stages1.sbatch'}",
        f"sbatch --parsable --dependency=afterok:102 --kill-on-invalid-dep=yes "
        f"{out / 'stages2.sbatch'}",
        f"sbatch --parsable --dependency=afterany:101:102:103 {out / 'collect.sbatch'}",
    ]
    tiers = after_pretraining.tiers(_planned(spec, out))
    for k, tier in enumerate(tiers, start=1):  # one array task per stage run, in plan order
        listed = (out / f"stages{k}.txt").read_text().split()
        assert listed == [str((out / "stages" / r.name).resolve()) for r in tier]
        script = (out / f"stages{k}.sbatch").read_text()
        assert f"#SBATCH --array=0-{len(tier) - 1}" in script
        assert f"#SBATCH --job-name=wang2022_smoke-stages{k}" in script
        assert "#SBATCH --requeue" in script and "#SBATCH --signal=B:TERM@" in script


FAKE_SRUN = """
while [[ "$1" == --* ]]; do shift; done
exec "$@"
"""
FAKE_SCALESTUDY = """
echo "scalestudy $*" >> "$LOG"
exit "${EXIT:-0}"
"""


@pytest.mark.parametrize("code", ["0", "143"])
def test_slurm_stage_task_runs_its_stage_run_and_requeues_on_sigterm(tmp_path, code):
    env = _bin(
        tmp_path,
        {
            "srun": FAKE_SRUN,
            "fake_scalestudy": FAKE_SCALESTUDY,
            "scontrol": 'echo "scontrol $*" >> "$LOG"',
        },
    )
    spec = staged_spec(tmp_path, scalestudy="fake_scalestudy")
    out = tmp_path / "study"
    assert main(["launch", "--spec", str(spec), "--executor", "slurm", "--out", str(out)]) == 0
    env |= {"SLURM_ARRAY_JOB_ID": "9", "SLURM_ARRAY_TASK_ID": "2", "SLURM_JOB_ID": "9"}
    done = subprocess.run(
        ["bash", str(out / "stages2.sbatch")],
        env=env | {"EXIT": code},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == int(code), done.stderr
    third = after_pretraining.tiers(_planned(spec, out))[1][2]
    log = _log(tmp_path)
    assert log[0] == (
        f"scalestudy study --spec {spec.resolve()} --out {out.resolve()} --stage-run {third.name}"
    )
    assert log[1:] == (["scontrol requeue 9_2"] if code == "143" else [])


FAKE_GCLOUD = """
echo "gcloud $*" >> "$LOG"
case "$*" in
  *"queued-resources describe"*--format*) echo ACTIVE ;;
  *"tpu-vm ssh"*) [[ -n "${FAIL:-}" && "$*" == *"$FAIL"* ]] && exit 1 ;;
esac
exit 0
"""


def test_tpu_script_runs_the_stages_after_pretraining_in_order(tmp_path):
    spec = staged_spec(tmp_path)
    out = tmp_path / "study"
    assert main(["launch", "--spec", str(spec), "--executor", "tpu", "--out", str(out)]) == 0
    planned = [r for t in after_pretraining.tiers(_planned(spec, out)) for r in t]
    bad = planned[-4]  # the finetuning of an adapted run (no stage run's name extends it)
    env = _bin(tmp_path, {"gcloud": FAKE_GCLOUD}) | {"FAIL": f"--stage-run {bad.name}"}
    done = subprocess.run(
        ["bash", str(out / "study_tpu.sh")], env=env, capture_output=True, text=True, timeout=30
    )
    ssh = [line for line in _log(tmp_path) if "tpu-vm ssh" in line]
    runs = main_job.expand(main_job.load_study(spec), spec.parent)
    assert len(ssh) == 1 + len(runs) + len(planned) + 1  # prepare, runs, stage runs, collect
    stage_lines = ssh[1 + len(runs) : -1]
    for r, line in zip(planned, stage_lines, strict=True):  # every stage, parents first
        assert f"study --spec {spec} --out {out} --stage-run {r.name}" in line
        assert "--worker=all" in line and "SCALESTUDY_DISTRIBUTED=auto" in line
    assert "study --collect" in ssh[-1]
    # A failed stage run stops neither the others nor the collect step; the script says so.
    assert done.returncode == 1
    assert f"1 step(s) failed: finetune {bad.name}" in done.stderr


def test_a_stage_run_that_is_not_planned_or_has_no_parent_is_one_line(tmp_path, capsys):
    spec = staged_spec(tmp_path)
    out = tmp_path / "study"
    argv = ["study", "--spec", str(spec), "--out", str(out), "--stage-run"]
    assert main([*argv, "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'nope' is not a stage run of study wang2022_smoke" in err[0]
    first = _planned(spec, out)[0]
    assert main([*argv, first.name]) == 2  # its parent was never trained
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(first.parent) in err[0], err
    assert main([*argv, first.name, "--collect"]) == 2
    assert "without --collect/--dry-run" in capsys.readouterr().err
    assert not (out / "stages").exists()


def _finish(workdir: Path, steps: int) -> None:
    """A finished run on disk as a cluster job leaves it (summary only)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "metrics.jsonl").write_text(f'{{"step": {steps}, "train/loss": 2.0}}\n')
    summary = {"steps": steps, "complete": True, "tokens": 10.0 * steps, "flops": 1e6 * steps}
    summary |= {"final_val_loss": 2.0, "final_train_loss": 2.0, "eval": {}}
    (workdir / "summary.json").write_text(json.dumps(summary))


def test_collect_records_finished_stage_runs_and_lists_the_rest(tmp_path, capsys):
    """`study --collect` records what stage jobs finished (lineage and own counts) and trains
    nothing: a missing stage run is listed and the command fails."""
    spec = staged_spec(tmp_path)
    out = tmp_path / "study"
    runs = main_job.expand(main_job.load_study(spec), spec.parent)
    for r in runs:
        summary = {"steps": 4, "complete": True, "tokens": 40.0, "flops": 4e6}
        summary |= {"final_val_loss": 2.0, "final_train_loss": 2.0}
        summary |= {"eval": {"synthetic_probes/acc": 0.5, "synthetic_probes/n": 8}}
        _finish(out / "runs" / r.dirname, 4)
        (out / "runs" / r.dirname / "summary.json").write_text(json.dumps(summary))
    planned = _planned(spec, out)
    adapt = next(r for r in planned if r.stage == "adapt")
    _finish(out / "stages" / adapt.name, adapt.cfg.train.steps)  # 4 + 1 steps
    argv = ["study", "--spec", str(spec), "--out", str(out), "--collect"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert f"1 of {len(planned)} stage runs complete" in captured.out
    assert f"{len(planned) - 1} stage run(s) are not complete" in captured.err
    rows = {r["name"]: r for r in load_runs(out, stages=True)}
    done = rows[adapt.name]
    assert done["status"] == "done" and done["stage"] == "adapt"
    assert done["parent_step"] == 4 and done["steps"] == 1
    assert done["tokens"] == 10.0  # its own share: 50 in all, 40 of them the parent's
    assert all(rows[r.name]["status"] == "pending" for r in planned if r is not adapt)
    assert (out / after_pretraining.TABLE).is_file()
