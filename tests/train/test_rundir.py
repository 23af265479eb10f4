"""The run directory's files: one reader, atomic writes."""

import json

from scalestudy.train.rundir import layout as rundir


def test_summary_round_trip_and_atomic(tmp_path):
    assert rundir.read_summary(tmp_path) is None
    rundir.write_summary(tmp_path, {"steps": 3, "tokens": 1.5})
    assert rundir.read_summary(tmp_path) == {"steps": 3, "tokens": 1.5}
    assert sorted(p.name for p in tmp_path.iterdir()) == [rundir.SUMMARY]  # no .tmp left


def test_torn_summary_reads_as_none(tmp_path):
    rundir.summary_path(tmp_path).write_text('{"steps": 3, "tok')
    assert rundir.read_summary(tmp_path) is None
    rundir.summary_path(tmp_path).write_text("[1, 2]")
    assert rundir.read_summary(tmp_path) is None


def test_metrics_reader_skips_torn_and_stepless_rows(tmp_path):
    for step in (1, 2, 3):
        rundir.append_metrics(tmp_path, {"step": step, "train/loss": float(step)})
    with rundir.metrics_path(tmp_path).open("a") as f:
        f.write(json.dumps({"note": "no step"}) + "\n" + '{"step": 4, "tra')
    assert [r["step"] for r in rundir.read_metrics(tmp_path)] == [1, 2, 3]
    rundir.truncate_metrics_after(tmp_path, 2)
    assert rundir.read_metrics(tmp_path) == [
        {"step": 1, "train/loss": 1.0},
        {"step": 2, "train/loss": 2.0},
    ]
    assert rundir.metrics_path(tmp_path).read_text().endswith("\n")
