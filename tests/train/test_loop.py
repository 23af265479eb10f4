"""The training loop: exact resume, WSD branches, corrupt checkpoints, NaN, preemption."""

import json
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from scalestudy.config.experiment import to_yaml
from scalestudy.data import pipeline
from scalestudy.models import counting
from scalestudy.train import datasheets, loop
from scalestudy.train.rundir import layout as rundir
from scalestudy.train.rundir import saved_run

ARCHS = ["causal_decoder", "noncausal_decoder", "encoder_decoder"]


def losses(workdir):
    return [r["train/loss"] for r in rundir.read_metrics(workdir) if "train/loss" in r]


def params_equal(dir_a, dir_b):
    _, a, step_a = saved_run.restore_params(dir_a)
    _, b, step_b = saved_run.restore_params(dir_b)
    assert step_a == step_b
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def straight(tiny_cfg, tmp_path_factory):
    """8 uninterrupted steps of each architecture (cached per module)."""
    runs = {}

    def get(arch):
        if arch not in runs:
            workdir = tmp_path_factory.mktemp(f"straight_{arch}")
            summary = loop.train(tiny_cfg(arch, None, "train.stop_after_steps=8"), workdir)
            runs[arch] = (workdir, summary)
        return runs[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_exact_resume(tiny_cfg, straight, tmp_path, arch):
    ref_dir, ref = straight(arch)
    for stop in (4, 8):
        summary = loop.train(tiny_cfg(arch, None, f"train.stop_after_steps={stop}"), tmp_path)
    # Bitwise on CPU: same compiled program, same inputs, deterministic XLA CPU kernels.
    assert losses(tmp_path) == losses(ref_dir) and len(losses(ref_dir)) == 8
    params_equal(tmp_path, ref_dir)
    for key in ("tokens", "positions", "document_tokens", "flops", "final_val_loss", "steps"):
        assert summary[key] == ref[key], key
    assert summary["complete"] is False and summary["steps"] == 8
    rows = len(rundir.read_metrics(tmp_path))
    again = loop.train(tiny_cfg(arch, None, "train.stop_after_steps=8"), tmp_path)
    assert again == summary and len(rundir.read_metrics(tmp_path)) == rows
    assert ref["tokens"] > 0 and ref["positions"] >= ref["tokens"]
    assert ref["flops"] == 8 * 16 * counting.flops(tiny_cfg(arch))["flops_per_example"]
    assert ref["loss_tokens"] == ref["tokens"] and ref["document_tokens"] > 0


def test_document_tokens_are_the_corpus_tokens_the_batches_hold(tiny_cfg, straight):
    """Causal FLM: every non-padding decoder position holds one corpus token, so the
    document tokens read equal the real positions of the 8 batches (counted from the
    batches, not from the pipeline's bookkeeping)."""
    _, summary = straight("causal_decoder")
    it = pipeline.make_iterator(tiny_cfg("causal_decoder"), "train")
    real = sum(int((next(it)["decoder_segment_ids"] > 0).sum()) for _ in range(8))
    assert summary["document_tokens"] == real


def test_summary_and_run_directory(straight):
    workdir, summary = straight("causal_decoder")
    assert {p.name for p in workdir.iterdir()} >= {
        "config.yaml",
        "metrics.jsonl",
        "checkpoints",
        "summary.json",
        "tensorboard",
        "train.log",
        "run.lock",
    }
    assert (workdir / "checkpoints" / "8" / "checksums.json").is_file()
    assert json.loads((workdir / "summary.json").read_text()) == summary
    rows = rundir.read_metrics(workdir)
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, 9))
    assert rows[-1]["val/loss"] == summary["final_val_loss"] == summary["best_val_loss"]
    assert rows[-2]["tokens"] == summary["tokens"]
    assert 0 < summary["mfu"] < 1 and summary["tokens_per_s"] > 0
    assert saved_run.latest_step(workdir) == 8


def test_wsd_cooldown_branch_equals_a_run_from_scratch(tiny_cfg, straight, tmp_path):
    stable_dir, _ = straight("causal_decoder")  # wsd over 40 steps: step 4 is in the stable phase
    branch = ["train.steps=12", "optim.cooldown_steps=4"]
    loop.train(tiny_cfg("causal_decoder", None, *branch), tmp_path / "scratch")
    loop.train(
        tiny_cfg(
            "causal_decoder", None, *branch, f"train.init_from={stable_dir}", "train.init_step=4"
        ),
        tmp_path / "branch",
    )
    assert losses(tmp_path / "branch") == losses(tmp_path / "scratch")[4:]
    params_equal(tmp_path / "branch", tmp_path / "scratch")


def test_corrupt_latest_checkpoint_falls_back(tiny_cfg, straight, tmp_path):
    ref_dir, _ = straight("causal_decoder")
    for stop in (6, 8):
        cfg = tiny_cfg(
            "causal_decoder", None, "train.checkpoint_every=2", f"train.stop_after_steps={stop}"
        )
        if stop == 8:
            for f in (tmp_path / "checkpoints/6/params").rglob("*"):
                if f.is_file():
                    f.write_bytes(b"\0" * 7)
            with pytest.warns(UserWarning, match="step 6 cannot be restored"):
                loop.train(cfg, tmp_path)
        else:
            loop.train(cfg, tmp_path)
    assert (tmp_path / "corrupt_checkpoints/6").is_dir()
    assert losses(tmp_path) == losses(ref_dir)


