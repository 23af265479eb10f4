"""Multi-host training with several local processes: two processes of four CPU devices each
form one 8-device mesh and must train exactly as one process with eight devices."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from scalestudy.config.experiment import load_config, to_yaml
from scalestudy.train.loop import train
from scalestudy.train.rundir import checkpoint, checkpoint_recovery
from scalestudy.train.rundir.saved_run import latest_step
from scalestudy.train.runtime import distributed
from scalestudy.train.sharding import MeshError, initialize_distributed

from .two_process import OVERRIDES, free_port, process_env


def _losses(workdir: Path) -> list[float]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r]


def _launch(cfg, tmp_path: Path, workdir: Path) -> list[subprocess.Popen]:
    """`scalestudy train` in two local processes of four CPU devices each (one 8-device mesh)."""
    config = tmp_path / f"{workdir.name}.yaml"
    config.write_text(to_yaml(cfg))
    port = free_port()
    procs = []
    for pid in range(2):
        env = {**os.environ, **process_env(pid, port)}
        cmd = [sys.executable, "-m", "scalestudy.cli.main", "train", "--config", str(config)]
        procs.append(
            subprocess.Popen(
                [*cmd, "--workdir", str(workdir)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def _finish(procs: list[subprocess.Popen]) -> None:
    """Wait for the processes of `_launch`; fail with their output unless both succeed."""
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    except subprocess.TimeoutExpired:  # one process failed and the other waits for it
        for p in procs:
            p.kill()
        outputs = [p.communicate()[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]


@pytest.mark.optimized
@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path: Path):
    cfg = load_config(None, OVERRIDES)
    reference = tmp_path / "one_process"
    train(cfg, reference)  # this test process has 8 devices (conftest)

    workdir = tmp_path / "two_processes"
    _finish(_launch(cfg, tmp_path, workdir))

    want, got = _losses(reference), _losses(workdir)
    assert len(got) == len(want) == cfg.train.steps
    assert got == pytest.approx(want, rel=1e-5)
    summary = json.loads((workdir / "summary.json").read_text())
    ref = json.loads((reference / "summary.json").read_text())
    for key in ("tokens", "positions", "document_tokens"):  # the two processes' counts summed
        assert summary[key] == ref[key], key


@pytest.mark.slow
@pytest.mark.parametrize("every", [1000, 1])
def test_sigterm_on_one_process_stops_both_at_one_step_then_resumes_on_one(
    tmp_path: Path, every: int
):
    """SIGTERM reaches process 1 only: both save at the same step and exit with the
    preemption status; the checkpoint then resumes on one process of 8 devices, on another
    mesh, continuing the uninterrupted run's losses. With `every=1` the signal always lands
    on a step that was just checkpointed: it is not saved twice."""
    cfg = load_config(None, [*OVERRIDES, "train.steps=200", f"train.checkpoint_every={every}"])
    workdir = tmp_path / "two_processes"
    procs = _launch(cfg, tmp_path, workdir)
    deadline = time.time() + 240
    while time.time() < deadline and all(p.poll() is None for p in procs):
        if (workdir / "metrics.jsonl").exists() and len(_losses(workdir)) >= 2:
            break
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    saved = []
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 128 + signal.SIGTERM, out[-3000:]
        found = re.search(r"SIGTERM received: saved a checkpoint at step (\d+)", out)
        assert found, out[-3000:]
        saved.append(int(found.group(1)))
    stopped_at = saved[0]
    assert saved == [stopped_at, stopped_at] and 2 <= stopped_at < 200
    assert latest_step(workdir) == stopped_at
    assert len(_losses(workdir)) == stopped_at

    stop = f"train.stop_after_steps={stopped_at + 3}"
    reference = tmp_path / "uninterrupted"
    train(
        cfg.replace(train={**cfg.train.model_dump(), "stop_after_steps": stopped_at + 3}), reference
    )
    mesh = ["mesh.data=2", "mesh.fsdp=4"]
    every_ = f"train.checkpoint_every={every}"
    resumed = load_config(None, [*OVERRIDES, "train.steps=200", every_, stop, *mesh])
    train(resumed, workdir)  # one process, 8 devices, another mesh
    want, got = _losses(reference), _losses(workdir)
    assert len(got) == len(want) == stopped_at + 3
    assert got == pytest.approx(want, rel=1e-5)


def test_distributed_environment_is_validated():
    assert initialize_distributed({}) is False  # one process: nothing to join
    with pytest.raises(MeshError, match="SCALESTUDY_NUM_PROCESSES"):
        initialize_distributed({"SCALESTUDY_COORDINATOR": "127.0.0.1:1"})
    with pytest.raises(MeshError, match=r"must lie in \[0, 2\)"):
        initialize_distributed(
            {
                "SCALESTUDY_COORDINATOR": "127.0.0.1:1",
                "SCALESTUDY_NUM_PROCESSES": "2",
                "SCALESTUDY_PROCESS_ID": "2",
            }
        )
    with pytest.raises(MeshError, match="accepted: auto, off"):
        initialize_distributed({"SCALESTUDY_DISTRIBUTED": "yes"})


@pytest.mark.slow
def test_two_processes_resume_a_seqio_stream(tmp_path: Path):
    """seqio streaming on 2 processes: each saves its own iterator state and restores it, so
    a run stopped at step 3 and resumed gives the uninterrupted run's losses."""
    seqio_overrides = [
        "data.source=seqio",
        "data.seqio_task=scalestudy.synthetic.flm",
        "data.synthetic.n_train_documents=200",
        "data.synthetic.n_validation_documents=20",
        "objective.name=flm",
    ]
    cfg = load_config(None, [*OVERRIDES, *seqio_overrides])
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _finish(_launch(cfg, tmp_path, straight))  # checkpoints at steps 3 and 6
    step_dir = straight / "checkpoints" / "3"
    items = [checkpoint.data_item(p, 2) for p in range(2)]
    assert items == ["data", "data_process_1-of-2"]
    states = [json.loads((step_dir / item / "metadata").read_text()) for item in items]
    assert [s["iterator"]["process"] for s in states] == [[0, 2], [1, 2]]
    assert states[0]["iterator"]["tf_data"] != states[1]["iterator"]["tf_data"]

    # Stopped after step 3: the same run directory without what came later.
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "6")
    (resumed / "summary.json").unlink()
    _finish(
        _launch(cfg, tmp_path, resumed)
    )  # resumes from step 3; process 1 restores its own stream
    want, got = _losses(straight), _losses(resumed)
    assert len(got) == len(want) == cfg.train.steps
    assert got == pytest.approx(want, rel=1e-5)
    summary = json.loads((resumed / "summary.json").read_text())  # written again: it ran
    assert summary["tokens"] == json.loads((straight / "summary.json").read_text())["tokens"]


