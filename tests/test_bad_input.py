"""Bad input, one row each: the command stops before any work with one clear `error:` line
that names what is wrong and what is accepted, never a traceback and never silent success.

Rows run `scalestudy.cli.main.main` in this process on tiny inputs written once per module; the rows
that need a run directory share one 2-step run.
"""

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from scalestudy.cli.main import main
from scalestudy.study.run.main_job import expand, load_study

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs/models/tiny.yaml")
XXL = str(REPO / "configs/models/wang2022_xxl_decoder.yaml")

BASE = {
    "objective": {"inputs_length": 24, "targets_length": 8},
    "model": {"vocab_size": 384, "dtype": "float32", "n_heads": 2},
    "train": {"batch_size": 8, "progress": False, "async_checkpoint": False},
}
SPEC = {
    "name": "tiny",
    "base": BASE,
    "cells": [["causal_decoder", "flm"], ["encoder_decoder", "mlm"]],
    "ladder": {"sizes": [{"name": "xs", "d_model": 16, "n_layers": 2, "d_ff": 32}]},
    "budget": {"kind": "steps", "steps": 4},
    "tasks": ["synthetic_probes"],
    "fit": {"laws": ["kaplan_n"]},
}
SPECS = {  # file name -> changes to SPEC (None removes the key)
    "spec.yaml": {},
    "dup_cells.yaml": {"cells": [["causal_decoder", "flm"], ["causal_decoder", "flm"]]},
    "dup_seeds.yaml": {"seeds": [0, 1, 0]},
    "bad_law.yaml": {"fit": {"laws": ["kaplan_q"]}},
    "bad_task.yaml": {"tasks": ["no_such_task"]},
    "missing_text_task.yaml": {"tasks": ["synthetic_probes", "text:no/such.txt"]},
    "banana.yaml": {"slurm": {"time": "banana"}},
    "no_budget.yaml": {"budget": None, "base": {**BASE, "train": {**BASE["train"], "steps": 7}}},
}
FILES: dict[str, str | bytes] = {
    "include_int.yaml": "include: 5\n",
    "include_dict.yaml": "include: [{a: 1}]\n",
    "latin1.yaml": b"name: caf\xe9\n",
    "twice.yaml": "model:\n  d_model: 64\ntrain:\n  steps: 2\nmodel:\n  n_layers: 3\n",
    "size_cell.csv": "N,loss\n1e6,3.0\n1.2.3,2.9\n4e6,2.7\n8e6,2.5\n",
    "runs.csv": "N,loss\n1e6,3.0\n2e6,2.9\n4e6,2.7\n8e6,2.5\n1.6e7,2.4\n",
    "a_file.txt": "not a directory\n",
    "corpus.txt": "some text to train a vocabulary on.\n" * 50,
    "deep.yaml": "[" * 5000 + "]" * 5000 + "\n",
}

MULTI = {"SCALESTUDY_NUM_PROCESSES": "2", "SCALESTUDY_PROCESS_ID": "0"}
TRAIN = ["train", "--config", TINY, "--workdir", "w", "train.steps=2"]

