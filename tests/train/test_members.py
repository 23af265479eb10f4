"""Members: runs of one shape trained as one program equal the same runs trained alone, fault
by fault and resume by resume, and each writes its own run directory."""

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from scalestudy.cli import member_grid
from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import VALID_CELLS, to_yaml
from scalestudy.train import loop, members, sharding
from scalestudy.train import program as group_program
from scalestudy.train.rundir import layout as rundir
from scalestudy.train.rundir import saved_run
from scalestudy.train.rundir.resume_check import ResumeConfigError

# float32 on a CPU, 8 devices: without dropout a member's first loss equals the run's alone
# exactly; its batched matmuls then sum in another order, and Adam's first update (about
# lr x the sign of each gradient) turns the last bits into differences that grow to ~1e-4
# relative over 8 steps at lr 1e-2 (with dropout 0.1: 4e-5 at the first step, ~6e-4 over 8).
RTOL = 1e-3
RTOL_FIRST = 1e-6
# The tiny runs' schedule (40 steps), stopped at step 8. Dropout stays on in the resume tests
# (an exact resume reproduces each member's masks).
SHORT = ("train.stop_after_steps=8",)


def _member(tiny_cfg, arch, objective, seed, lr, *more):
    return tiny_cfg(
        arch,
        objective,
        *SHORT,
        f"train.seed={seed}",
        f"data.seed={seed}",
        f"optim.learning_rate={lr}",
        f"name={arch}.{objective}.s{seed}.lr{lr}",
        "model.dtype=float32",  # the tolerances below are float32's
        *more,
    )


def _with(cfg, section, **changes):
    """`cfg` with keys of one section changed (the others kept)."""
    return cfg.replace(**{section: getattr(cfg, section).replace(**changes)})


def losses(workdir):
    return np.array([r["train/loss"] for r in rundir.read_metrics(workdir) if "train/loss" in r])


def _pair(tiny_cfg, arch="causal_decoder", objective=None, *more):
    return [
        _member(tiny_cfg, arch, objective, 0, 0.01, *more),
        _member(tiny_cfg, arch, objective, 1, 0.003, *more),
    ]


CELLS = [(arch, objective) for arch, objs in VALID_CELLS.items() for objective in objs]
# Every cell with the CPU's default program (the members looped); the batched program on one
# decoder and the encoder-decoder.
PROGRAMS = [(*cell, "auto") for cell in CELLS] + [
    ("causal_decoder", None, "vmap"),
    ("encoder_decoder", "plm", "vmap"),
]


@pytest.mark.parametrize(("arch", "objective", "program"), PROGRAMS)
def test_a_group_trains_each_member_as_it_trains_alone(
    tiny_cfg, tmp_path, arch, objective, program
):
    cfgs = _pair(tiny_cfg, arch, objective, "model.dropout=0.0",
                 f"mesh.member_program={program}")  # fmt: skip
    results = loop.train_group(cfgs, [tmp_path / "g0", tmp_path / "g1"])
    for i, cfg in enumerate(cfgs):
        alone = loop.train(cfg, tmp_path / f"a{i}")
        together, by_itself = losses(tmp_path / f"g{i}"), losses(tmp_path / f"a{i}")
        assert results[i]["steps"] == alone["steps"] == 8
        assert len(together) == len(by_itself) == 8
        np.testing.assert_allclose(together[0], by_itself[0], rtol=RTOL_FIRST)
        np.testing.assert_allclose(together, by_itself, rtol=RTOL)
        assert results[i]["final_val_loss"] == pytest.approx(alone["final_val_loss"], rel=RTOL)
        # Each member's run directory is a run's: its config, summary and checkpoints.
        assert rundir.read_summary(tmp_path / f"g{i}")["tokens"] == alone["tokens"]
        assert saved_run.latest_step(tmp_path / f"g{i}") == 8
        recorded = (tmp_path / f"g{i}" / rundir.CONFIG).read_text()
        assert recorded == (tmp_path / f"a{i}" / rundir.CONFIG).read_text()
    # The members differ (seed and rate): the group did not train one model twice.
    assert not np.allclose(losses(tmp_path / "g0"), losses(tmp_path / "g1"))


def test_the_cpu_loops_whole_members_and_vmaps_split_ones(tiny_cfg):
    mesh = sharding.make_mesh(tiny_cfg("causal_decoder", None).mesh)
    cfg = tiny_cfg("causal_decoder", None)
    assert group_program.program_kind(cfg, mesh, None) == "loop"
    assert group_program.program_kind(cfg, mesh, "data") == "vmap"
    vmapped = tiny_cfg("causal_decoder", None, "mesh.member_program=vmap")
    assert group_program.program_kind(vmapped, mesh, None) == "vmap"
    with pytest.raises(ConfigError, match=r"member_program='loop'.*mesh\.members='data'"):
        tiny_cfg("causal_decoder", None, "mesh.member_program=loop", "mesh.members=data")


