"""`scalestudy eval` writes its results into the run's TensorBoard events, read back here
with TensorFlow's own event reader (which checks every record's CRC)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jax
import numpy as np
import pytest

from scalestudy.models.api import build_model
from scalestudy.train.rundir import layout as rundir
from scalestudy.train.rundir.checkpoint import Checkpointer
from scalestudy.train.rundir.tensorboard import EventWriter

from .tiny_models import tiny

tf = pytest.importorskip("tensorflow")


def write_sums_task(folder: Path, n: int = 6) -> Path:
    """A three-choice sums task of `n` rows and its YAML."""
    rng = random.Random(0)
    rows = []
    for i in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        choices = [str(a + b), str(a + b + 1), str(a * b + 3)]
        rows.append({"id": i, "question": f"{a} plus {b}?", "choices": choices, "label": i % 3})
    (folder / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"name": "sums", "path": "sums.jsonl", "context_field": "question"}
    path = folder / "sums.yaml"
    path.write_text(json.dumps({**config, "label_field": "label"}))
    return path


def saved_run(tmp_path: Path, step: int) -> Path:
    """A run directory with one checkpoint at `step` and training scalars up to it."""
    cfg = tiny("causal_decoder", "flm", tasks=[str(write_sums_task(tmp_path))], max_examples=4)
    model = build_model(cfg.model)
    run = tmp_path / "run"
    ckpt = Checkpointer(run / "checkpoints", async_save=False)
    state = {"params": model.init(jax.random.key(0)), "step": np.int32(step)}
    ckpt.save(step, state, {"cursor": 0}, cfg)
    ckpt.close()
    (run / "summary.json").write_text(json.dumps({"name": "run", "steps": step}))
    writer = EventWriter(rundir.tensorboard_dir(run))
    for s in range(1, step + 1):
        writer.scalars(s, {"train/loss": 5.0 - s})
    writer.close()
    return run


def read_scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} of every event file in the run's event directory, in the
    order TensorBoard reads them (by file name)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(rundir.tensorboard_dir(run).glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_eval_results_reach_tensorboard_at_the_runs_step(tmp_path: Path, capsys) -> None:
    from scalestudy.cli.main import main

    run = saved_run(tmp_path, 5)
    assert main(["eval", "--workdir", str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    err = capsys.readouterr().err
    assert "\r" not in err
    assert f"eval step 5 sums: acc {summary['eval']['sums/acc']:.4g}" in err.splitlines()[-1]
    scalars = read_scalars(run)
    evals = {tag for tag in scalars if tag.startswith("eval/")}
    want = {f"eval/{k}" for k, v in summary["eval"].items() if k != "step"}
    want = {t for t in want if isinstance(summary["eval"][t.removeprefix("eval/")], float | int)}
    assert "eval/sums/acc" in evals and evals == want
    for tag in evals:
        [(step, value)] = scalars[tag]
        assert step == 5
        assert value == pytest.approx(summary["eval"][tag.removeprefix("eval/")], rel=1e-6)
    # The training scalars are all still read beside them.
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4, 5]

    assert main(["eval", "--workdir", str(run)]) == 0  # a second evaluation, a second point
    assert [s for s, _ in read_scalars(run)["eval/sums/acc"]] == [5, 5]
