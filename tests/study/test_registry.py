"""Registry round trips, crash safety under SIGKILL, and resuming only what is missing."""

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time

import pytest

from scalestudy.study.record.registry import Registry, load_curves, load_runs
from scalestudy.study.run import main_job
from scalestudy.study.run.lock import LOCK_NAME, StudyLockError
from scalestudy.train.rundir import layout as rundir

ROW = {
    "run_id": "abc",
    "study": "t",
    "arch": "causal_decoder",
    "objective": "flm",
    "size": "xs",
    "size_index": 0,
    "seed": 0,
    "params_total": 10,
    "params_non_embedding": 6,
    "steps": 4,
}


def test_round_trip(tmp_path):
    path = tmp_path / "registry.sqlite"
    with Registry(path) as reg:
        assert reg.add_runs([ROW]) == 1
        assert reg.add_runs([{**ROW, "size": "changed"}]) == 0  # existing ids are kept
        summary = {
            "tokens": 32.0,
            "flops": 1e6,
            "final_val_loss": 2.5,
            "final_train_loss": 2.4,
            "steps": 4,
            "eval": {"probe/acc": 0.75, "probe/n": 8},
        }
        curves = [
            {"step": 2, "train/loss": 3.0, "tokens": 16, "flops": 5e5},
            {"step": 4, "train/loss": 2.4, "val/loss": 2.5, "tokens": 32, "flops": 1e6},
        ]
        reg.finish("abc", summary, curves)
    [run] = load_runs(tmp_path)  # a study directory works too
    assert run["status"] == "done" and run["size"] == "xs"
    assert run["loss"] == 2.5 and run["eval/probe/acc"] == 0.75 and run["eval/probe/n"] == 8
    curve = load_curves(path)
    assert [(c["step"], c["loss"], c["val_loss"]) for c in curve] == [(2, 3.0, None), (4, 2.4, 2.5)]


def test_torn_metrics_line_is_ignored(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "train/loss": 1.0}) + '\n{"step": 2, "tra')
    assert rundir.read_metrics_file(path) == [{"step": 1, "train/loss": 1.0}]


FAKE_STUDY = """
import json, sys, time
from pathlib import Path
from scalestudy.study.run import main_job as sweep

spec, out, delay, log = sys.argv[1:5]

def fake_train(cfg, workdir):
    with open(log, "a") as f:
        f.write(cfg.name + "\\n")
    for step in range(1, cfg.train.steps + 1):
        time.sleep(float(delay) / cfg.train.steps)
        with open(workdir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "train/loss": 5.0 / step, "tokens": step * 10,
                                "flops": step * 1e6}) + "\\n")
    summary = {"steps": cfg.train.steps, "tokens": 40.0, "flops": 4e6, "final_val_loss": 1.0,
               "final_train_loss": 1.0, "eval": {"probe/acc": 0.5, "probe/n": 8}}
    (workdir / "summary.json").write_text(json.dumps(summary))
    return summary

sweep.run_study(Path(spec), Path(out), train_fn=fake_train)
"""


