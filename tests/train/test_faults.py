"""Faults on one host: a changed config, a full or read-only disk, a torn metrics line, a
run directory that is a file. Each must stop with one clear error and lose nothing."""

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from scalestudy.cli import main as cli
from scalestudy.config.experiment import to_yaml
from scalestudy.models.api import build_model
from scalestudy.train import loop
from scalestudy.train.rundir import (
    checkpoint,
    checkpoint_writers,
    metrics_writer,
    resume_check,
    saved_run,
)
from scalestudy.train.rundir import layout as rundir


def losses(workdir):
    return [r["train/loss"] for r in rundir.read_metrics(workdir) if "train/loss" in r]


def losses_rows(workdir):
    return [r for r in rundir.read_metrics(workdir) if "train/loss" in r]


def snapshot(workdir):
    """Every file under `workdir` with its bytes (what a refused resume must not touch; the
    library log may grow)."""
    return {
        p.relative_to(workdir): p.read_bytes()
        for p in sorted(workdir.rglob("*"))
        if p.is_file() and p.name != rundir.LOG
    }


@pytest.fixture(scope="module")
def straight(tiny_cfg, tmp_path_factory):
    """8 uninterrupted steps (the reference every resumed run must reproduce)."""
    workdir = tmp_path_factory.mktemp("straight")
    loop.train(tiny_cfg("causal_decoder", None, "train.stop_after_steps=8"), workdir)
    return losses(workdir)


def remount_read_only(path) -> None:
    """Remount the small disk read-only. The kernel refuses while a file on it is open for
    writing, so a failed save's writers that outlived its error would show here: name them."""
    done = subprocess.run(["mount", "-o", "remount,ro", path], capture_output=True, text=True)
    if done.returncode:
        held = checkpoint_writers.open_files_under(path)
        raise AssertionError(
            f"cannot remount {path} read-only: {done.stderr.strip()}; open: {held}"
        )


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
    with pytest.raises(resume_check.ResumeConfigError) as error:
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
    assert saved_run.latest_step(tmp_path) == 8


