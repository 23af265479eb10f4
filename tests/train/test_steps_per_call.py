"""Several optimizer steps per compiled call (train.steps_per_call): the same run, exactly."""

from collections import OrderedDict

import jax
import numpy as np
import pytest

from scalestudy.train import loop
from scalestudy.train import program as train_program
from scalestudy.train.rundir import layout as rundir
from scalestudy.train.rundir import saved_run

pytestmark = pytest.mark.optimized  # a call of k steps against k calls, bit for bit

# Log and checkpoint every 4 steps, so that calls of 4 steps line up with every row and save.
CADENCE = ("train.log_every=4", "train.checkpoint_every=4")
VOLATILE = ("wall_time_s", "tokens_per_s")  # clock readings


def rows(workdir):
    return [
        {k: v for k, v in r.items() if k not in VOLATILE}
        for r in rundir.read_metrics(workdir)
        if "train/loss" in r
    ]


def assert_same_run(dir_a, dir_b):
    """The same losses and parameters bit for bit; the other metrics (reductions XLA may fuse
    differently inside the loop of several steps) within float32 rounding."""
    a, b = rows(dir_a), rows(dir_b)
    assert [r["train/loss"] for r in a] == [r["train/loss"] for r in b]
    assert [r.keys() for r in a] == [r.keys() for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert ra == pytest.approx(rb, rel=1e-6, abs=1e-9)
    assert_same_params(dir_a, dir_b)


def assert_same_params(dir_a, dir_b):
    _, a, step_a = saved_run.restore_params(dir_a)
    _, b, step_b = saved_run.restore_params(dir_b)
    assert step_a == step_b
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def one_per_call(tiny_cfg, tmp_path_factory):
    """12 steps of the causal decoder, one step per call (the reference)."""
    workdir = tmp_path_factory.mktemp("one_per_call")
    cfg = tiny_cfg("causal_decoder", None, *CADENCE, "train.stop_after_steps=12")
    return workdir, loop.train(cfg, workdir)


def test_four_steps_per_call_equal_one_step_per_call(tiny_cfg, one_per_call, tmp_path):
    ref_dir, ref = one_per_call
    cfg = tiny_cfg(
        "causal_decoder", None, *CADENCE, "train.stop_after_steps=12", "train.steps_per_call=4"
    )
    summary = loop.train(cfg, tmp_path)
    assert [r["step"] for r in rows(tmp_path)] == [4, 8, 12]
    assert_same_run(tmp_path, ref_dir)
    for key in ("loss_tokens", "positions", "document_tokens", "final_train_loss"):
        assert summary[key] == ref[key]


def test_resume_across_calls_is_exact(tiny_cfg, one_per_call, tmp_path):
    """Stopped at step 8 (two calls of 4), resumed with calls of 2 up to 12: the reference."""
    ref_dir, ref = one_per_call
    first = tiny_cfg(
        "causal_decoder", None, *CADENCE, "train.stop_after_steps=8", "train.steps_per_call=4"
    )
    loop.train(first, tmp_path)
    assert saved_run.latest_step(tmp_path) == 8
    rest = first.replace(train=first.train.replace(stop_after_steps=12, steps_per_call=2))
    summary = loop.train(rest, tmp_path)
    assert_same_run(tmp_path, ref_dir)
    assert summary["loss_tokens"] == ref["loss_tokens"]


def test_calls_that_would_cross_a_log_step_run_one_step_each(tiny_cfg, one_per_call, tmp_path):
    """log_every=3 and calls of 4 never line up: every call crossing a row falls back to single
    steps, and the rows still equal the reference's at the steps both wrote."""
    ref_dir, _ = one_per_call
    cfg = tiny_cfg(
        "causal_decoder",
        None,
        "train.log_every=3",
        "train.checkpoint_every=4",
        "train.stop_after_steps=12",
        "train.steps_per_call=4",
    )
    loop.train(cfg, tmp_path)
    got = {r["step"]: r["train/loss"] for r in rows(tmp_path)}
    assert sorted(got) == [3, 6, 9, 12]
    want = {r["step"]: r["train/loss"] for r in rows(ref_dir)}
    assert got[12] == want[12]
    assert_same_params(tmp_path, ref_dir)


def test_a_run_whose_calls_line_up_never_compiles_the_single_step(tiny_cfg, monkeypatch, tmp_path):
    """Every call of 4 steps ends on a log and checkpoint step: the single step, compiled only
    when first called, stays uncompiled; one that breaks a call (above) compiles it."""
    monkeypatch.setattr(train_program, "_PROGRAMS", OrderedDict())
    cfg = tiny_cfg(
        "causal_decoder", None, *CADENCE, "train.stop_after_steps=8", "train.steps_per_call=4"
    )
    loop.train(cfg, tmp_path / "lined_up")
    (program,) = train_program._PROGRAMS.values()
    assert program.train_step.compiled is None
    odd = cfg.replace(train=cfg.train.replace(log_every=3, stop_after_steps=3))
    loop.train(odd, tmp_path / "broken")
    assert program.train_step.compiled is not None