def test_each_process_restores_its_own_data_state(tmp_path: Path, monkeypatch):
    """The checkpoint's data items: process 0's state in `data`, process i's in
    `data_process_i-of-n` (orbax's JSON items, each written by its own process); each process
    reads its own back, another process count reads process 0's (the iterator decides whether
    it fits)."""
    import jax.numpy as jnp

    from scalestudy.config.experiment import ExperimentConfig

    state = {"params": {"w": jnp.arange(3.0)}, "step": jnp.asarray(5)}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    ckpt = checkpoint.Checkpointer(tmp_path, async_save=False)
    ckpt.save(5, state, {"iterator": {"process": 0}}, ExperimentConfig())
    ckpt.wait()
    # What process 1 of a two-process run writes beside it.
    (tmp_path / "5" / "data_process_1-of-2").mkdir()
    (tmp_path / "5" / "data_process_1-of-2" / "metadata").write_text('{"iterator": {"process": 1}}')
    for layout, want in (((1, 2), 1), ((0, 2), 0), ((0, 1), 0), ((3, 4), 0)):
        monkeypatch.setattr(distributed, "process_layout", lambda layout=layout: layout)
        _, data, step = checkpoint_recovery.restore(ckpt, abstract)
        assert step == 5 and data == {"iterator": {"process": want}}
    ckpt.close()


def test_an_older_releases_data_files_still_restore(tmp_path: Path, monkeypatch):
    """A checkpoint of an older release kept every process's state as a file inside one
    `data` item (`process_<i>-of-<n>.json`): each process still reads its own."""
    import jax.numpy as jnp

    from scalestudy.config.experiment import ExperimentConfig

    state = {"params": {"w": jnp.arange(3.0)}, "step": jnp.asarray(5)}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    ckpt = checkpoint.Checkpointer(tmp_path, async_save=False)
    ckpt.save(5, state, {"iterator": {"process": "new"}}, ExperimentConfig())
    ckpt.wait()
    data = tmp_path / "5" / "data"
    (data / "metadata").unlink()
    for p in range(2):
        (data / f"process_{p}-of-2.json").write_text(json.dumps({"iterator": {"process": p}}))
    checkpoint.write_checksums(tmp_path / "5")  # as that release saved them
    for layout, want in (((1, 2), 1), ((0, 2), 0), ((0, 1), 0)):
        monkeypatch.setattr(distributed, "process_layout", lambda layout=layout: layout)
        _, restored, step = checkpoint_recovery.restore(ckpt, abstract)
        assert step == 5 and restored == {"iterator": {"process": want}}
    ckpt.close()