def test_nan_stops_with_message_and_keeps_last_good_checkpoint(tiny_cfg, tmp_path, monkeypatch):
    real_build = loop.build_program

    def build_with_nan_from_step_6(*args, **kwargs):
        program = real_build(*args, **kwargs)
        real_step = program.train_step

        def poisoned(state, batch, *hyper):
            state, m = real_step(state, batch, *hyper)
            if int(state["step"]) >= 6:
                m = {**m, "train/loss": m["train/loss"] * np.nan}
            return state, m

        return type(program)(**{**program.__dict__, "train_step": poisoned})

    monkeypatch.setattr(loop, "build_program", build_with_nan_from_step_6)
    cfg = tiny_cfg("causal_decoder", None, "train.stop_after_steps=8")
    with pytest.raises(loop.NonFiniteLoss, match=r"loss is nan at step 6.*checkpoint is step 4"):
        loop.train(cfg, tmp_path)
    assert saved_run.latest_step(tmp_path) == 4
    _, params, _ = saved_run.restore_params(tmp_path)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))
    assert not (tmp_path / "summary.json").exists()


def test_sigterm_leaves_a_resumable_checkpoint(tiny_cfg, straight, tmp_path):
    ref_dir, _ = straight("causal_decoder")
    cfg = tiny_cfg("causal_decoder")  # 40 steps: the signal lands long before the end
    (tmp_path / "cfg.yaml").write_text(to_yaml(cfg))
    command = [sys.executable, "-m", "scalestudy.cli.main", "train", "--config", "cfg.yaml"]
    proc = subprocess.Popen(
        [*command, "--workdir", "run"], cwd=tmp_path, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 240
    while not losses(tmp_path / "run") and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)  # a safety net under load, not a measurement
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "SIGTERM received: saved a checkpoint" in err
    stopped_at = saved_run.latest_step(tmp_path / "run")
    assert stopped_at is not None and 1 <= stopped_at < 40
    # Re-running the same command resumes and matches the uninterrupted run (whose first 8
    # steps the fixture holds; the signal normally lands within them).
    stop = max(8, stopped_at + 2)
    loop.train(
        cfg.replace(train={**cfg.train.model_dump(), "stop_after_steps": stop}), tmp_path / "run"
    )
    assert len(losses(tmp_path / "run")) == stop
    assert losses(tmp_path / "run")[:8] == losses(ref_dir)


def test_eval_fn_hook_and_periodic_validation(tiny_cfg, tmp_path):
    calls = []

    def eval_fn(model, params, at):
        calls.append(at)
        return {"probe/acc": 0.5 + at / 100}

    cfg = tiny_cfg(
        "causal_decoder",
        None,
        "train.stop_after_steps=5",
        "eval.every_steps=2",
        "train.eval_every=3",
    )
    summary = loop.train(cfg, tmp_path, eval_fn=eval_fn)
    assert calls == [2, 4, 5]  # every 2 steps and at the end
    assert summary["eval"] == {"probe/acc": 0.55}
    rows = rundir.read_metrics(tmp_path)
    assert [(r["step"], r["eval/probe/acc"]) for r in rows if "eval/probe/acc" in r] == [
        (2, 0.52),
        (4, 0.54),
        (5, 0.55),
    ]
    assert [r["step"] for r in rows if "val/loss" in r] == [3, 5]
    val = [r["val/loss"] for r in rows if "val/loss" in r]
    assert summary["best_val_loss"] == min(val) and summary["final_val_loss"] == val[-1]


def test_mfu_and_throughput_count_step_time_only(tiny_cfg, tmp_path):
    pause = 0.4

    def eval_fn(model, params, at):
        time.sleep(pause)
        return {"probe/acc": 0.5}

    cfg = tiny_cfg(
        "causal_decoder",
        None,
        "train.stop_after_steps=6",
        "eval.every_steps=2",
        "train.eval_every=1",
    )
    summary = loop.train(cfg, tmp_path, eval_fn=eval_fn)
    timing = summary["timing"]
    slept = 3 * pause  # at steps 2, 4 and 6 (the last one after the loop)
    assert timing["eval_s"] >= slept
    assert timing["step_s"] < timing["wall_s"] - slept
    step_s = timing["step_s"]
    assert summary["tokens_per_s"] == pytest.approx(summary["tokens"] / step_s, rel=1e-4)
    peak = datasheets.peak_flops(dtype=cfg.model.dtype)["flops_per_s"]
    assert summary["flops"] == 6 * cfg.train.batch_size * counting.flops(cfg)["flops_per_example"]
    assert summary["mfu"] == pytest.approx(datasheets.mfu(summary["flops"], step_s, peak), rel=1e-4)