def test_the_cli_reports_a_refused_resume_in_one_error(tiny_cfg, tmp_path, capsys):
    run = tmp_path / "run"
    cfg = tiny_cfg("causal_decoder", None, "train.stop_after_steps=2")
    loop.train(cfg, run)
    code = cli.main(["train", "--workdir", str(run), "model.n_layers=3"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --workdir") and "Traceback" not in err
    assert "model.n_layers: 2 in the run, 3 given" in err
    assert "n_layers: 2" in (run / "config.yaml").read_text()  # never written


def test_a_config_yaml_edited_since_the_checkpoint_is_refused(tiny_cfg, tmp_path, capsys):
    """`train --workdir W` reads W/config.yaml; edited after the checkpoint was saved, it
    would change the run as it resumes (the learning rate here), so it is refused."""
    run = tmp_path / "run"
    loop.train(tiny_cfg("causal_decoder", None, "train.stop_after_steps=2"), run)
    path = run / "config.yaml"
    path.write_text(path.read_text().replace("learning_rate: 0.01", "learning_rate: 0.5"))
    before = snapshot(run)
    code = cli.main(["train", "--workdir", str(run), "train.stop_after_steps=4"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err
    assert "optim.learning_rate: 0.01 in the checkpoint, 0.5 in config.yaml" in err
    assert "train.init_from=" in err
    assert snapshot(run) == before and saved_run.latest_step(run) == 2


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


def test_disk_full_then_torn_metrics_then_read_only(tiny_cfg, straight, small_disk, fill):
    """A save that fails on a full disk stops the run at that save with one error naming it,
    earlier checkpoints stay and the run resumes exactly once space is back, even with a torn
    last metrics line; a read-only run directory is one error too."""
    run = small_disk / "run"
    cfg = tiny_cfg("causal_decoder", None, "train.stop_after_steps=4")
    loop.train(cfg, run)
    # Room for metrics rows and the libraries' log lines in train.log (orbax logs its failed
    # writes there), not for a checkpoint (about 400 KiB).
    fill(small_disk, leave=160 * 1024)
    longer = tiny_cfg("causal_decoder", None, "train.stop_after_steps=40")
    with pytest.raises(checkpoint.CheckpointWriteError) as error:
        loop.train(longer, run)
    message = str(error.value)
    assert "checkpoint of step 8" in message and "No space left on device" in message
    assert "intact (steps [4])" in message
    assert max(r["step"] for r in rundir.read_metrics(run)) <= 12  # the next boundary at most
    assert saved_run.latest_step(run) == 4
    # The failed save is over: nothing of it is left running, open or unfinished on the disk.
    assert not list((run / "checkpoints").glob(f"*{checkpoint_writers.TMP_SUFFIX}*"))
    assert checkpoint_writers.unfinished_saves(run / "checkpoints") == []
    assert checkpoint_writers.open_files_under(run / "checkpoints") == []
    (small_disk / "filler").unlink()
    with (run / rundir.METRICS).open("a") as f:
        f.write('{"step": 13, "train/lo')  # what a full disk or a power cut leaves
    loop.train(tiny_cfg("causal_decoder", None, "train.stop_after_steps=8"), run)
    assert losses(run) == straight
    remount_read_only(small_disk)
    before = snapshot(run)
    with pytest.raises(loop.RunDirError, match=r"Read-only file system.*up to step 8 are intact"):
        loop.train(tiny_cfg("causal_decoder", None, "train.stop_after_steps=12"), run)
    assert snapshot(run) == before


def test_a_failed_save_names_its_step_without_root(tiny_cfg, tmp_path, monkeypatch):
    """The same as the full disk above, anywhere: orbax's writer reports ENOSPC at step 8 the
    way tensorstore does (a ValueError carrying the OS error code) while another write of
    that save is still in flight on a thread of its own, its file open in the save's own
    directory. When the error arrives that write is over and nothing of the save is left
    unfinished on the disk."""
    import threading

    import orbax.checkpoint as ocp

    real, real_claim = ocp.CheckpointManager.save, checkpoint_writers.claim
    save_dirs, writers, written = [], [], []

    def claim(save_dir):
        save_dirs.append(save_dir)
        real_claim(save_dir)

    def write_slowly(f):
        with f:
            for _ in range(15):
                f.write(b"\0" * 4096)
                f.flush()
                time.sleep(0.1)
            written.append(f.name)  # before the file is closed, so before the error

    def full_at_8(self, step, *args, **kwargs):
        if step == 8:
            tmp = save_dirs[-1] / f"8{checkpoint_writers.TMP_SUFFIX}" / "params"
            tmp.mkdir(parents=True)
            writers.append(
                threading.Thread(target=write_slowly, args=((tmp / "chunk").open("wb"),))
            )
            writers[0].start()
            raise ValueError(
                'RESOURCE_EXHAUSTED: Error writing "params": No space left on device '
                "[os_error_code='28']"
            )
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(checkpoint_writers, "claim", claim)
    monkeypatch.setattr(ocp.CheckpointManager, "save", full_at_8)
    with pytest.raises(checkpoint.CheckpointWriteError) as error:
        loop.train(tiny_cfg("causal_decoder", None, "train.stop_after_steps=10"), tmp_path)
    assert len(written) == 1
    writers[0].join(timeout=60)  # a safety net: it ends as it closes its file
    assert not writers[0].is_alive()
    assert not list((tmp_path / "checkpoints").glob(f"*{checkpoint_writers.TMP_SUFFIX}*"))
    assert checkpoint_writers.unfinished_saves(tmp_path / "checkpoints") == []
    assert checkpoint_writers.open_files_under(tmp_path / "checkpoints") == []
    assert str(error.value).startswith(
        "cannot write the checkpoint of step 8 to "
    ) and "[Errno 28] No space left on device. Earlier checkpoints are intact (steps [4])" in str(
        error.value
    )
    assert saved_run.latest_step(tmp_path) == 4
    assert max(r["step"] for r in rundir.read_metrics(tmp_path)) <= 8


def test_a_save_whose_checksums_cannot_be_written_is_not_called_intact(
    tiny_cfg, tmp_path, monkeypatch
):
    """The disk fills after orbax has finished step 8 but before its checksums are written:
    the error names step 8 as the failed save and lists only the earlier steps as intact."""
    real = checkpoint.write_checksums

    def full_at_8(step_dir):
        if Path(step_dir).name == "8":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(step_dir)

    monkeypatch.setattr(checkpoint, "write_checksums", full_at_8)
    with pytest.raises(checkpoint.CheckpointWriteError) as error:
        loop.train(tiny_cfg("causal_decoder", None, "train.stop_after_steps=10"), tmp_path)
    message = str(error.value)
    assert message.startswith("cannot write the checkpoint of step 8 to ")
    assert "Earlier checkpoints are intact (steps [4])" in message, message
    assert "step 8's files were written without their checksums" in message


def test_a_late_write_of_a_failed_save_never_reaches_the_resumed_save(
    tiny_cfg, tmp_path, monkeypatch
):
    """A failed save leaves tensorstore writes behind that nothing can wait for: orbax awaits
    them no more, some run a moment later (under load, seconds), some never. Here the save of
    step 8 fails (its data item reports ENOSPC) and one of its parameter writes lands only
    while the run resumed in the same process saves step 8 again, through tensorstore's file
    driver, which makes the directories it is missing. It must land nowhere: not in the new
    checkpoint of step 8, and not as a directory the failed save left behind."""
    import threading

    import orbax.checkpoint as ocp
    import tensorstore as ts

    real = ocp.JsonCheckpointHandler._save_fn
    failed, landed = [], []

    def late_write(item_dir):
        """The failed save's write of a parameter chunk, as tensorstore makes it."""
        params = item_dir.parent / f"params{checkpoint_writers.TMP_SUFFIX}"
        store = ts.KvStore.open(f"file://{params}/").result()
        try:
            store.write("ocdbt.process_0/d/late", b"\0" * 4096).result()
            landed.append(str(params))
        except ValueError:  # no directory can be made there: the write fails, unread
            pass

    async def save_fn(self, x, directory):
        if directory.name.startswith("data") and directory.parent.name.startswith(
            f"8{checkpoint_writers.TMP_SUFFIX}"
        ):
            if not failed:
                failed.append(Path(directory))
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            writer = threading.Thread(target=late_write, args=(failed[0],))
            writer.start()
            writer.join()  # landed, or failed, before this save goes on
        await real(self, x, directory)

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", save_fn)
    with pytest.raises(checkpoint.CheckpointWriteError, match=r"step 8 .*No space left on device"):
        loop.train(tiny_cfg("causal_decoder", None, "train.stop_after_steps=10"), tmp_path)
    assert checkpoint_writers.unfinished_saves(tmp_path / "checkpoints") == []
    loop.train(tiny_cfg("causal_decoder", None, "train.stop_after_steps=8"), tmp_path)
    assert saved_run.latest_step(tmp_path) == 8
    assert landed == [] and not list((tmp_path / "checkpoints").rglob("late"))
    assert checkpoint_writers.unfinished_saves(tmp_path / "checkpoints") == []
    assert checkpoint.checksum_problem(tmp_path / "checkpoints" / "8") is None


# ----------------------------------------------------------------------------- faults, round 3


def _cli_train(tmp_path, cfg, workdir="run", **popen):
    (tmp_path / "cfg.yaml").write_text(to_yaml(cfg))
    command = [sys.executable, "-m", "scalestudy.cli.main", "train", "--config", "cfg.yaml"]
    return subprocess.Popen(
        [*command, "--workdir", workdir], cwd=tmp_path, stderr=subprocess.PIPE, text=True, **popen
    )


def test_sigterm_on_a_checkpoint_step_saves_once_and_exits_143(tiny_cfg, tmp_path):
    """Every step is a checkpoint step, so the signal always lands right after a save."""
    proc = _cli_train(tmp_path, tiny_cfg("causal_decoder", None, "train.checkpoint_every=1"))
    deadline = time.time() + 240
    while len(losses(tmp_path / "run")) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)  # a safety net under load, not a measurement
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("stopped: SIGTERM received: saved a checkpoint at step"), err
    # Python-level library logs (absl, orbax) and tracebacks go to the run's log file.
    assert "Traceback" not in err and "StepAlreadyExists" not in err
    assert "WARNING:absl" not in err and "INFO:absl" not in err
    assert (tmp_path / "run" / rundir.LOG).is_file()
    stopped_at = saved_run.latest_step(tmp_path / "run")
    assert len(losses(tmp_path / "run")) == stopped_at


def test_a_second_train_on_one_workdir_is_refused_naming_the_holder(tiny_cfg, tmp_path):
    with rundir.run_lock(tmp_path) as holder, pytest.raises(rundir.RunLockError) as error:
        loop.train(tiny_cfg("causal_decoder", None, "train.stop_after_steps=2"), tmp_path)
    message = str(error.value)
    assert f"pid {holder['pid']} on {holder['host']}, started {holder['started']}" in message
    assert not (tmp_path / rundir.CONFIG).exists()  # refused before anything was written


def test_a_dead_holders_run_lock_is_taken_over_and_a_remote_one_refused(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], text=True, capture_output=True
    ).stdout.strip()
    record = {"pid": int(dead), "host": socket.gethostname(), "started": "earlier"}
    rundir.lock_path(tmp_path).write_text(json.dumps(record))
    with rundir.run_lock(tmp_path) as me:
        assert me["pid"] == os.getpid()
    record["host"] = "elsewhere"
    rundir.lock_path(tmp_path).write_text(json.dumps(record))
    refused = r"pid \d+ on elsewhere.*once that job is gone"
    with pytest.raises(rundir.RunLockError, match=refused), rundir.run_lock(tmp_path):
        pass


def _flip_bytes(path, n=16):
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + n] = bytes(b ^ 0xFF for b in data[middle : middle + n])
    path.write_bytes(bytes(data))


def test_a_silently_corrupted_newest_checkpoint_is_set_aside(tiny_cfg, straight, tmp_path):
    loop.train(tiny_cfg("causal_decoder", None, "train.stop_after_steps=8"), tmp_path)
    files = [p for p in (tmp_path / "checkpoints" / "8" / "train").rglob("*") if p.is_file()]
    _flip_bytes(max(files, key=lambda p: p.stat().st_size))  # inside the optimizer state
    with pytest.warns(UserWarning, match=r"step 8 cannot be restored.*checksums.*moved it"):
        loop.train(tiny_cfg("causal_decoder", None, "train.stop_after_steps=8"), tmp_path)
    assert (tmp_path / rundir.CORRUPT / "8").is_dir()
    assert losses(tmp_path) == straight  # resumed from step 4, identical to the straight run


def test_a_checkpoint_without_checksums_is_restored_with_a_warning(tiny_cfg, straight, tmp_path):
    """Its files cannot be checked against what was saved (a changed data cursor would pass):
    it is restored, and the run says it is unverified."""
    loop.train(tiny_cfg("causal_decoder", None, "train.stop_after_steps=4"), tmp_path)
    (tmp_path / "checkpoints" / "4" / checkpoint.CHECKSUMS).unlink()
    with pytest.warns(UserWarning, match=r"step 4 .* has no checksums.json.*unverified"):
        loop.train(tiny_cfg("causal_decoder", None, "train.stop_after_steps=8"), tmp_path)
    assert losses(tmp_path) == straight


@pytest.mark.parametrize("only", [False, True], ids=["an-older-one", "none-older"])
def test_a_file_in_place_of_a_checkpoint_is_set_aside_not_skipped(tiny_cfg, tmp_path, only):
    """`checkpoints/8` replaced by a plain file: orbax does not list it, and the run went back
    to the older checkpoint (or to step 0) without a word, rewriting the metrics rows."""
    cfg = tiny_cfg("causal_decoder", None, "train.stop_after_steps=8")
    loop.train(cfg, tmp_path)
    shutil.rmtree(tmp_path / "checkpoints" / "8")
    if only:
        shutil.rmtree(tmp_path / "checkpoints" / "4")
    (tmp_path / "checkpoints" / "8").write_text("not a checkpoint")
    rows = (tmp_path / "metrics.jsonl").read_bytes()
    if only:
        with (
            pytest.warns(UserWarning, match="is not a checkpoint directory"),
            pytest.raises(checkpoint.CheckpointError, match="no readable checkpoint"),
        ):
            loop.train(cfg, tmp_path)
        assert (tmp_path / "metrics.jsonl").read_bytes() == rows  # never restarted from 0
    else:
        with pytest.warns(UserWarning, match="checkpoints/8 is not a checkpoint directory"):
            loop.train(cfg, tmp_path)
        assert saved_run.latest_step(tmp_path) == 8
    assert (tmp_path / rundir.CORRUPT / "8").read_text() == "not a checkpoint"


def test_a_nan_right_after_a_restore_names_the_checkpoint(tiny_cfg, tmp_path, monkeypatch):
    loop.train(tiny_cfg("causal_decoder", None, "train.stop_after_steps=4"), tmp_path)
    real_build = loop.build_program

    def build_with_nan(*args, **kwargs):
        program = real_build(*args, **kwargs)
        real_step = program.train_step

        def poisoned(state, batch, *hyper):
            state, m = real_step(state, batch, *hyper)
            return state, {**m, "train/loss": m["train/loss"] * np.nan}

        return type(program)(**{**program.__dict__, "train_step": poisoned})

    monkeypatch.setattr(loop, "build_program", build_with_nan)
    with pytest.raises(loop.NonFiniteLoss, match=r"resuming from the one of step 4.*suspect"):
        loop.train(tiny_cfg("causal_decoder", None, "train.stop_after_steps=8"), tmp_path)


def test_metric_rows_are_durable_at_checkpoints_and_lost_rows_are_named(
    tiny_cfg, tmp_path, monkeypatch
):
    events = []
    real_sync, real_save = metrics_writer.MetricsWriter.sync, checkpoint.Checkpointer.save

    def sync(self):
        events.append(("sync", [r["step"] for r in losses_rows(tmp_path)]))
        real_sync(self)

    def save(self, at, *args):
        events.append(("save", at))
        real_save(self, at, *args)

    monkeypatch.setattr(metrics_writer.MetricsWriter, "sync", sync)
    monkeypatch.setattr(checkpoint.Checkpointer, "save", save)
    loop.train(tiny_cfg("causal_decoder", None, "train.stop_after_steps=8"), tmp_path)
    # Before each save, every row up to that step is on disk (log_every=1: one per step).
    assert events == [
        ("sync", [1, 2, 3, 4]),
        ("save", 4),
        ("sync", [1, 2, 3, 4, 5, 6, 7, 8]),
        ("save", 8),
    ]
    path = rundir.metrics_path(tmp_path)
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:2] + lines[4:]) + "\n")  # rows of steps 3 and 4 lost
    with pytest.warns(UserWarning, match=r"lacks 2 of the 8 training rows logged up to step 8"):
        loop.train(tiny_cfg("causal_decoder", None, "train.stop_after_steps=9"), tmp_path)


