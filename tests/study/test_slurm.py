"""A tiny study launched on a real single-node SLURM cluster started here.

munged, slurmctld and slurmd run from a temporary directory on loopback ports (Debian's
`munge` and `slurm-wlm`; .ci/run installs them). The study's two runs go through
`scalestudy launch --executor slurm --submit`: a job array and a collect job. One task is
sent SIGTERM mid-training the way `--signal=B:TERM@N` warns before a time limit; it must save a
checkpoint, requeue itself and resume from that checkpoint. The test skips, with the reason,
only where the packages are missing or the daemons cannot start.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from scalestudy.cli import main as cli
from scalestudy.study.record.registry import load_runs
from scalestudy.study.run import main_job

REPO = Path(__file__).resolve().parents[2]
# One cluster at a time: under `pytest -n 2` these tests run one after another on one worker.
pytestmark = pytest.mark.xdist_group("slurm_cluster")
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "sinfo")

SLURM_CONF = """ClusterName=scalestudy-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
KillWait=15
MinJobAge=600
NodeName=localhost NodeHostname={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


# The states of a job that has ended for good (a requeued task passes through others).
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "DEADLINE"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


class Cluster:
    """munged + slurmctld + slurmd under `root`; every process it starts is ended by pid."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}

    def start(self) -> None:
        root = self.root
        for d in ("munge", "state", "spool"):
            (root / d).mkdir(mode=0o700)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        host = socket.gethostname().split(".")[0]
        conf = SLURM_CONF.format(
            host=host,
            root=root,
            ctld_port=_free_port(),
            slurmd_port=_free_port(),
            cpus=os.cpu_count() or 1,
        )
        (root / "slurm.conf").write_text(conf)
        m = root / "munge"
        self._spawn(
            "munged",
            [
                *("munged", "-F", "-f", f"--key-file={key}", f"--socket={m}/munge.socket"),
                *(f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log"),
                f"--seed-file={m}/seed",
            ],
        )
        self._wait(lambda: (m / "munge.socket").exists(), 15, "munged did not open its socket")
        conf_path = str(root / "slurm.conf")
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", conf_path])
        self._spawn("slurmd", ["slurmd", "-D", "-f", conf_path, "-N", "localhost"])
        self._wait(lambda: self.sh("sinfo", "-h", "-o", "%T") == "idle", 60, "node not idle")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = (self.root / f"{name}.out").open("w")
        self.procs.append(
            subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.root)
        )

    def _wait(self, ok, seconds: float, what: str) -> None:
        deadline = time.time() + seconds
        while time.time() < deadline:
            if ok():
                return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.3)
        logs = "\n".join(
            f"--- {p.name}\n{_tail(p)}"
            for p in sorted(self.root.glob("*.out")) + sorted(self.root.glob("*.log"))
        )
        raise RuntimeError(f"{what}\n{logs}")

    def sh(self, *cmd: str) -> str:
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=30)
        return done.stdout.strip()

    def jobs(self, every_state: bool = False) -> dict[str, tuple[str, str]] | None:
        """Job id -> (state, reason) of every active job the controller lists (with
        `every_state`, ended jobs too: the controller keeps them MinJobAge seconds); None when
        squeue cannot answer (a busy controller), which must not read as 'no jobs'."""
        cmd = ["squeue", "-h", "-o", "%i %T %r", *(["--states=all"] if every_state else [])]
        try:
            done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            return None
        if done.returncode != 0:
            return None
        lines = done.stdout.strip().splitlines()
        return {f[0]: (f[1], f[2]) for f in (line.split(None, 2) for line in lines) if len(f) == 3}

    def stop(self) -> None:
        """Cancel every job, stop the daemons, then end any job process they left behind."""
        if self.procs and all(p.poll() is None for p in self.procs):
            for job in self.jobs() or ():
                self.sh("scancel", job)
            deadline = time.time() + 30
            while self.jobs() != {} and time.time() < deadline:
                time.sleep(0.5)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        # slurmstepd and job processes run in this cluster's directories: end those by pid.
        for pid in _pids_of(self.root):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _pids_of(root: Path) -> list[int]:
    """Processes of this cluster: run in its directory, or started (slurmstepd, job steps)
    with its slurm.conf in their environment."""
    marker = f"SLURM_CONF={root / 'slurm.conf'}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in (os.getpid(), os.getppid()):
            continue
        try:
            cwd = os.readlink(proc / "cwd")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if cwd == str(root) or cwd.startswith(f"{root}/") or marker in environ:
            pids.append(int(proc.name))
    return pids


@pytest.fixture
def slurm():
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        pytest.skip(
            f"SLURM not installed (no {', '.join(missing)}): apt-get install slurm-wlm munge"
        )
    if os.geteuid() != 0:
        pytest.skip("a local SLURM cluster needs root (slurmd runs jobs as their user)")
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="slurm-")))
    try:
        try:
            cluster.start()
        except (RuntimeError, OSError) as e:
            pytest.skip(f"the SLURM daemons could not start here: {e}")
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)


def _until(ok, seconds: float, what: str, cluster: Cluster, out: Path):
    deadline = time.time() + seconds
    while time.time() < deadline:
        value = ok()
        if value:
            return value
        time.sleep(0.1)
    logs = "\n".join(f"--- {p.name}\n{_tail(p, 30)}" for p in sorted(out.glob("slurm/*.out")))
    pytest.fail(f"{what} within {seconds} s; jobs {cluster.jobs()}\n{logs}")


def _trainer_pid(workdir: Path) -> int:
    """The pid of the `scalestudy train` process (not srun's) training `workdir`."""
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().decode().split("\0")
        except (OSError, UnicodeDecodeError):
            continue
        if "scalestudy.cli.main" in args and str(workdir) in args and "srun" not in args[0]:
            return int(proc.name)
    raise AssertionError(f"no training process for {workdir}")


def _pending(pid: int, signum: int) -> bool:
    """Whether `signum` is pending for process `pid` (delivered while it is stopped)."""
    status = Path(f"/proc/{pid}/status").read_text()
    masks = [
        int(line.split()[1], 16) for line in status.splitlines() if line[:6] in ("SigPnd", "ShdPnd")
    ]
    return any(m & (1 << (signum - 1)) for m in masks)


def _logged_steps(workdir: Path) -> int:
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line]
    return max(steps, default=0)


@pytest.mark.slow
def test_study_on_slurm_survives_a_sigterm_and_requeue(slurm, tmp_path, capsys, monkeypatch):
    steps = 80
    base = {
        "objective": {"inputs_length": 24, "targets_length": 8},
        "model": {"vocab_size": 384, "dtype": "float32", "n_heads": 2},
        "train": {"batch_size": 8, "log_every": 2, "checkpoint_every": 50, "eval_batches": 1},
        "data": {"synthetic": {"n_train_documents": 200, "n_validation_documents": 20}},
        "eval": {"max_examples": 8},
    }
    base["train"] |= {"progress": False, "async_checkpoint": False}
    spec = tmp_path / "tiny.yaml"
    study = {
        "name": "tiny",
        "base": base,
        "cells": [["causal_decoder", "flm"]],
        "ladder": {
            "sizes": [
                {"name": "xs", "d_model": 16, "n_layers": 2, "d_ff": 32},
                {"name": "s", "d_model": 32, "n_layers": 2, "d_ff": 64},
            ]
        },
        "budget": {"kind": "steps", "steps": steps},
        "tasks": ["synthetic_probes"],
        "fit": {"laws": ["kaplan_n"], "bootstrap": 10},
        "slurm": {
            "scalestudy": f"{sys.executable} -m scalestudy.cli.main",
            "gpus_per_node": 0,
            "cpus_per_task": 1,
            "time": "00:20:00",
            "setup": [f"cd {REPO}"],
        },
    }
    spec.write_text(yaml.safe_dump(study))
    out = tmp_path / "study"
    runs = main_job.expand(main_job.load_study(spec), spec.parent)
    assert len(runs) == 2
    t0 = time.time()
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])  # for `launch --submit`'s sbatch
    monkeypatch.chdir(slurm.root)  # the jobs' working directory
    argv = ["launch", "--spec", str(spec), "--executor", "slurm", "--out", str(out)]
    assert cli.main([*argv, "--submit"]) == 0
    array, collect = re.search(
        r"array job (\d+), collect job (\d+)", capsys.readouterr().out
    ).groups()

    # SIGTERM the larger run's task mid-training, as --signal=B:TERM@N does before a time limit.
    # The trainer is paused (SIGSTOP) while the signal travels, so that it lands mid-training
    # however fast the machine is.
    victim = 1
    workdir = out / "runs" / runs[victim].dirname
    task = f"{array}_{victim}"
    _until(lambda: _logged_steps(workdir) >= 4, 300, "training did not start", slurm, out)
    trainer = _trainer_pid(workdir)
    os.kill(trainer, signal.SIGSTOP)
    t_kill = time.time()
    try:
        assert _logged_steps(workdir) < steps
        slurm.sh("scancel", "--batch", "--signal=TERM", task)
        _until(lambda: _pending(trainer, signal.SIGTERM), 60, "SIGTERM did not arrive", slurm, out)
    finally:
        os.kill(trainer, signal.SIGCONT)

    # The task checkpoints, exits 143 and requeues itself; SLURM holds a requeued job for
    # about two minutes, so note what is on disk, then let it start in a few seconds.
    def held():
        return (slurm.jobs() or {}).get(task, ("", ""))[1] == "BeginTime"

    _until(held, 120, "the task was not requeued", slurm, out)
    t_requeued = time.time()
    saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and 4 <= saved[-1] < steps
    rows_before = [
        line
        for line in (workdir / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["step"] <= saved[-1]
    ]
    assert not (workdir / "summary.json").exists()
    # Not at once: slurmd refuses a credential issued in the same second as the requeue's
    # revocation ("Job credential revoked"), which SLURM's own hold avoids.
    slurm.sh("scontrol", "update", f"JobId={task}", "StartTime=now+5")

    # Finished: both tasks and the collect job are listed in a final state. (An empty queue
    # is not evidence: the active-job list can come back empty while a requeued task is
    # between states.)
    ours = {f"{array}_0", f"{array}_1", collect}

    def finished() -> bool:
        jobs = slurm.jobs(every_state=True) or {}
        return ours <= jobs.keys() and all(jobs[j][0] in ENDED for j in ours)

    _until(finished, 600, "the study did not finish", slurm, out)
    wall = time.time() - t0

    logs = {p.name: p.read_text() for p in (out / "slurm").glob("*.out")}
    task_log = next(text for name, text in logs.items() if name.endswith(f"_{victim}.out"))
    assert f"saved a checkpoint at step {saved[-1]}" in task_log
    assert "requeueing to resume it" in task_log and "attempt 2" in task_log, (
        f"{task_log}\n--- scontrol show job {task}\n{slurm.sh('scontrol', 'show', 'job', task)}"
        f"\n--- slurmctld.log\n{_tail(slurm.root / 'slurmctld.log', 40)}"
    )
    other = next(text for name, text in logs.items() if name.endswith(f"_{1 - victim}.out"))
    assert "attempt 2" not in other and "SIGTERM" not in other  # only the victim was hit
    # Resumed, not restarted: the first attempt's metric rows up to the checkpoint survive
    # byte for byte (a fresh start truncates metrics.jsonl), and training reached the end.
    rows_after = (workdir / "metrics.jsonl").read_text().splitlines()
    assert rows_after[: len(rows_before)] == rows_before
    assert _logged_steps(workdir) == steps

    collect_log = next(text for name, text in logs.items() if f"-collect-{collect}" in name)
    assert "collected 2 new run(s); 2 of 2 complete" in collect_log, collect_log
    registry = load_runs(out)
    assert [r["status"] for r in registry] == ["done", "done"]
    for r in registry:
        # Evaluated zero-shot inside its own job: the summary already held the results.
        summary = json.loads((Path(r["workdir"]) / "summary.json").read_text())
        assert summary["eval"]["synthetic_probes/acc"] == r["eval/synthetic_probes/acc"]
        assert summary["steps"] == steps
    assert "2 of 2 runs finished" in (out / "report.md").read_text()
    print(
        f"SLURM study wall time {wall:.0f} s: submit to SIGTERM {t_kill - t0:.0f} s, to requeue "
        f"{t_requeued - t0:.0f} s"
    )


FAKE_SCALESTUDY = """#!/bin/bash
# Stands in for `scalestudy` in the jobs: logs when each command starts and ends.
echo "start $(date +%s.%N) $*" >> "$FAKE_LOG"
sleep 1
code=0
[[ -n "${FAKE_FAIL:-}" && "$*" == *"$FAKE_FAIL"* ]] && code=1
echo "end $(date +%s.%N) $*" >> "$FAKE_LOG"
exit "$code"
"""


@pytest.mark.slow
@pytest.mark.parametrize("fail", [False, True])
def test_stage_jobs_start_after_their_parents_jobs_succeeded(
    slurm, tmp_path, monkeypatch, capsys, fail
):
    """Stage arrays wait for the job before them (`afterok`); a failed pretraining run cancels
    them, and the collect job still runs. Every command is a stand-in that sleeps a second."""
    from tests.study.test_launch_stages import staged_spec

    fake = tmp_path / "fake_scalestudy"
    fake.write_text(FAKE_SCALESTUDY)
    fake.chmod(0o755)
    spec = staged_spec(tmp_path, scalestudy=str(fake), cpus_per_task=1, time="00:10:00")
    out = tmp_path / "study"
    log = tmp_path / "fake.log"
    runs = main_job.expand(main_job.load_study(spec), spec.parent)
    monkeypatch.setenv("SLURM_CONF", slurm.env["SLURM_CONF"])
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("FAKE_FAIL", f"{runs[0].dirname}/config.yaml" if fail else "")
    monkeypatch.chdir(slurm.root)
    argv = ["launch", "--spec", str(spec), "--executor", "slurm", "--out", str(out), "--submit"]
    assert cli.main(argv) == 0
    submitted = re.search(r"# submitted: (.*)", capsys.readouterr().out).group(1)
    assert len(re.findall(r"job \d+", submitted)) == 4  # pretraining, two stage groups, collect

    def collected() -> bool:
        return log.exists() and any(
            "--collect" in ln and ln.startswith("end") for ln in _lines(log)
        )

    _until(collected, 300, "the collect job did not run", slurm, out)
    events = [ln.split(" ", 2) for ln in _lines(log)]
    times = {}
    for what, when, args in events:
        kind = "collect" if "--collect" in args else "stage" if "--stage-run" in args else "run"
        level = 0
        if kind == "stage":
            name = args.rsplit(" ", 1)[-1]
            level = 2 if name.endswith("-ft") and ("-adapt-" in name or "-scratch-" in name) else 1
        times.setdefault((kind, level, what), []).append(float(when))
    assert len(times[("run", 0, "start")]) == len(runs)
    if fail:  # the stage jobs were cancelled, never started; collect ran after the runs
        assert not any(k[0] == "stage" for k in times)
    else:
        assert len(times[("stage", 1, "start")]) == 6 and len(times[("stage", 2, "start")]) == 4
        assert min(times[("stage", 1, "start")]) >= max(times[("run", 0, "end")])
        assert min(times[("stage", 2, "start")]) >= max(times[("stage", 1, "end")])
    last = max(t for (kind, _, what), ts in times.items() if kind != "collect" for t in ts)
    assert times[("collect", 0, "start")][0] >= last


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()
