"""A damaged member resumes inside its group: its directory deleted, or its newest checkpoint
corrupted, it trains again in its own slot of the group's program while the others wait, and
every member's losses equal the uninterrupted group's bit for bit.

Marked `optimized`: the programs as users compile them. There a member trained alone is not
the member in its group (seed 0 below: equal at step 1, 1.4e-7 relative by step 8 on these 8
CPU devices), so a member retrained alone would not pass."""

import contextlib
import shutil
import signal

import pytest

from scalestudy.train import loop
from scalestudy.train.rundir import layout as rundir
from scalestudy.train.rundir import saved_run

# Three replicates (`--members seed=0,1,2`), float32, stopped at step 8 of the tiny schedule,
# checkpoints every 4 steps. Dropout off: with it on (0.1), these members happen to train
# alone to the bit as in the group, and the tests would not tell the two apart.
K = 3

pytestmark = pytest.mark.optimized


def _members(tiny_cfg, stop=8, *more):
    return [
        tiny_cfg(
            "causal_decoder",
            None,
            f"train.stop_after_steps={stop}",
            f"train.seed={s}",
            f"data.seed={s}",
            f"name=grp.seed{s}",
            "model.dtype=float32",
            "model.dropout=0.0",
            *more,
        )
        for s in range(K)
    ]


def _losses(workdir):
    return [r["train/loss"] for r in rundir.read_metrics(workdir) if "train/loss" in r]


def _val(workdir):
    return [r["val/loss"] for r in rundir.read_metrics(workdir) if "val/loss" in r]


def _flip_bytes(path, n=16):
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + n] = bytes(b ^ 0xFF for b in data[middle : middle + n])
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def straight(tiny_cfg, tmp_path_factory):
    """The uninterrupted group: each member's training and validation losses."""
    root = tmp_path_factory.mktemp("straight")
    dirs = [root / f"seed{s}" for s in range(K)]
    loop.train_group(_members(tiny_cfg), dirs)
    return [(_losses(d), _val(d)) for d in dirs]


def test_a_deleted_member_catches_up_inside_its_group(tiny_cfg, straight, tmp_path):
    dirs = [tmp_path / f"seed{s}" for s in range(K)]
    loop.train_group(_members(tiny_cfg, stop=4), dirs)
    shutil.rmtree(dirs[0])  # the others wait at step 4 while it trains steps 1-4 again
    results = loop.train_group(_members(tiny_cfg), dirs)
    assert [r["steps"] for r in results] == [8] * K
    assert [saved_run.latest_step(d) for d in dirs] == [8] * K
    for d, (losses, val) in zip(dirs, straight):
        assert len(losses) == 8
        assert _losses(d) == losses  # bit for bit, the retrained member's steps 1-8 too
        assert _val(d)[-1] == val[-1]  # (stopping at step 4 validated there as well)
    # A waiting member wrote no row twice: one training row per step.
    assert [r["step"] for r in rundir.read_metrics(dirs[1]) if "train/loss" in r] == list(
        range(1, 9)
    )


def test_a_corrupted_newest_checkpoint_resumes_inside_the_finished_group(
    tiny_cfg, straight, tmp_path
):
    dirs = [tmp_path / f"seed{s}" for s in range(K)]
    loop.train_group(_members(tiny_cfg), dirs)
    finished = [rundir.read_summary(d) for d in dirs]
    files = [p for p in (dirs[0] / "checkpoints" / "8" / "train").rglob("*") if p.is_file()]
    _flip_bytes(max(files, key=lambda p: p.stat().st_size))  # inside the optimizer state
    with pytest.warns(UserWarning, match=r"step 8 cannot be restored.*moved it"):
        results = loop.train_group(_members(tiny_cfg), dirs)  # once: no second command
    assert (dirs[0] / rundir.CORRUPT / "8").is_dir()
    assert [saved_run.latest_step(d) for d in dirs] == [8] * K
    for d, (losses, val) in zip(dirs, straight):
        assert _losses(d) == losses
        assert _val(d) == val
    # The finished members were not trained again: their summaries are the ones they had.
    assert results[1:] == finished[1:]
    assert [rundir.read_summary(d) for d in dirs[1:]] == finished[1:]
    assert results[0]["final_val_loss"] == finished[0]["final_val_loss"]


def test_a_group_stopped_while_a_member_waits_saves_only_where_each_stands(
    tiny_cfg, straight, tmp_path, monkeypatch
):
    dirs = [tmp_path / f"seed{s}" for s in range(K)]
    loop.train_group(_members(tiny_cfg, stop=4), dirs)
    shutil.rmtree(dirs[0])

    @contextlib.contextmanager
    def sigterm_after_step_2(check_every):
        yield lambda step: signal.SIGTERM if step == 2 else None

    with monkeypatch.context() as m:
        m.setattr(loop.distributed, "stop_requests", sigterm_after_step_2)
        with pytest.raises(loop.Preempted, match="at step 2"):
            loop.train_group(_members(tiny_cfg), dirs)
    # The catching-up member saved step 2; the waiting ones kept step 4 and its rows.
    assert [saved_run.latest_step(d) for d in dirs] == [2, 4, 4]
    assert [len(_losses(d)) for d in dirs] == [2, 4, 4]
    loop.train_group(_members(tiny_cfg), dirs)
    for d, (losses, _) in zip(dirs, straight):
        assert _losses(d) == losses


def test_the_batched_program_resumes_a_deleted_member_bit_for_bit(tiny_cfg, tmp_path):
    vmap = "mesh.member_program=vmap"
    whole = [tmp_path / f"whole{s}" for s in range(K)]
    loop.train_group(_members(tiny_cfg, 8, vmap), whole)
    dirs = [tmp_path / f"seed{s}" for s in range(K)]
    loop.train_group(_members(tiny_cfg, 4, vmap), dirs)
    shutil.rmtree(dirs[0])
    loop.train_group(_members(tiny_cfg, 8, vmap), dirs)
    for d, w in zip(dirs, whole):
        assert len(_losses(w)) == 8
        assert _losses(d) == _losses(w)