@pytest.mark.optimized
def test_one_member_is_an_ordinary_run_bit_for_bit(tiny_cfg, tmp_path):
    cfg = _pair(tiny_cfg)[0]
    loop.train_group([cfg], [tmp_path / "g"])
    loop.train(cfg, tmp_path / "a")
    assert losses(tmp_path / "g").tolist() == losses(tmp_path / "a").tolist()


def test_the_schedules_numbers_may_differ_between_members(tiny_cfg, tmp_path):
    """Warmup, cooldown, weight decay and Adam's b2 enter the step as traced numbers."""
    base = ("optim.learning_rate=0.01",)
    cfgs = [
        tiny_cfg("causal_decoder", None, *SHORT, *base, "name=a"),
        tiny_cfg(
            "causal_decoder",
            None,
            *SHORT,
            *base,
            "optim.warmup_steps=5",
            "optim.cooldown_steps=2",
            "optim.weight_decay=0.1",
            "optim.b2=0.99",
            "name=b",
        ),
    ]
    loop.train_group(cfgs, [tmp_path / "g0", tmp_path / "g1"])
    for i, cfg in enumerate(cfgs):
        loop.train(cfg, tmp_path / f"a{i}")
        rows = [r for r in rundir.read_metrics(tmp_path / f"g{i}") if "lr" in r]
        alone = [r for r in rundir.read_metrics(tmp_path / f"a{i}") if "lr" in r]
        assert [r["lr"] for r in rows] == pytest.approx([r["lr"] for r in alone], rel=1e-6)
        np.testing.assert_allclose(
            losses(tmp_path / f"g{i}"), losses(tmp_path / f"a{i}"), rtol=RTOL
        )


def test_a_member_whose_loss_diverges_stops_alone(tiny_cfg, tmp_path, capsys):
    healthy = _member(tiny_cfg, "causal_decoder", None, 0, 0.01)
    doomed = _member(tiny_cfg, "causal_decoder", None, 1, 1e30, "optim.grad_clip_norm=1.0")
    results = loop.train_group([healthy, doomed], [tmp_path / "g0", tmp_path / "g1"])
    assert isinstance(results[1], loop.NonFiniteLoss)
    assert doomed.name in str(results[1]) and "the other members go on" in capsys.readouterr().err
    assert rundir.read_summary(tmp_path / "g1") is None  # stopped: no summary
    loop.train(healthy, tmp_path / "a0")
    np.testing.assert_allclose(losses(tmp_path / "g0"), losses(tmp_path / "a0"), rtol=RTOL)
    assert results[0]["steps"] == 8 and rundir.read_summary(tmp_path / "g0") is not None


def test_a_stopped_group_resumes_bit_for_bit(tiny_cfg, tmp_path):
    cfgs = _pair(tiny_cfg)
    straight = [tmp_path / "s0", tmp_path / "s1"]
    loop.train_group(cfgs, straight)
    halves = [tmp_path / "h0", tmp_path / "h1"]
    loop.train_group([_with(c, "train", stop_after_steps=4) for c in cfgs], halves)
    assert [saved_run.latest_step(h) for h in halves] == [4, 4]  # checkpoint_every is 4
    loop.train_group(cfgs, halves)
    for s, h in zip(straight, halves):
        assert losses(h).tolist() == losses(s).tolist()


def test_members_resume_alone_and_runs_resume_as_a_group(tiny_cfg, tmp_path):
    cfgs = _pair(tiny_cfg)
    firsts = [_with(c, "train", stop_after_steps=4) for c in cfgs]
    # Trained alone to step 4, finished as a group.
    alone_first = [tmp_path / "a0", tmp_path / "a1"]
    for cfg, workdir in zip(firsts, alone_first):
        loop.train(cfg, workdir)
    loop.train_group(cfgs, alone_first)
    # Trained as a group to step 4, finished alone.
    group_first = [tmp_path / "g0", tmp_path / "g1"]
    loop.train_group(firsts, group_first)
    for cfg, workdir in zip(cfgs, group_first):
        loop.train(cfg, workdir)
    for a, g in zip(alone_first, group_first):
        np.testing.assert_allclose(losses(a), losses(g), rtol=RTOL)
        assert len(losses(a)) == 8


