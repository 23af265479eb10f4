"""Faults on one host: a changed config, a full or read-only disk, a torn metrics line, a
run directory that is a file. Each must stop with one clear error and lose nothing."""

import os
import shutil
import subprocess
import uuid

import pytest

from scalestudy import cli
from scalestudy.config import to_yaml
from scalestudy.train import checkpoint, loop, resume, rundir, saved


def losses(workdir):
    return [r["train/loss"] for r in rundir.read_metrics(workdir) if "train/loss" in r]


def snapshot(workdir):
    """Every file under `workdir` with its bytes (what a refused resume must not touch)."""
    return {
        p.relative_to(workdir): p.read_bytes() for p in sorted(workdir.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def straight(tiny_cfg, tmp_path_factory):
    """8 uninterrupted steps (the reference every resumed run must reproduce)."""
    workdir = tmp_path_factory.mktemp("straight")
    loop.train(tiny_cfg("causal_decoder", None, "train.stop_after_steps=8"), workdir)
    return losses(workdir)


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (root only; where mounting is not allowed the test is skipped)."""
    path = tmp_path / "disk"
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", f"scalestudy-{uuid.uuid4().hex[:8]}", path],
        capture_output=True,
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield path
    subprocess.run(["umount", "-l", path], check=False)


def fill(path, leave: int) -> None:
    """Fill the file system of `path` until `leave` bytes are free."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    with (path / "filler").open("wb") as f:
        f.write(b"\0" * max(free - leave, 0))


def test_a_changed_config_is_refused_and_nothing_is_touched(tiny_cfg, straight, tmp_path):
    loop.train(tiny_cfg("causal_decoder", None, "train.stop_after_steps=4"), tmp_path)
    before = snapshot(tmp_path)
    changed = tiny_cfg(
        "causal_decoder",
        None,
        "train.stop_after_steps=8",
        "model.d_model=48",
        "optim.name=adafactor",
    )
    with pytest.raises(resume.ResumeConfigError) as error:
        loop.train(changed, tmp_path)
    message = str(error.value)
    assert "model.d_model: 32 in the run, 48 given" in message
    assert "optim.name: 'adamw' in the run, 'adafactor' given" in message
    assert "train.init_from=" in message and "stop_after_steps" not in message.split("\n")[1]
    assert snapshot(tmp_path) == before  # config.yaml, checkpoints, metrics: untouched
    # Keys that are safe to change on resume are accepted and recorded.
    safe = tiny_cfg(
        "causal_decoder",
        None,
        "train.stop_after_steps=8",
        "train.checkpoint_every=2",
        "train.keep_last=3",
        "eval.every_steps=0",
        "mesh.data=2",
        "mesh.fsdp=4",
    )
    loop.train(safe, tmp_path)
    assert "checkpoint_every: 2" in (tmp_path / "config.yaml").read_text()
    got = losses(tmp_path)
    assert got[:4] == straight[:4]
    # Another mesh sums in another order (bfloat16 compute): close, not bitwise.
    assert got[4:] == pytest.approx(straight[4:], rel=1e-3)
    assert saved.latest_step(tmp_path) == 8


def test_the_cli_reports_a_refused_resume_in_one_error(tiny_cfg, tmp_path, capsys):
    run = tmp_path / "run"
    cfg = tiny_cfg("causal_decoder", None, "train.stop_after_steps=2")
    loop.train(cfg, run)
    code = cli.main(["train", "--workdir", str(run), "model.n_layers=3"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --workdir") and "Traceback" not in err
    assert "model.n_layers: 2 in the run, 3 given" in err
    assert "n_layers: 2" in (run / "config.yaml").read_text()  # never written


def test_a_workdir_that_is_a_file(tiny_cfg, tmp_path, capsys):
    path = tmp_path / "file"
    path.write_text("not a directory")
    with pytest.raises(loop.RunDirError, match="is a file; give a directory"):
        loop.train(tiny_cfg("causal_decoder"), path)
    (tmp_path / "cfg.yaml").write_text(to_yaml(tiny_cfg("causal_decoder")))
    code = cli.main(["train", "--config", str(tmp_path / "cfg.yaml"), "--workdir", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "is a file" in err
    assert path.read_text() == "not a directory"


def test_disk_full_then_torn_metrics_then_read_only(tiny_cfg, straight, small_disk):
    """A save that fails on a full disk stops the run at that save with one error naming it,
    earlier checkpoints stay and the run resumes exactly once space is back, even with a torn
    last metrics line; a read-only run directory is one error too."""
    run = small_disk / "run"
    cfg = tiny_cfg("causal_decoder", None, "train.stop_after_steps=4")
    loop.train(cfg, run)
    fill(small_disk, leave=48 * 1024)  # room for metrics rows, not for a checkpoint
    longer = tiny_cfg("causal_decoder", None, "train.stop_after_steps=40")
    with pytest.raises(checkpoint.CheckpointWriteError) as error:
        loop.train(longer, run)
    message = str(error.value)
    assert "checkpoint of step 8" in message and "No space left on device" in message
    assert "intact (steps [4])" in message
    assert max(r["step"] for r in rundir.read_metrics(run)) <= 12  # the next boundary at most
    assert saved.latest_step(run) == 4
    (small_disk / "filler").unlink()
    with (run / rundir.METRICS).open("a") as f:
        f.write('{"step": 13, "train/lo')  # what a full disk or a power cut leaves
    loop.train(tiny_cfg("causal_decoder", None, "train.stop_after_steps=8"), run)
    assert losses(run) == straight
    subprocess.run(["mount", "-o", "remount,ro", small_disk], check=True)
    before = snapshot(run)
    with pytest.raises(loop.RunDirError, match=r"Read-only file system.*up to step 8 are intact"):
        loop.train(tiny_cfg("causal_decoder", None, "train.stop_after_steps=12"), run)
    assert snapshot(run) == before


def test_a_failed_save_names_its_step_without_root(tiny_cfg, tmp_path, monkeypatch):
    """The same as the full disk above, anywhere: orbax's writer reports ENOSPC at step 8 the
    way tensorstore does (a ValueError carrying the OS error code)."""
    import orbax.checkpoint as ocp

    real = ocp.CheckpointManager.save

    def full_at_8(self, step, *args, **kwargs):
        if step == 8:
            raise ValueError(
                'RESOURCE_EXHAUSTED: Error writing "params": No space left on device '
                "[os_error_code='28']"
            )
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", full_at_8)
    with pytest.raises(checkpoint.CheckpointWriteError) as error:
        loop.train(tiny_cfg("causal_decoder", None, "train.stop_after_steps=10"), tmp_path)
    assert str(error.value).startswith(
        "cannot write the checkpoint of step 8 to "
    ) and "[Errno 28] No space left on device. Earlier checkpoints are intact (steps [4])" in str(
        error.value
    )
    assert saved.latest_step(tmp_path) == 4
    assert max(r["step"] for r in rundir.read_metrics(tmp_path)) <= 8