def _start(script, spec, out, delay, log):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(
        [sys.executable, str(script), str(spec), str(out), str(delay), str(log)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigkill_mid_study_then_rerun_finishes_only_what_is_missing(tmp_path, tiny_spec):
    pytest.importorskip("scalestudy.models.counting")
    script = tmp_path / "fake_study.py"
    script.write_text(FAKE_STUDY)
    out, log = tmp_path / "study", tmp_path / "trained.log"
    proc = _start(script, tiny_spec, out, 1.0, log)
    db = out / "registry.sqlite"
    deadline = time.time() + 60
    while time.time() < deadline:  # kill once two runs are done and the third is running
        if db.exists():
            with sqlite3.connect(db, timeout=5) as c:
                try:
                    query = "SELECT COUNT(*) FROM runs WHERE status='done'"
                    done = c.execute(query).fetchone()[0]
                except sqlite3.OperationalError:  # created, schema not yet committed
                    done = 0
            if done >= 2:
                time.sleep(0.3)
                break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    first = log.read_text().split()
    statuses = {r["name"]: r["status"] for r in load_runs(db)}
    assert len(statuses) == 4
    finished = {n for n, s in statuses.items() if s == "done"}
    assert 2 <= len(finished) < 4

    proc = _start(script, tiny_spec, out, 0.1, log)
    _, err = proc.communicate(timeout=600)  # a safety net under load, not a measurement
    assert proc.returncode == 0, err
    second = log.read_text().split()[len(first) :]
    assert not set(second) & finished  # finished runs were not trained again
    assert set(second) | finished == set(statuses)
    runs = load_runs(db)
    assert all(r["status"] == "done" for r in runs)
    assert (out / "report.md").is_file()
    # Curves were copied from every run's metrics.jsonl.
    assert {c["run_id"] for c in load_curves(db)} == {r["run_id"] for r in runs}


def _fake_train(cfg, workdir):
    summary = {"steps": cfg.train.steps, "tokens": 1.0, "flops": 1.0, "final_val_loss": 1.0}
    summary["eval"] = {"probe/acc": 0.5}
    (workdir / "summary.json").write_text(json.dumps(summary))
    return summary


def test_a_second_process_on_the_same_study_directory_refuses(tmp_path, tiny_spec):
    out = tmp_path / "study"
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(out)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(StudyLockError) as error:
            main_job.run_study(tiny_spec, out, train_fn=_fake_train)
        message = str(error.value)
        assert f"pid {holder.pid} on {socket.gethostname()}, started " in message
        assert not (out / "runs").exists() and not (out / "registry.sqlite").exists()
    finally:
        holder.kill()
        holder.wait()
    # The holder died without releasing: its lock is stale and is taken over.
    main_job.run_study(tiny_spec, out, train_fn=_fake_train)
    assert load_runs(out) and all(r["status"] == "done" for r in load_runs(out))
    assert (out / LOCK_NAME).read_text() == ""  # released


def test_a_lock_from_another_host_is_refused_and_the_cli_says_so(tmp_path, tiny_spec, capsys):
    from scalestudy.cli import main as cli

    out = tmp_path / "study"
    out.mkdir()
    record = {"pid": 1, "host": "elsewhere", "started": "2026-01-01 00:00:00 UTC"}
    (out / LOCK_NAME).write_text(json.dumps(record))
    code = cli.main(["study", "--spec", str(tiny_spec), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "pid 1 on elsewhere, started 2026-01-01" in err
    assert f"delete {out / LOCK_NAME}" in err and "Traceback" not in err
    (tmp_path / "file").write_text("")
    assert cli.main(["study", "--spec", str(tiny_spec), "--out", str(tmp_path / "file")]) == 2
    assert "is a file" in capsys.readouterr().err


LOCK_HOLDER = """
import sys, time
from scalestudy.study.run.lock import study_lock
with study_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(600)
"""


# The `runs` columns of a registry written before lineage existed (schema 1, user_version 0).
OLD_COLUMNS = """study TEXT, name TEXT, arch TEXT, objective TEXT, size TEXT, size_index INTEGER,
budget TEXT, seed INTEGER, matching TEXT, status TEXT, workdir TEXT, config TEXT,
params_total INTEGER, params_non_embedding INTEGER, steps INTEGER, tokens REAL, flops REAL,
loss REAL, error TEXT"""


def _old_registry(path):
    conn = sqlite3.connect(path)
    conn.executescript(
        f"""CREATE TABLE runs (run_id TEXT PRIMARY KEY, {OLD_COLUMNS});
        CREATE TABLE finals (run_id TEXT NOT NULL, name TEXT NOT NULL, value REAL,
          PRIMARY KEY (run_id, name));
        CREATE TABLE metrics (run_id TEXT NOT NULL, step INTEGER NOT NULL, name TEXT NOT NULL,
          value REAL, PRIMARY KEY (run_id, step, name));
        INSERT INTO runs (run_id, study, arch, objective, size, size_index, seed, status,
          params_total, steps, loss) VALUES ('old', 't', 'causal_decoder', 'flm', 'xs', 0, 0,
          'done', 10, 4, 2.5);
        INSERT INTO finals VALUES ('old', 'eval/probe/acc', 0.75);
        INSERT INTO metrics VALUES ('old', 4, 'train/loss', 2.4);"""
    )
    conn.commit()
    conn.close()


def test_an_old_schema_registry_stays_readable_and_gains_lineage_columns(tmp_path):
    from scalestudy.study.record.registry_schema import SCHEMA_VERSION

    path = tmp_path / "registry.sqlite"
    _old_registry(path)
    [run] = load_runs(path)  # read as it is: the missing columns are added, empty
    assert (run["run_id"], run["status"], run["loss"], run["eval/probe/acc"]) == (
        "old",
        "done",
        2.5,
        0.75,
    )
    assert run["stage"] is None and run["parent_run_id"] is None and run["parent_step"] is None
    assert [c["loss"] for c in load_curves(path)] == [2.4]
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
    conn.close()
    with Registry(path, create=False) as reg:  # and writable: a stage run with its lineage
        reg.add_runs([{**ROW, "run_id": "ft", "stage": "finetune", "parent_run_id": "old"}])
        reg.update("ft", parent_step=4)
        assert [r["run_id"] for r in reg.runs()] == ["old"]  # pretraining queries: unchanged
        stage = reg.runs(stages=True)[1]
        assert (stage["stage"], stage["parent_run_id"], stage["parent_step"]) == (
            "finetune",
            "old",
            4,
        )
    assert [r["run_id"] for r in load_runs(path, stages=True)] == ["old", "ft"]


def test_a_registry_from_a_newer_version_is_refused_in_one_line(tmp_path):
    from scalestudy.study.record.registry_schema import SCHEMA_VERSION, RegistryError

    path = tmp_path / "registry.sqlite"
    _old_registry(path)
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(RegistryError, match="newer scalestudy"):
        load_runs(path)


def test_study_status_lists_stage_runs_with_their_lineage(tmp_path, capsys):
    from scalestudy.cli import main as cli

    _old_registry(tmp_path / "registry.sqlite")
    with Registry(tmp_path / "registry.sqlite") as reg:
        reg.add_runs(
            [
                {**ROW, "run_id": "ad", "name": "old-adapt", "stage": "adapt"},
                {**ROW, "run_id": "sc", "name": "old-scratch", "stage": "scratch"},
            ]
        )
        reg.update("ad", parent_run_id="old", parent_step=4)
        reg.update("sc", matches_run_id="ad")
        reg.update("old", name="old-run")
    spec = tmp_path / "no-such-spec.yaml"  # --status reads the registry only
    assert cli.main(["study", "--spec", str(spec), "--out", str(tmp_path), "--status"]) == 0
    lines = {ln.split()[0]: ln.split() for ln in capsys.readouterr().out.splitlines() if ln}
    assert lines["old-run"][1:4] == ["old", "done", "-"]
    assert lines["old-adapt"][1:6] == ["ad", "pending", "adapt", "old-run", "(4)"]
    assert lines["old-scratch"][3:] == ["scratch", "-", "ad"]
    assert lines["3"][:2] == ["3", "runs:"] and "1" not in lines  # every run still planned
    with Registry(tmp_path / "registry.sqlite") as reg:
        reg.set_plan([])  # a spec that no longer plans old-run (its stage runs keep their rows)
    assert cli.main(["study", "--spec", str(spec), "--out", str(tmp_path), "--status"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == (
        "1 not planned by the spec the study last ran with (kept; left out of its report, "
        "fit and plot): old-run"
    )
    assert cli.main(["study", "--spec", str(spec), "--out", str(tmp_path / "x"), "--status"]) == 2
    assert "no study registry" in capsys.readouterr().err