def test_attention_rank_on_a_read_only_run_prints_the_scores_then_one_line(
    tiny_cfg, tmp_path, capsys, monkeypatch
):
    cfg = tiny_cfg("causal_decoder")
    run = tmp_path / "run"
    params = jax.jit(build_model(cfg.model).init)(jax.random.key(3))
    ckpt = checkpoint.Checkpointer(rundir.checkpoints_dir(run), async_save=False)
    ckpt.save(7, {"params": params, "step": np.int32(7)}, {}, cfg)
    ckpt.close()
    real_write = rundir.write_atomic

    def read_only_run(path, text):
        if path.parent == run:
            raise OSError(errno.EROFS, "Read-only file system")
        real_write(path, text)

    monkeypatch.setattr(rundir, "write_atomic", read_only_run)
    assert cli.main(["attention-rank", "--workdir", str(run), "--json"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out)["step"] == 7  # the scores computed are shown
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: could not update the run directory") and "--out" in last
    assert (
        cli.main(["attention-rank", "--workdir", str(run), "--out", str(tmp_path / "p.json")]) == 0
    )
    assert json.loads((tmp_path / "p.json").read_text())["step"] == 7
    assert not rundir.attention_rank_path(run).exists()


def test_eval_into_a_run_whose_metrics_file_is_a_directory_writes_nothing(
    tiny_cfg, tmp_path, capsys
):
    """All or nothing: the results are shown and refused whole, summary.json and the
    per-example files untouched (they were updated while metrics.jsonl was not)."""
    cfg = tiny_cfg("causal_decoder")
    run = tmp_path / "run"
    params = jax.jit(build_model(cfg.model).init)(jax.random.key(3))
    ckpt = checkpoint.Checkpointer(rundir.checkpoints_dir(run), async_save=False)
    ckpt.save(7, {"params": params, "step": np.int32(7)}, {}, cfg)
    ckpt.close()
    (run / "summary.json").write_text(json.dumps({"name": "run", "steps": 7}))
    rundir.metrics_path(run).mkdir()
    argv = ["eval", "--workdir", str(run), "--tasks", "synthetic_probes", "--max-examples", "2"]
    assert cli.main([*argv, "--json"]) == 2
    out, err = capsys.readouterr()
    assert "synthetic_probes/acc" in json.loads(out)  # the scores computed are shown
    last = err.strip().splitlines()[-1]
    assert "metrics.jsonl is not a file; nothing was written there" in last
    assert json.loads((run / "summary.json").read_text()) == {"name": "run", "steps": 7}
    assert not (run / "eval_examples").exists()
