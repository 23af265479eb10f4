"""A study stops on the first SIGINT/SIGTERM with its running runs checkpointed, at once on a
second Ctrl-C, and its worker processes die with it (even under SIGKILL)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scalestudy.cli import main as cli
from scalestudy.study.record.registry import load_runs
from scalestudy.study.run import main_job
from scalestudy.study.run.interrupts import StudyInterrupted

pytest.importorskip("scalestudy.train.loop")

# A stand-in trainer with the training loop's signal contract (its real stop handler): it
# logs each step, and on a signal saves a "checkpoint" (slowly, with FAKE_SAVE_S) and raises
# Preempted. Runs as a script so that worker processes can import fake_train by name.
FAKE = """
import json, os, sys, time
from pathlib import Path


def fake_train(cfg, workdir):
    from scalestudy.train.runtime import distributed
    from scalestudy.train import loop

    log = Path(os.environ["FAKE_LOG"])
    note = lambda text: log.open("a").write(f"{text} {cfg.name} {os.getpid()}\\n")
    ckpt = workdir / "ckpt"
    start = int(ckpt.read_text()) if ckpt.is_file() else 0
    note("start")
    with distributed.stop_requests(1) as stop:
        for step in range(start + 1, cfg.train.steps + 1):
            signum = stop(step - 1)
            if signum is not None:
                time.sleep(float(os.environ.get("FAKE_SAVE_S", "0")))
                ckpt.write_text(str(step - 1))
                note("checkpoint")
                if os.environ.get("FAKE_FAIL_ON_SAVE"):
                    raise RuntimeError("step already saved")
                raise loop.Preempted("saved", signum)
            time.sleep(float(os.environ["FAKE_STEP_S"]))
            with open(workdir / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "train/loss": 1.0 / step}) + "\\n")
    summary = {"steps": cfg.train.steps, "tokens": 1.0, "flops": 1.0, "final_val_loss": 1.0,
               "eval": {"probe/acc": 0.5}}
    (workdir / "summary.json").write_text(json.dumps(summary))
    note("done")
    return summary


if __name__ == "__main__":
    from scalestudy.study.run import main_job as sweep
    from scalestudy.study.run.interrupts import StudyInterrupted

    spec, out, workers = sys.argv[1:4]
    try:
        sweep.run_study(Path(spec), Path(out), train_fn=fake_train, workers=int(workers))
    except StudyInterrupted as e:
        print(f"stopped: {e}", file=sys.stderr)
        sys.exit(128 + e.signum)
    except KeyboardInterrupt:  # as the CLI does
        sys.exit(130)