def test_members_at_different_steps_resume_in_one_group(tiny_cfg, tmp_path):
    cfgs = _pair(tiny_cfg)
    loop.train(_with(cfgs[0], "train", stop_after_steps=4), tmp_path / "g0")
    results = loop.train_group(cfgs, [tmp_path / "g0", tmp_path / "g1"])
    assert [r["steps"] for r in results] == [8, 8]


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ("model.d_model=48", "model.d_model differs between members"),
        ("train.batch_size=8", "train.batch_size differs"),
        ("train.steps=9", "train.steps differs"),
        ("optim.schedule=cosine", "optim.schedule differs"),
        ("optim.grad_clip_norm=null", "None for some members"),
    ],
)
def test_a_difference_that_changes_the_program_is_refused(tiny_cfg, tmp_path, change, needle):
    a, b = _pair(tiny_cfg)
    b = tiny_cfg("causal_decoder", None, *SHORT, "name=b", "model.dtype=float32", change)
    with pytest.raises(ConfigError, match=needle):
        loop.train_group([a, b], [tmp_path / "g0", tmp_path / "g1"])
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_duplicate_members_and_empty_groups_are_refused(tiny_cfg, tmp_path):
    a, _ = _pair(tiny_cfg)
    with pytest.raises(ConfigError, match="same config"):
        members.check_group([a, a.replace(name="other")])
    members.check_group([a, _with(a, "train", seed=5)])  # one name, two runs: a search's rates
    with pytest.raises(ConfigError, match="at least one member"):
        members.check_group([])
    with pytest.raises(ConfigError, match="share one"):
        loop.train_group([a, _with(a, "train", seed=3).replace(name="x")], [tmp_path, tmp_path])
    assert not any(tmp_path.iterdir())


def test_a_member_directory_holding_another_run_is_refused_before_writing(tiny_cfg, tmp_path):
    cfgs = _pair(tiny_cfg)
    loop.train(_with(cfgs[0], "train", stop_after_steps=4), tmp_path / "g0")
    before = sorted(p.name for p in (tmp_path / "g0").iterdir())
    other = [_with(c, "objective", inputs_length=16) for c in cfgs]
    with pytest.raises(ResumeConfigError, match=r"objective\.inputs_length"):
        loop.train_group(other, [tmp_path / "g0", tmp_path / "g1"])
    assert sorted(p.name for p in (tmp_path / "g0").iterdir()) == before
    assert not (tmp_path / "g1").exists()


@pytest.mark.parametrize(
    ("grid", "needle"),
    [
        (["model.d_model=32,48"], "cannot differ between members"),
        (["seed=0,0"], "twice"),
        (["seed="], "empty value"),
        (["seed"], "is not KEY=V1,V2"),
        (["seed=0,1", "seed=2"], "given twice"),
        (
            [f"seed={','.join(map(str, range(members.MAX_MEMBERS + 1)))}"],
            "got 65; a group holds 1 to 64",
        ),
    ],
)
def test_bad_member_grids_are_one_error(grid, needle):
    with pytest.raises(ConfigError, match=needle):
        member_grid.parse_grid(grid)


@pytest.mark.parametrize("count", [0, 65, True, "4", 2.0])
def test_a_spec_and_compile_refuse_a_count_outside_a_group_by_one_rule(count):
    from scalestudy.study.plan import groups

    with pytest.raises(ConfigError, match=rf"^members: got {count!r}; a group holds 1 to 64"):
        groups.cap(count)
    with pytest.raises(ConfigError, match=rf"^compile --members: got {count!r}; a group holds"):
        members.check_count(count, "compile --members")
    assert groups.cap(64) == members.check_count(64, "x") == 64


def test_a_grid_is_every_combination_and_seed_is_the_whole_replicate():
    grid = member_grid.parse_grid(["seed=0,1", "optim.learning_rate=3e-3,1e-2"])
    assert [name for name, _ in grid] == [
        "seed0-learning_rate3e-3",
        "seed0-learning_rate1e-2",
        "seed1-learning_rate3e-3",
        "seed1-learning_rate1e-2",
    ]
    assert grid[2][1] == ["train.seed=1", "data.seed=1", "optim.learning_rate=3e-3"]


def test_sigterm_saves_every_member_at_one_step_and_the_command_resumes(tiny_cfg, tmp_path):
    cfg = tiny_cfg("causal_decoder", None, "train.stop_after_steps=16", "train.checkpoint_every=2")
    (tmp_path / "cfg.yaml").write_text(to_yaml(cfg))
    command = [
        sys.executable,
        "-m",
        "scalestudy.cli.main",
        "train",
        "--config",
        "cfg.yaml",
        "--workdir",
        "grp",
        "--json",
        "--members",
        "seed=0,1",
    ]
    proc = subprocess.Popen(
        command, cwd=tmp_path, stderr=subprocess.PIPE, text=True, stdout=subprocess.PIPE
    )
    first = tmp_path / "grp" / "seed0"
    deadline = time.time() + 600  # a safety net under load, not a measurement
    while len(losses(first)) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped: stopped a group of 2 members" in err and "Traceback" not in err, err
    steps = {saved_run.latest_step(tmp_path / "grp" / m) for m in ("seed0", "seed1")}
    assert len(steps) == 1 and steps.pop() < 16  # every member saved at one step
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    # Opening the members' checkpoints before the run's log exists says nothing on the terminal.
    assert "WARNING:absl" not in done.stderr, done.stderr[-2000:]
    rows = json.loads(done.stdout)
    assert [r["steps"] for r in rows] == [16, 16]
    # Resumed from where they stopped (an exact resume is test_a_stopped_group_resumes...).
    for m in ("seed0", "seed1"):
        assert [
            r["step"] for r in rundir.read_metrics(tmp_path / "grp" / m) if "train/loss" in r
        ] == list(range(1, 17))
