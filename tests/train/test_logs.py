"""Logs for machines: off a terminal, `train`, `study` and `eval` print plain lines (no
carriage returns), so a CI log, nohup.out or a SLURM output file reads line by line."""

from __future__ import annotations

import re
from pathlib import Path

from scalestudy.evaluate.results import task_lines
from scalestudy.study.run.study_progress import StudyProgress
from scalestudy.train import loop, progress_bar

from .conftest import tiny

LINE = re.compile(r"^(\S+) step (\d+)/(\d+) loss (\d+\.\d+) tokens/s (\d+) eta \d+:\d\d:\d\d$")


def test_train_off_a_terminal_prints_plain_lines(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.setattr(progress_bar, "PLAIN_EVERY_S", 0.0)  # a line at every log step
    cfg = tiny("causal_decoder", None, "train.progress=true", "train.stop_after_steps=6")
    loop.train(cfg, tmp_path)
    out = capsys.readouterr()
    assert "\r" not in out.err + out.out
    lines = [LINE.match(line) for line in out.err.splitlines() if " step " in line]
    assert lines and all(lines), out.err
    steps = [int(m.group(2)) for m in lines]
    assert steps == list(range(1, 7))  # log_every=1
    assert {m.group(1) for m in lines} == {cfg.name}
    assert {int(m.group(3)) for m in lines} == {6}  # where this invocation stops


def test_train_lines_come_at_most_once_an_interval(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.setattr(progress_bar, "PLAIN_EVERY_S", 3600.0)
    cfg = tiny("causal_decoder", None, "train.progress=true", "train.steps=8")
    loop.train(cfg, tmp_path)
    lines = [line for line in capsys.readouterr().err.splitlines() if LINE.match(line)]
    assert [LINE.match(line).group(2) for line in lines] == ["8"]  # only the last step's


def test_study_off_a_terminal_prints_a_line_per_finished_run(tmp_path: Path, capsys):
    progress_bar = StudyProgress(1.0, 2)  # pytest's captured stderr is not a terminal
    assert progress_bar.plain
    for i, (name, weight) in enumerate((("small", 0.25), ("large", 0.75)), 1):
        progress_bar.start(i, name, tmp_path / name, weight, steps=10)
        progress_bar.bar.write(f"warning: {name} says something")
        progress_bar.end(weight)
    progress_bar.end(0.0)  # a job that had nothing left to train: no line
    progress_bar.close()
    out = capsys.readouterr()
    assert "\r" not in out.out + out.err
    assert out.out.splitlines() == [
        "warning: small says something",
        "[1/2] small finished: study 25.0% done",
        "warning: large says something",
        "[2/2] large finished: study 100.0% done",
    ]


def test_eval_prints_one_line_per_task():
    results = {"sums/acc": 0.5, "sums/n": 4, "copa.2shot/acc": 0.75, "copa.2shot/shots": 2}
    assert task_lines(7, results) == [
        "eval step 7 sums: acc 0.5, n 4",
        "eval step 7 copa.2shot: acc 0.75, shots 2",
    ]