"""


_STARTED: list = []  # (process, its log) of every study this module starts


@pytest.fixture(autouse=True)
def _no_process_left_behind():
    """A failing test must not leave its study or workers running."""
    yield
    while _STARTED:
        proc, log = _STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for _, pid in _events(log, "start"):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _start(
    tmp_path: Path, spec: Path, workers: int, step_s: float, save_s: float = 0.0, **env: str
):
    script = tmp_path / "fakestudy.py"
    script.write_text(FAKE)
    log = tmp_path / "trained.log"
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "FAKE_LOG": str(log),
        "FAKE_STEP_S": str(step_s),
        "FAKE_SAVE_S": str(save_s),
        **env,
    }
    out = tmp_path / "study"
    cmd = [sys.executable, str(script), str(spec), str(out), str(workers)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _STARTED.append((proc, log))
    return proc, out, log


def _events(log: Path, kind: str) -> list[tuple[str, int]]:
    if not log.is_file():
        return []
    return [
        (n, int(p)) for k, n, p in (ln.split() for ln in log.read_text().splitlines()) if k == kind
    ]


# Waits are safety nets, never measurements: generous, so a loaded machine (a process given a
# tenth of a core takes minutes to import JAX) does not fail a test that would pass.
PATIENCE = 600.0


def _wait_for(predicate, timeout: float = PATIENCE) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out waiting for the study"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie has stopped running


def _logged_steps(out: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in out.glob("runs/*/metrics.jsonl"))


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_one_signal_stops_the_study_after_a_checkpoint_and_a_rerun_resumes(
    tmp_path, tiny_spec, signum
):
    proc, out, log = _start(tmp_path, tiny_spec, workers=1, step_s=2.0)
    _wait_for(lambda: _logged_steps(out) >= 1)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=PATIENCE)
    assert proc.returncode == 128 + signum, err
    assert err.decode().count("stopped: ") == 1 and b"Traceback" not in err
    [(name, _)] = _events(log, "start")  # no second run started
    assert _events(log, "checkpoint") == [(name, proc.pid)]
    status = {r["name"]: r["status"] for r in load_runs(out)}
    assert status.pop(name) == "interrupted"
    assert set(status.values()) == {"pending"}
    assert not (out / "report.md").exists()  # stopping is prompt: no report

    proc, out, log = _start(tmp_path, tiny_spec, workers=1, step_s=0.0)
    _, err = proc.communicate(timeout=PATIENCE)
    assert proc.returncode == 0, err
    assert all(r["status"] == "done" for r in load_runs(out))
    saved = int(next(out.glob("runs/*/ckpt")).read_text())
    assert saved >= 1 and _logged_steps(out) == sum(r["steps"] for r in load_runs(out))


@pytest.mark.slow
def test_a_run_that_fails_while_stopping_is_interrupted_not_failed(tmp_path, tiny_spec):
    proc, out, _ = _start(tmp_path, tiny_spec, workers=1, step_s=2.0, FAKE_FAIL_ON_SAVE="1")
    _wait_for(lambda: _logged_steps(out) >= 1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=PATIENCE)
    assert proc.returncode == 143, err
    [run] = [r for r in load_runs(out) if r["status"] != "pending"]
    assert run["status"] == "interrupted" and "RuntimeError: step already saved" in run["error"]


def test_a_second_ctrl_c_stops_at_once(tmp_path, tiny_spec):
    proc, out, log = _start(tmp_path, tiny_spec, workers=1, step_s=1.0, save_s=300.0)
    _wait_for(lambda: _logged_steps(out) >= 1)
    proc.send_signal(signal.SIGINT)  # the fake checkpoint now takes 300 s
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)  # at once: well before the 300 s checkpoint would end
    assert proc.returncode == 130
    assert not _events(log, "checkpoint")
    assert [r["status"] for r in load_runs(out)].count("interrupted") == 1


@pytest.mark.slow
def test_workers_stop_with_the_study_on_sigterm(tmp_path, tiny_spec):
    proc, out, log = _start(tmp_path, tiny_spec, workers=2, step_s=2.0)
    _wait_for(lambda: len(_events(log, "start")) == 2 and _logged_steps(out) >= 2)
    workers = {pid for _, pid in _events(log, "start")}
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=PATIENCE)
    assert proc.returncode == 143, err
    assert {n for n, _ in _events(log, "checkpoint")} == {n for n, _ in _events(log, "start")}
    status = sorted(r["status"] for r in load_runs(out))
    assert status == ["interrupted", "interrupted", "pending", "pending"]
    _wait_for(lambda: not any(_alive(p) for p in workers), timeout=120)


@pytest.mark.slow
def test_workers_die_with_a_killed_study_and_a_rerun_reclaims_their_runs(tmp_path, tiny_spec):
    proc, out, log = _start(tmp_path, tiny_spec, workers=2, step_s=2.0)
    _wait_for(lambda: len(_events(log, "start")) == 2 and _logged_steps(out) >= 2)
    workers = {pid for _, pid in _events(log, "start")}
    proc.kill()
    proc.wait()
    _wait_for(lambda: not any(_alive(p) for p in workers), timeout=120)
    # multiprocessing's resource tracker outlives the study and reports the semaphores the
    # workers' queues left; it writes to the study's workers.log, not the terminal. Its end
    # (it holds the stderr it was started with) closes the pipe.
    _, err = proc.communicate(timeout=PATIENCE)
    assert b"leaked semaphore" not in err and b"resource_tracker" not in err, err[-600:]
    # Told by the parent-death signal, each worker saved its run before it died.
    assert {n for n, _ in _events(log, "checkpoint")} == {n for n, _ in _events(log, "start")}
    # Runs handed to a worker (two training, at most one queued) are marked running.
    running = [r["status"] for r in load_runs(out)].count("running")
    assert 2 <= running <= 3 and [r["status"] for r in load_runs(out)].count("pending") >= 1

    proc, out, log = _start(tmp_path, tiny_spec, workers=1, step_s=0.0)
    stdout, err = proc.communicate(timeout=PATIENCE)
    assert proc.returncode == 0, err
    assert f"reclaimed {running} run(s) left running by a stopped study".encode() in stdout
    assert all(r["status"] == "done" for r in load_runs(out))


def test_the_cli_exits_128_plus_the_signal_with_one_line(tmp_path, tiny_spec, capsys, monkeypatch):
    def stopped(*args, **kwargs):
        raise StudyInterrupted("SIGTERM received: 1 run(s) saved a checkpoint", signal.SIGTERM)

    monkeypatch.setattr(main_job, "run_study", stopped)
    assert cli.main(["study", "--spec", str(tiny_spec), "--out", str(tmp_path / "o")]) == 143
    assert capsys.readouterr().err == "stopped: SIGTERM received: 1 run(s) saved a checkpoint\n"


@pytest.mark.slow
def test_sigterm_stops_a_real_study_with_its_run_checkpointed(tmp_path, tiny_spec):
    out = tmp_path / "study"
    cmd = [sys.executable, "-m", "scalestudy.cli.main", "study", "--spec", str(tiny_spec)]
    cmd += ["--out", str(out), "budget.steps=5000", "base.train.checkpoint_every=1000"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _STARTED.append((proc, tmp_path / "no.log"))
    _wait_for(lambda: _logged_steps(out) >= 1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=PATIENCE)
    last = err.decode().strip().splitlines()[-1]
    assert proc.returncode == 143, err.decode()[-2000:]
    assert last.startswith("stopped: SIGTERM received: 1 run(s) stopped and are marked interrupted")
    status = sorted(r["status"] for r in load_runs(out))
    assert status == ["interrupted", "pending", "pending", "pending"]
    [ckpts] = list(out.glob("runs/*/checkpoints"))
    assert any(p.name.isdigit() for p in ckpts.iterdir())  # saved on the signal
