"""Faults on two processes (two local processes of four CPU devices each, one 8-device mesh,
joined through jax.distributed as on several hosts): a second job on the run directory, a
damaged checkpoint, a NaN right after a restore and lost metric rows. Every process must
stop (none left waiting in a collective) with the one line a single process gives, and a
resume must continue the uninterrupted run."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scalestudy.config.experiment import load_config, to_yaml
from scalestudy.train.rundir import layout as rundir
from scalestudy.train.rundir import logfile, saved_run

from .two_process import OVERRIDES, free_port, process_env

# Run by each process in place of `python -m scalestudy.cli.main`, after an optional prelude.
MAIN = "import sys\nfrom scalestudy.cli.main import main\nsys.exit(main())\n"

# A train step whose loss is NaN, whatever the state (the terminal set up for the command
# line first, as `main` does before anything imports TensorFlow).
POISON = """
from scalestudy.train.rundir import logfile
logfile.quiet_terminal()

import numpy as np
from scalestudy.train import loop

_build = loop.build_program

def _poisoned_build(*args, **kwargs):
    program = _build(*args, **kwargs)
    real_step = program.train_step

    def poisoned(state, batch, *hyper):
        state, m = real_step(state, batch, *hyper)
        return state, {**m, "train/loss": m["train/loss"] * np.nan}

    return type(program)(**{**program.__dict__, "train_step": poisoned})

loop.build_program = _poisoned_build
"""


def _losses(workdir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in rundir.read_metrics(workdir) if "train/loss" in r}


def _two_processes(workdir: Path, *more: str, prelude: str = "") -> list[tuple[int, list[str]]]:
    """`scalestudy train` on two processes of one job, as a user runs it (no TensorFlow log
    level of their own); (exit status, stderr lines) of each. Fails if they do not end."""
    config = workdir.parent / f"{workdir.name}.yaml"
    config.write_text(to_yaml(load_config(None, [*OVERRIDES, *more])))
    drop = (logfile.TF_LOG_LEVEL, logfile.TF_LOG_LEVEL_DEFAULTED)
    port = free_port()
    procs = []
    for pid in range(2):
        env = {k: v for k, v in os.environ.items() if k not in drop} | process_env(pid, port)
        command = [sys.executable, "-c", prelude + MAIN, "train", "--config", str(config)]
        procs.append(
            subprocess.Popen(
                [*command, "--workdir", str(workdir)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        errs = [p.communicate(timeout=400)[1] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        errs = [p.communicate()[1] for p in procs]
        pytest.fail(f"a process did not end; stderr: {[e[-2000:] for e in errs]}")
    return [(p.returncode, e.splitlines()) for p, e in zip(procs, errs, strict=True)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """Six uninterrupted steps on two processes (checkpoints at steps 3 and 6)."""
    workdir = tmp_path_factory.mktemp("two") / "straight"
    outcome = _two_processes(workdir)
    assert [code for code, _ in outcome] == [0, 0], outcome
    assert saved_run.latest_step(workdir) == 6 and sorted(_losses(workdir)) == [1, 2, 3, 4, 5, 6]
    return workdir


def _copy(straight: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    (run / rundir.LOG).unlink()
    return run


@pytest.mark.slow
def test_a_second_job_on_the_run_directory_is_refused_on_every_process(tmp_path):
    """Only process 0 takes the run lock (one writer); when it is refused, process 1 stops
    too instead of waiting for it."""
    run = tmp_path / "run"
    run.mkdir()
    with rundir.run_lock(run) as holder:
        outcome = _two_processes(run)
    assert [code for code, _ in outcome] == [2, 2], outcome
    (_, first), (_, second) = outcome
    assert len(first) == 1 and first[0].startswith("error: the run directory"), first
    assert f"pid {holder['pid']}" in first[0]
    assert len(second) == 1 and "process 0 of this job was refused its lock" in second[0]
    assert not (run / rundir.CONFIG).exists()  # refused before anything was written


@pytest.mark.slow
def test_a_damaged_checkpoint_is_set_aside_by_both_and_the_run_resumes_exactly(straight, tmp_path):
    run = _copy(straight, tmp_path)
    files = [p for p in (run / "checkpoints" / "6" / "train").rglob("*") if p.is_file()]
    path = max(files, key=lambda p: p.stat().st_size)  # inside the optimizer state
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    path.write_bytes(bytes(data))
    (run / "summary.json").unlink()  # as if stopped right after the save of step 6
    outcome = _two_processes(run)
    assert [code for code, _ in outcome] == [0, 0], outcome
    for _, lines in outcome:  # both processes say it, in one line each
        assert len(lines) == 1 and "step 6 cannot be restored" in lines[0], lines
    assert "checksums" in outcome[0][1][0] and "process 0 found it damaged" in outcome[1][1][0]
    assert (run / rundir.CORRUPT / "6").is_dir() and saved_run.latest_step(run) == 6
    assert _losses(run) == _losses(straight)  # resumed from step 3: Δloss 0


@pytest.mark.slow
def test_a_nan_right_after_a_restore_names_the_checkpoint_on_both(straight, tmp_path):
    run = _copy(straight, tmp_path)
    shutil.rmtree(run / "checkpoints" / "6")
    (run / "summary.json").unlink()
    outcome = _two_processes(run, prelude=POISON)
    assert [code for code, _ in outcome] == [2, 2], outcome
    for _, lines in outcome:
        assert len(lines) == 1 and lines[0].startswith("error: training loss is nan"), lines
        assert "resuming from the one of step 3" in lines[0] and "suspect" in lines[0]
    assert saved_run.latest_step(run) == 3  # nothing saved from the NaN state
    kept = _losses(run)
    assert kept == {s: v for s, v in _losses(straight).items() if s <= 3}


@pytest.mark.slow
def test_lost_metric_rows_are_named_by_process_0_and_the_rest_is_complete(straight, tmp_path):
    run = _copy(straight, tmp_path)
    shutil.rmtree(run / "checkpoints" / "6")
    (run / "summary.json").unlink()
    path = rundir.metrics_path(run)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] not in (2, 3)))
    outcome = _two_processes(run)
    assert [code for code, _ in outcome] == [0, 0], outcome
    (_, first), (_, second) = outcome
    assert len(first) == 1, first
    assert first[0].startswith("warning: ") and "lacks 2 of the 3 training rows" in first[0]
    assert second == []  # process 1 writes no rows, so it has none to miss
    want = _losses(straight)
    assert _losses(run) == {s: v for s, v in want.items() if s not in (2, 3)}  # Δloss 0