# (id, argv, environment, words the error must contain). {run}: a trained run directory (its
# rows are marked slow: they share one training run).
CASES = [
    # Mixture-of-experts settings (model.moe)
    (
        "moe_top_k_over_experts",
        [
            "describe",
            "--config",
            TINY,
            "model.moe.enabled=true",
            "model.moe.routed_experts=4",
            "model.moe.top_k=5",
        ],
        {},
        ["model.moe.top_k=5", "routed_experts=4", "1 <= top_k <= 4"],
    ),
    (
        "moe_zero_experts",
        ["describe", "--config", TINY, "model.moe.enabled=true", "model.moe.routed_experts=0"],
        {},
        ["model.moe.routed_experts=0", "at least 1"],
    ),
    (
        "moe_capacity_factor",
        ["describe", "--config", TINY, "model.moe.enabled=true", "model.moe.capacity_factor=0"],
        {},
        ["model.moe.capacity_factor=0", "factor > 0"],
    ),
    (
        "moe_granularity_not_a_divisor",
        ["describe", "--config", TINY, "model.moe.enabled=true", "model.moe.granularity=3"],
        {},
        ["model.moe.granularity=3", "model.d_ff=64", "divisor of d_ff"],
    ),
    (
        "moe_granularity_and_width",
        [
            "describe",
            "--config",
            TINY,
            "model.moe.enabled=true",
            "model.moe.granularity=2",
            "model.moe.d_expert=16",
        ],
        {},
        ["model.moe.granularity=2", "model.moe.d_expert=16", "give one"],
    ),
    (
        "moe_expert_axis",
        ["describe", "--config", TINY, "model.moe.enabled=true", "mesh.expert=3"],
        {},
        ["mesh.expert=3", "routed_experts=8"],
    ),
    (
        "moe_keys_on_a_dense_model",
        ["describe", "--config", TINY, "model.moe.top_k=1"],
        {},
        ["model.moe.top_k", "model.moe.enabled is false"],
    ),
    (
        "moe_every_second_layer_scanned",
        [
            "describe",
            "--config",
            TINY,
            "model.moe.enabled=true",
            "model.moe.every=2",
            "model.scan_layers=true",
        ],
        {},
        ["model.moe", "scan_layers=false"],
    ),
    # Tracebacks before
    ("batch_vs_mesh_train", [*TRAIN, "train.batch_size=4"], {}, ["batch_size=4", "mesh.data=8"]),
    (
        "batch_vs_mesh_compile",
        ["compile", "--config", TINY, "train.batch_size=12"],
        {},
        ["batch_size=12", "mesh.data=8", "multiple of 8"],
    ),
    (
        "members_vs_data_axis_train",
        [*TRAIN, "mesh.members=data", "--members", "seed=0,1,2"],
        {},
        ["3 members", "mesh.data=8", "multiple of 8"],
    ),
    (
        "members_vs_data_axis_compile",
        ["compile", "--config", TINY, "--members", "12", "mesh.members=data"],
        {},
        ["12 members", "mesh.data=8", "multiple of 8"],
    ),
    (
        "members_split_unknown",
        ["describe", "--config", TINY, "mesh.members=tensor"],
        {},
        ["mesh.members", "'none' or 'data'"],
    ),
    (
        "compile_members_with_spec",
        ["compile", "--spec", "spec.yaml", "--members", "2"],
        {},
        ["--members 2", "--spec", "--config FILE alone"],
    ),
    ("include_int", ["describe", "--config", "include_int.yaml"], {}, ["include: 5", "list"]),
    ("include_dict", ["describe", "--config", "include_dict.yaml"], {}, ["include:", "file name"]),
    ("not_utf8", ["describe", "--config", "latin1.yaml"], {}, ["latin1.yaml", "UTF-8", "0xe9"]),
    ("eval_step_missing", ["eval", "--workdir", "{run}", "--step", "7"], {}, ["--step 7", "2"]),
    ("eval_step_negative", ["eval", "--workdir", "{run}", "--step", "-1"], {}, ["--step", "-1"]),
    (
        "attention_rank_step_missing",
        ["attention-rank", "--workdir", "{run}", "--step", "7"],
        {},
        ["steps saved: 2"],
    ),
    (
        "attention_rank_step_negative",
        ["attention-rank", "--workdir", "{run}", "--step", "-3"],
        {},
        ["-3"],
    ),
    (
        "experts_dense_run",
        ["experts", "--workdir", "{run}"],
        {},
        ["has no MoE layers", "model.moe.enabled=true"],
    ),
    ("experts_step_missing", ["experts", "--workdir", "{run}", "--step", "7"], {}, ["saved: 2"]),
    ("eval_max_examples_neg", ["eval", "--workdir", "a_dir", "--max-examples", "-3"], {}, ["-3"]),
    ("fit_size_cell", ["fit", "size_cell.csv"], {}, ["non-positive N", "--drop-invalid"]),
    (
        "launch_out_is_file",
        ["launch", "--spec", "spec.yaml", "--executor", "slurm", "--out", "a_file.txt"],
        {},
        ["a_file.txt", "is a file"],
    ),
    (
        "coordinator_without_port",
        TRAIN,
        {**MULTI, "SCALESTUDY_COORDINATOR": "localhost"},
        ["SCALESTUDY_COORDINATOR='localhost'", "host:port"],
    ),
    ("bench_steps_zero", ["bench", "train", "--config", TINY, "--steps", "0"], {}, ["'0'"]),
    # Accepted silently before
    ("dup_cells", ["study", "--spec", "dup_cells.yaml", "--out", "s", "--dry-run"], {}, ["cells"]),
    ("dup_seeds", ["study", "--spec", "dup_seeds.yaml", "--out", "s", "--dry-run"], {}, ["seeds"]),
    (
        "unknown_law",
        ["study", "--spec", "bad_law.yaml", "--out", "s", "--dry-run"],
        {},
        ["kaplan_q"],
    ),
    (
        "unknown_task",
        ["study", "--spec", "bad_task.yaml", "--out", "s", "--dry-run"],
        {},
        ["no_such_task", "synthetic_probes"],
    ),
    (
        "dry_run_and_collect",
        ["study", "--spec", "spec.yaml", "--out", "s", "--dry-run", "--collect"],
        {},
        ["--dry-run", "--collect"],
    ),
    ("workdir_empty", ["train", "--config", TINY, "--workdir", ""], {}, ["--workdir", "empty"]),
    ("eps_inf", ["describe", "--config", TINY, "optim.eps=.inf"], {}, ["optim.eps", "finite"]),
    (
        "grad_clip_inf",
        ["describe", "--config", TINY, "optim.grad_clip_norm=.inf"],
        {},
        ["optim.grad_clip_norm", "finite"],
    ),
    ("processes_without_coordinator", TRAIN, MULTI, ["SCALESTUDY_COORDINATOR"]),
    (
        "cooldown_longer_than_run",
        ["describe", "--config", TINY, "optim.schedule=wsd", "optim.cooldown_steps=500"],
        {},
        ["cooldown_steps=500", "train.steps=100", "at most 100"],
    ),
    ("eval_tasks_empty", ["describe", "--config", TINY, "eval.tasks=[]"], {}, ["eval.tasks"]),
    ("eval_tasks_flag_empty", ["eval", "--workdir", "a_dir", "--tasks"], {}, ["--tasks"]),
    ("key_twice", ["describe", "--config", "twice.yaml"], {}, ["'model'", "lines 1 and 5"]),
    ("eval_max_examples_zero", ["eval", "--workdir", "a_dir", "--max-examples", "0"], {}, ["'0'"]),
    ("fit_holdout", ["fit", "runs.csv", "--holdout", "50"], {}, ["--holdout 50", "5 run"]),
    ("fit_n_kind_table", ["fit", "runs.csv", "--n-kind", "total"], {}, ["--n-kind", "--n-col"]),
    ("fit_d_kind_table", ["fit", "runs.csv", "--d-kind", "tokens"], {}, ["--d-kind", "--d-col"]),
    ("bench_steps_negative", ["bench", "data", "--config", TINY, "--steps", "-2"], {}, ["'-2'"]),
    (
        "bench_config_and_preset",
        ["bench", "train", "--config", TINY, "--preset", "tiny"],
        {},
        ["--config", "--preset"],
    ),
    (
        "slurm_time",
        ["launch", "--spec", "banana.yaml", "--executor", "slurm", "--out", "L"],
        {},
        ["slurm.time='banana'", "HH:MM:SS"],
    ),
    (
        "vocab_out_is_dir",
        ["vocab", "train", "corpus.txt", "--out", "a_dir", "--vocab-size", "50"],
        {},
        ["a_dir", "is a directory"],
    ),
    # Misleading before
    (
        "vocab_smaller_than_bytes",
        [*TRAIN, "model.vocab_size=100"],
        {},
        ["model.vocab_size=100", "byte vocabulary (359 ids"],
    ),
    ("z_loss_inf", ["describe", "--config", TINY, "train.z_loss=.inf"], {}, ["train.z_loss"]),
    (
        "weight_decay_inf",
        ["describe", "--config", TINY, "optim.weight_decay=.inf"],
        {},
        ["optim.weight_decay"],
    ),
    ("config_is_dir", ["describe", "--config", "a_dir"], {}, ["a_dir", "is a directory"]),
    ("workdir_is_file", ["eval", "--workdir", "a_file.txt"], {}, ["a_file.txt", "is a file"]),
    (
        "train_workdir_is_file",
        ["train", "--config", TINY, "--workdir", "a_file.txt"],
        {},
        ["a_file.txt", "is a file"],
    ),
    ("compare_at_negative", ["fit", "runs.csv", "--compare-at", "-1e21"], {}, ["--compare-at"]),
    # Paths of the wrong kind: what was found and what is expected, never "not found"
    (
        "config_is_a_pipe",
        ["describe", "--config", "a_pipe"],
        {},
        ["config file a_pipe is a named pipe; expected a YAML file"],
    ),
    ("config_is_a_device", ["describe", "--config", "/dev/null"], {}, ["is a character device"]),
    ("runs_source_is_a_pipe", ["fit", "a_pipe"], {}, ["runs source a_pipe is a named pipe"]),
    (
        "vocab_input_is_a_pipe",
        ["vocab", "train", "a_pipe", "--out", "v.model", "--vocab-size", "50"],
        {},
        ["input a_pipe is a named pipe; expected a text file or a directory"],
    ),
    (
        "text_path_is_a_pipe",
        [*TRAIN, "data.source=text", "data.paths=[a_pipe]"],
        {},
        ["data.paths: 'a_pipe' is a named pipe"],
    ),
    # A task file every run would miss: refused by the dry run and before a study trains
    *[
        (
            f"missing_task_file{flag}",
            ["study", "--spec", "missing_text_task.yaml", "--out", "o", *flag.split()],
            {},
            ["tasks: 'text:no/such.txt': the task's data not found: no/such.txt"],
        )
        for flag in ("", " --dry-run")
    ],
    # The environment JAX reads, and TPU slices libtpu crashed on
    *[
        (
            f"device_count_{count}",
            ["describe", "--config", TINY],
            {"XLA_FLAGS": f"--xla_force_host_platform_device_count={count}"},
            [f"device_count={count} is not a number of CPU devices", ">= 1"],
        )
        for count in ("0", "-4", "x")
    ],
    (
        "tpu_platform_without_a_chip",
        ["describe", "--config", TINY],
        {"JAX_PLATFORMS": "tpu"},
        ["JAX_PLATFORMS='tpu'", "has none", "JAX_PLATFORMS=cpu"],
    ),
    (
        "topology_beyond_any_slice",
        ["compile", "--config", TINY, "--topology", "v4:1000x1000x1000"],
        {},
        ["1000000000 chips", "1 to 4096 chips"],
    ),
    (
        "topology_size_zero",
        ["compile", "--config", TINY, "--topology", "v5e:0x4"],
        {},
        ["0 chips", "each size at least 1"],
    ),
    # Tracebacks, misleading lines and silent successes of the second sweep
    (
        "parameter_beyond_32_bit_count",
        [*TRAIN, "model.d_model=1000000", "model.d_ff=1000000"],
        {},
        ["model.d_model=1000000 x model.n_heads=4", "1,000,000,000,000 elements", "4,294,967,296"],
    ),
    (
        "dimension_beyond_int32",
        ["describe", "--config", TINY, "model.n_layers=99999999999"],
        {},
        ["model.n_layers", "2147483647"],
    ),
    (
        "text_path_null",
        [*TRAIN, "data.source=text", "data.paths=[null]"],
        {},
        ["data.paths[0] is None", "non-empty string"],
    ),
    (
        "validation_path_empty",
        ["describe", "--config", TINY, "data.validation_paths=[a_dir, '']"],
        {},
        ["data.validation_paths[1] is ''", "non-empty string"],
    ),
    (
        "config_nests_too_deep",
        ["train", "--config", "deep.yaml", "--workdir", "w"],
        {},
        ["deep.yaml", "nests lists or mappings more than 64 levels deep"],
    ),
    (
        "override_nests_too_deep",
        ["describe", "--config", TINY, "name=" + "[" * 3000],
        {},
        ["override name", "more than 64 levels deep"],
    ),
    (
        "eval_task_unknown_train",
        [*TRAIN, "eval.tasks=[nonexistent_task]"],
        {},
        ["eval.tasks: unknown task 'nonexistent_task'", "synthetic_probes", "FILE.yaml"],
    ),
    (
        "eval_task_unknown_describe",
        ["describe", "--config", TINY, "eval.tasks=[copa_x]"],
        {},
        ["eval.tasks: unknown task 'copa_x' (did you mean 'copa'?)"],
    ),
    (
        "eval_task_file_missing",
        ["describe", "--config", TINY, "eval.tasks=[synthetic_probes, text:no/such.txt]"],
        {},
        ["eval.tasks: 'text:no/such.txt': the task's data not found: no/such.txt"],
    ),
    (
        "eval_workdir_is_a_pipe",
        ["eval", "--workdir", "a_pipe", "--tasks", "synthetic_probes"],
        {},
        ["--workdir a_pipe is a named pipe; expected a run directory"],
    ),
    (
        "train_workdir_is_a_pipe",
        ["train", "--config", TINY, "--workdir", "a_pipe"],
        {},
        ["--workdir a_pipe is a named pipe"],
    ),
    (
        "finetune_unknown_key",
        ["finetune", "--from", "a_dir", "--out", "O", "mixture=m.yaml", "stepz=2"],
        {},
        ["finetune: unknown key 'stepz' (did you mean 'steps'?)", "mixture", "eval_tasks"],
    ),
    (
        "adapt_unknown_key",
        ["adapt", "--from", "a_dir", "--out", "O", "objective=plm", "bogus=1"],
        {},
        ["adapt: unknown key 'bogus'", "fraction", "train.*"],
    ),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad_input")
    for name, changes in SPECS.items():
        spec = {k: v for k, v in {**SPEC, **changes}.items() if v is not None}
        (d / name).write_text(yaml.safe_dump(spec))
    for name, content in FILES.items():
        (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    (d / "a_dir").mkdir()
    os.mkfifo(d / "a_pipe")
    return d


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("run") / "run"
    argv = ["train", "--config", TINY, "--workdir", str(run), "train.steps=2"]
    argv += ["train.checkpoint_every=2", "train.async_checkpoint=false", "train.progress=false"]
    argv += ["data.synthetic.n_train_documents=200", "data.synthetic.n_validation_documents=20"]
    argv += ["train.eval_batches=1"]
    assert main(argv) == 0
    return run


def _status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's own errors
        return int(e.code)


def _param(case: tuple) -> pytest.param:
    marks = [pytest.mark.slow] if "{run}" in case[1] else []
    return pytest.param(*case[1:], id=case[0], marks=marks)


@pytest.mark.parametrize(("argv", "env", "words"), [_param(c) for c in CASES])
def test_bad_input_gets_one_clear_error(argv, env, words, inputs, request, monkeypatch, capsys):
    if "{run}" in argv:
        run = request.getfixturevalue("trained_run")
        argv = [str(run) if a == "{run}" else a for a in argv]
    monkeypatch.chdir(inputs)
    for key in ("SCALESTUDY_COORDINATOR", *MULTI, "SCALESTUDY_DISTRIBUTED"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    capsys.readouterr()
    status = _status(argv)
    err = capsys.readouterr().err
    assert status == 2, f"exit {status}, stderr: {err[-500:]}"
    assert "Traceback" not in err
    assert err.startswith("error: ") or "error: " in err.splitlines()[-1], err
    for word in words:
        assert word in err, f"{word!r} not in: {err}"
    assert not (inputs / "w" / "checkpoints").exists()  # nothing trained


def test_a_platform_jax_does_not_know_is_one_line(tmp_path):
    """JAX_PLATFORMS is read when JAX first starts a backend, inside the command's work: the
    backend's error becomes one line naming the variable (a process of its own: this one's
    backends have started)."""
    env = {**os.environ, "JAX_PLATFORMS": "bogus"}
    argv = ["train", "--config", TINY, "--workdir", "w", "train.steps=2"]
    done = subprocess.run(
        [sys.executable, "-m", "scalestudy.cli.main", *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-800:]
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot start JAX's backend 'bogus'"), last
    assert "JAX_PLATFORMS='bogus' chose it" in last
    assert not (tmp_path / "w").exists()


def test_spec_without_budget_trains_the_base_steps(inputs):
    study = load_study(inputs / "no_budget.yaml")
    assert study.budget.kind == "steps" and study.budget.steps == 7
    assert {r.cfg.train.steps for r in expand(study, inputs)} == {7}


def test_spec_budget_wins_over_base_steps(inputs, tmp_path):
    spec = {**SPEC, "base": {**BASE, "train": {**BASE["train"], "steps": 7}}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    assert {r.cfg.train.steps for r in expand(load_study(tmp_path / "s.yaml"), tmp_path)} == {4}


def test_closed_output_pipe_exits_quietly(inputs):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "scalestudy.cli.main", "launch", "--spec", "spec.yaml"]
    cmd += ["--executor", "slurm", "--out", "piped"]
    proc = subprocess.Popen(
        cmd, cwd=inputs, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    proc.stdout.close()  # the reader goes away before anything is written, as `| head -1` can
    err = proc.stderr.read()
    assert proc.wait() == 141 and err == "", err
    assert (inputs / "piped" / "study.sbatch").is_file()  # the work itself was done


def test_batch_that_does_not_divide_a_tpu_topology_is_one_line(capsys):
    """The XXL decoder's batch on a v4 slice whose data axis it does not divide: refused
    before anything is lowered (libtpu describes the topology; no TPU needed)."""
    status = _status(["compile", "--config", XXL, "--topology", "v4:8x8x4"])
    err = capsys.readouterr().err
    if "TPU compiler" in err:
        pytest.skip(f"libtpu cannot describe TPU topologies here: {err.strip()[:200]}")
    assert status == 2 and "Traceback" not in err
    assert "train.batch_size=8" in err and "mesh.data=256" in err and "multiple of 256" in err


def test_output_paths_are_checked_before_any_work(tmp_path, capsys):
    """A path that cannot take the results is one error line before anything runs: scores
    are never computed and then lost, and nothing is written."""
    from scalestudy.cli.main import main

    blocker = tmp_path / "file"
    blocker.write_text("x")
    run = tmp_path / "absent_run"
    cases = [
        (["eval", "--workdir", str(tmp_path), "--out", str(tmp_path)], "is a directory"),
        (["eval", "--workdir", str(tmp_path), "--out", ""], "--out is empty"),
        (
            ["eval", "--workdir", str(tmp_path), "--out", str(tmp_path / "no/x.json")],
            "does not exist",
        ),
        (["eval", "--workdir", str(tmp_path), "--out", str(blocker / "x.json")], "is a file"),
        (["attention-rank", "--workdir", str(tmp_path), "--out", str(tmp_path)], "is a directory"),
        (["study", "--spec", "configs/studies/smoke.yaml", "--out", ""], "--out is empty"),
        (
            ["study", "--spec", "configs/studies/smoke.yaml", "--out", str(blocker / "s")],
            "is a file",
        ),
        (
            [
                "launch",
                "--spec",
                "configs/studies/smoke.yaml",
                "--executor",
                "slurm",
                "--out",
                str(blocker / "sub"),
            ],
            "is a file",
        ),
        (["finetune", "--from", str(run), "--out", str(blocker)], "is a file"),
    ]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    for argv, says in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and says in err[0], (argv, err)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize(
    "override", ["train.seed=-1", "data.seed=-1", "train.seed=99999999999999999999"]
)
def test_seeds_outside_what_a_prng_takes_are_refused_by_the_config(override, tmp_path, capsys):
    from scalestudy.cli.main import main

    argv = ["train", "--config", "configs/experiments/synthetic_tiny.yaml"]
    assert main([*argv, "--workdir", str(tmp_path / "w"), override]) == 2
    err = capsys.readouterr().err
    assert "seed: Input should be" in err and override.split("=")[1] in err
    assert not (tmp_path / "w").exists()


def test_a_spec_with_a_negative_seed_is_refused_before_the_dry_run(tmp_path, capsys):
    from scalestudy.cli.main import main

    argv = ["study", "--spec", "configs/studies/smoke.yaml", "--out", str(tmp_path / "o")]
    assert main([*argv, "--dry-run", "seeds=[-1]"]) == 2
    assert "whole numbers from 0 to 2147483647" in capsys.readouterr().err


def test_nested_aliases_are_refused_and_no_value_is_printed_whole(tmp_path):
    """A few hundred bytes of nested aliases stand for 387 million strings: refused as it is
    read, not expanded; and an error never prints a long value whole."""
    from scalestudy.config.errors import ConfigError
    from scalestudy.config.experiment import ExperimentConfig
    from scalestudy.config.yamlio import read_yaml, validate

    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
    path = tmp_path / "laughs.yaml"
    path.write_text("\n".join([*lines, "name: *i"]) + "\n")
    with pytest.raises(ConfigError, match="expands to more than 1,000,000 values"):
        read_yaml(path)
    with pytest.raises(ConfigError) as err:
        validate(ExperimentConfig, {"name": ["x" * 50] * 1000})
    assert len(str(err.value)) < 400 and "..." in str(err.value)


def test_a_batch_that_cannot_fit_host_memory_is_refused_before_anything_is_written(
    tmp_path, capsys
):
    from scalestudy.cli.main import main

    argv = ["train", "--config", "configs/experiments/synthetic_tiny.yaml"]
    assert main([*argv, "--workdir", str(tmp_path / "w"), "train.batch_size=100000000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.batch_size=100000000" in err[0] and "GiB" in err[0]
    assert not (tmp_path / "w").exists()


def test_archs_beside_cells_are_refused_not_ignored(tmp_path):
    from scalestudy.config.errors import ConfigError
    from scalestudy.config.yamlio import validate
    from scalestudy.study.plan.spec import StudySpec

    spec = {**SPEC, "archs": ["causal_decoder"]}
    with pytest.raises(ConfigError, match="archs is given beside cells"):
        validate(StudySpec, spec, "spec")
    study = validate(StudySpec, SPEC, "spec")  # cells alone, and a copy of it, are fine
    assert study.replace(seeds=(0, 1)).cells == study.cells


def test_an_unknown_key_inside_an_optional_section_lists_that_sections_keys():
    """`experiments: {bogus: 1}` (a section that may be absent) names the keys accepted
    there, not an empty list."""
    from scalestudy.config.errors import ConfigError
    from scalestudy.config.yamlio import validate
    from scalestudy.study.plan.spec import StudySpec

    with pytest.raises(ConfigError) as err:
        validate(StudySpec, {**SPEC, "experiments": {"bogus": 1}}, "spec")
    line = str(err.value).splitlines()[-1]
    assert "unknown key 'experiments.bogus'; accepted keys here: " in line
    assert "budgets" in line and not line.rstrip().endswith(":")


@pytest.mark.parametrize(
    "changes, message",
    [
        # Keys that were ignored without a word.
        ({"ladder": {**SPEC["ladder"], "preset": "smoke"}}, "give a preset or sizes, not both"),
        (
            {"ladder": {"sizes": [{**SPEC["ladder"]["sizes"][0], "arch": "encoder_decoder"}]}},
            r"\['arch'\] are set by each cell",
        ),
        (
            {"cell_base": {"causal_decoder/flm": {"model": {"arch": "encoder_decoder"}}}},
            r"\['model.arch'\] would change the cell itself",
        ),
        (
            {"cell_base": {"causal_decoder/flm": {"objective": {"name": "mlm"}}}},
            r"\['objective.name'\] would change the cell itself",
        ),
        # Names that would write outside the study's directory.
        ({"name": "../../x"}, "names become directory names"),
        (
            {"ladder": {"sizes": [{**SPEC["ladder"]["sizes"][0], "name": "../../escape"}]}},
            "names become directory names",
        ),
    ],
)
def test_spec_keys_that_would_be_ignored_or_escape_are_refused(changes, message):
    from scalestudy.config.errors import ConfigError
    from scalestudy.config.yamlio import validate
    from scalestudy.study.plan.spec import StudySpec

    with pytest.raises(ConfigError, match=message):
        validate(StudySpec, {**SPEC, **changes}, "spec")


def test_a_dry_run_refuses_what_every_run_would_refuse_at_its_first_step(tmp_path, capsys):
    """warmup >= steps: every run would fail once started; the plan says so, nothing written."""
    import yaml

    from scalestudy.cli.main import main

    spec = {**SPEC, "base": {**BASE, "optim": {"warmup_steps": 4}}}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    assert main(["study", "--spec", str(path), "--out", str(out), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "warmup_steps=4 must be smaller than train.steps=4" in err[0]
    assert "causal_decoder.flm.xs.s0" in err[0] and not out.exists()


def test_refused_commands_leave_the_disk_as_they_found_it(tmp_path, capsys):
    """plot with a missing source makes no --out; fit on another SQLite file adds no tables
    to it; --collect with nothing to collect (or a learning-rate search) writes no study."""
    import sqlite3

    import yaml

    from scalestudy.cli.main import main

    out = tmp_path / "figs"
    assert main(["plot", str(tmp_path / "none.sqlite"), "--out", str(out)]) == 2
    assert not out.exists()
    other = tmp_path / "mine.sqlite"
    with sqlite3.connect(other) as c:
        c.execute("CREATE TABLE notes (x)")
    assert main(["fit", str(other)]) == 2
    assert "not a study registry" in capsys.readouterr().err
    with sqlite3.connect(other) as c:
        assert [r[0] for r in c.execute("SELECT name FROM sqlite_master")] == ["notes"]
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    for path, extra in ((spec, []), (REPO / "configs/studies/smoke.yaml", [])):
        dest = tmp_path / f"collect_{path.stem}"
        assert main(["study", "--spec", str(path), "--out", str(dest), "--collect", *extra]) == 2
        assert not dest.exists()
    err = capsys.readouterr().err
    assert "2 of 2 run(s) are not complete" in err and "lr_search" in err


def test_a_failed_vocabulary_leaves_no_folders_and_a_cells_own_rate_is_blamed(tmp_path, capsys):
    from scalestudy.cli.main import main
    from scalestudy.config.errors import ConfigError
    from scalestudy.config.yamlio import validate
    from scalestudy.study.plan.spec import StudySpec
    from scalestudy.study.run import main_job

    text = tmp_path / "t.txt"
    text.write_text("a few words of text\n")
    out = tmp_path / "no" / "such" / "v.model"
    assert main(["vocab", "train", str(text), "--out", str(out), "--vocab-size", "300"]) == 2
    assert "SentencePiece training failed" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()
    spec = {**SPEC, "cell_base": {"causal_decoder/flm": {"optim": {"learning_rate": -1}}}}
    with pytest.raises(ConfigError, match=r"cell_base\[causal_decoder/flm\]\.optim"):
        main_job.expand(validate(StudySpec, spec, "spec"), REPO)


def test_a_step_that_needs_more_memory_than_a_device_has_is_refused_before_it_runs(
    tmp_path, capsys, monkeypatch
):
    """XLA's analysis of the compiled step against the device's memory (here a device made
    small, as the CPU is for a finetune's default 1,024 x 1,280 batch): one line naming the
    batch and lengths and what to lower, and the new run directory is gone again."""
    from collections import OrderedDict

    import jax

    from scalestudy.train import datasheets
    from scalestudy.train import program as train_program

    # compiled here: a program cached by an earlier run of this module is not checked again
    monkeypatch.setattr(train_program, "_PROGRAMS", OrderedDict())
    # more than the parameters alone (refused before compiling, as in the test below), less
    # than the step
    monkeypatch.setattr(datasheets, "device_memory", lambda device: 2**17)
    argv = ["train", "--config", TINY, "--workdir", str(tmp_path / "w"), "train.steps=2"]
    assert main([*argv, "train.batch_size=8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "GiB per device, more than the 0.0 GiB a cpu device has" in err[0]
    assert f"train.batch_size=8 over {jax.device_count()} devices" in err[0]
    assert "train.microbatches" in err[0]
    assert not (tmp_path / "w").exists()
    monkeypatch.setattr(datasheets, "device_memory", lambda device: 2**40)
    assert main([*argv, "train.batch_size=8", "train.progress=false"]) == 0


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.d_model=1000000", "model.d_ff=1000000"],
        ["data.source=text", "data.paths=[null]"],
        ["eval.tasks=[nonexistent_task]"],
    ],
    ids=["huge_model", "null_path", "unknown_task"],
)
def test_a_train_its_config_refuses_leaves_the_workdir_as_found(overrides, tmp_path, capsys):
    """Refused as the config loads: no config.yaml, run.lock or train.log left behind, in a
    workdir that did not exist or one that was empty."""
    for workdir in (tmp_path / "new", tmp_path / "empty"):
        if workdir.name == "empty":
            workdir.mkdir()
        argv = ["train", "--config", TINY, "--workdir", str(workdir), "train.steps=2"]
        assert main([*argv, *overrides]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.startswith("error: "), err
        assert workdir.exists() == (workdir.name == "empty")
        assert not workdir.exists() or not any(workdir.iterdir())


def test_a_model_whose_parameters_alone_exceed_the_devices_is_refused_before_compiling(
    tmp_path, capsys, monkeypatch
):
    """Parameters that all of the job's devices together cannot hold: one line naming the
    sizes, before anything is compiled or written."""
    from scalestudy.train import datasheets, loop

    monkeypatch.setattr(datasheets, "device_memory", lambda device: 2**20)
    monkeypatch.setattr(loop, "build_program", lambda *a, **k: pytest.fail("compiled"))
    argv = ["train", "--config", TINY, "--workdir", str(tmp_path / "w"), "train.steps=2"]
    assert main([*argv, "model.d_model=256", "model.d_ff=8192"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "the model's 13,305,216 parameters alone need" in err[0]
    assert "model.d_model=256, model.d_ff=8192" in err[0]
    assert not (tmp_path / "w").exists()


class _StderrHandler(logging.StreamHandler):
    """Writes each record to the `sys.stderr` of the moment (pytest swaps it between phases)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


@pytest.fixture
def records_on_stderr(capfd):
    """Library log records printed on stderr as on the command line: there the root logger
    has no handler, and absl's first record calls `logging.basicConfig()` (under pytest the
    root logger holds pytest's handlers, and nothing would be printed)."""
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
    logging.root.addHandler(handler)
    yield capfd
    logging.root.removeHandler(handler)


@pytest.mark.slow
def test_a_step_never_saved_is_refused_without_orbax_notes(trained_run, records_on_stderr):
    """orbax's notes on opening the checkpoints read-only (`WARNING:absl:...`) never come
    before the error line."""
    records_on_stderr.readouterr()
    assert main(["eval", "--workdir", str(trained_run), "--step", "7"]) == 2
    err = records_on_stderr.readouterr().err
    assert "WARNING:absl" not in err, err
    assert err.strip().splitlines() == [
        f"error: --step 7: {trained_run} has no checkpoint at that step; steps saved: 2 (leave "
        "out --step for the latest)"
    ]


@pytest.mark.slow
def test_a_run_that_cannot_take_its_lock_stops_without_orbax_notes(
    trained_run, tmp_path, records_on_stderr
):
    """A run directory whose files cannot be written (here run.lock is a directory; a
    read-only disk is the same): the error line names the checkpoints kept, and orbax's
    notes on reading them are not printed before it."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    (run / "run.lock").unlink()
    (run / "run.lock").mkdir()
    records_on_stderr.readouterr()
    assert main(["train", "--workdir", str(run)]) == 2
    err = records_on_stderr.readouterr().err
    assert "WARNING:absl" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "checkpoints up to step 2 are intact" in lines[0], lines
