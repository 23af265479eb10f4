"""`scalestudy compile --spec`: one ahead-of-time plan per train-step shape of a study,
pretraining and the stages after it (finetuning at its own lengths and batch)."""

from pathlib import Path

import pytest

from scalestudy.study.run.compile_plan import study_shapes

pytestmark = pytest.mark.optimized  # the compiler's memory analysis

STUDIES = Path(__file__).resolve().parents[2] / "configs" / "studies"
# The smoke pipeline at test size, finetuning at lengths and a batch of its own (32 + 8
# tokens x 8 rows) so that its shapes differ from pretraining's (48 + 16 x 16).
TINY = [
    "budget.steps=2",
    "stages.finetune.inputs_length=32",
    "stages.finetune.targets_length=8",
    "stages.finetune.batch_size=8",
]


def test_the_wang_plan_lists_the_finetuning_shapes_beside_pretraining():
    """Wang et al.'s spec: pretraining rows of 512 + 114 tokens x 2,048, finetuning rows of
    1,024 + 256 x 1,024 (decoder-only: one 1,280-token row; encoder-decoder: 1,024 in, 256
    out), for every cell; adaptation and the runs from scratch share pretraining's shapes."""
    shapes = study_shapes(STUDIES / "wang2022.yaml")
    pre = [s for s in shapes if s["stage"].startswith("pretrain")]
    ft = [s for s in shapes if s["stage"] == "finetune"]
    assert {(s["decoder_length"], s["batch"]) for s in pre if not s["encoder_length"]} == {
        (626, 2048)
    }
    assert {(s["encoder_length"], s["decoder_length"], s["batch"]) for s in ft} == {
        (0, 1280, 1024),
        (1024, 256, 1024),
    }
    assert {s["cfg"].model.arch for s in ft} == {
        "causal_decoder",
        "noncausal_decoder",
        "encoder_decoder",
    }
    # every pretrained and adapted run (and run from scratch) is finetuned: 6 + 2 + 2
    assert sum(s["runs"] for s in ft) == 10
    assert any("adapt" in s["stage"] and "scratch" in s["stage"] for s in pre)


@pytest.mark.slow
def test_compile_spec_compiles_every_shape_on_cpu(capsys):
    from scalestudy.cli.main import main

    assert main(["compile", "--spec", str(STUDIES / "wang2022_smoke.yaml"), *TINY]) == 0
    out = capsys.readouterr().out
    blocks = [b for b in out.split("\n\n") if b.strip()]
    stages = [
        next(ln.split()[1] for ln in b.splitlines() if ln.startswith("stage")) for b in blocks
    ]
    assert stages.count("finetune") == 2 and len(stages) == 4, stages
    for block in blocks:
        rows = dict(ln.split(None, 1) for ln in block.splitlines())
        expect = ("40", "8") if rows["stage"] == "finetune" else ("64", "16")
        assert (rows["decoder_length"], rows["batch"]) == expect
        assert float(rows["xla_over_counted"]) > 0  # compiled, with XLA's cost analysis


def test_compile_wants_one_of_config_and_spec(capsys):
    from scalestudy.cli.main import main

    assert main(["compile"]) == 2
    assert "give --config FILE (one run) or --spec STUDY" in capsys.readouterr().err


def test_the_tpu_compiler_gets_a_larger_fiber_stack_unless_one_is_given():
    from scalestudy.train.plan.aot import COMPILER_FLAGS, libtpu_init_args

    (flag,) = COMPILER_FLAGS
    assert libtpu_init_args("") == flag
    assert libtpu_init_args("--xla_foo=1").split() == [flag, "--xla_foo=1"]
    own = "--fibers_default_thread_stack_size=4194304 --xla_foo=1"
    assert libtpu_init_args(own) == own  # the user's own value wins


@pytest.mark.slow
def test_the_finetuning_step_with_dropout_compiles_on_cpu():
    """Wang et al.'s finetuning dropout (0.1 on embeddings, residual branches, feed-forward
    hidden units and attention probabilities) in the planned finetuning step, scanned."""
    import jax

    from scalestudy.train.plan import aot

    overrides = [*TINY, "base.model.scan_layers=true", "stages.finetune.dropout=0.1"]
    shapes = study_shapes(STUDIES / "wang2022_smoke.yaml", overrides)
    ft = [s for s in shapes if s["stage"] == "finetune"]
    assert ft and all(s["cfg"].model.dropout == 0.1 for s in ft)
    assert all(s["cfg"].model.dropout == 0.0 for s in shapes if s not in ft)
    compiled, _, _ = aot._compile(ft[0]["cfg"], jax.devices())
    assert not isinstance(compiled, str), compiled
    assert "threefry" in compiled.as_text()  # the dropout masks are drawn in the step


# The smallest program known to overflow libtpu 0.0.42's code-emitting fiber stack without
# aot.COMPILER_FLAGS: two layers of Wang et al.'s decoder at their finetuning shape on v4-256
# (1,024 rows of 1,280 tokens, data 2 x fsdp 16 x tensor 4) with dropout on the attention
# probabilities. In a subprocess: a compiler crash is a signal, not an exception.
WANG_FINETUNE_STEP = """
import os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
from scalestudy.config.experiment import load_config
from scalestudy.train.plan import aot
cfg = load_config(sys.argv[1], sys.argv[2:])
compiled, mesh, _ = aot._compile(cfg, aot.tpu_devices("v4-256"))
assert not isinstance(compiled, str), compiled[:300]
print("compiled", dict(mesh.shape), compiled.memory_analysis().temp_size_in_bytes)
"""


@pytest.mark.slow
def test_the_wang_finetuning_step_with_dropout_compiles_for_a_tpu_pod():
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("no TPU compiler (libtpu, the `tpu` extra) installed")
    if os.environ.get("SCALESTUDY_HEAVY_TESTS") != "1":
        # About 4 CPU minutes of libtpu compiling: more than the suite's budget allows. The
        # cheap test above checks the flag reaches the compiler; this one proves it suffices.
        pytest.skip("a 4-minute TPU compile: set SCALESTUDY_HEAVY_TESTS=1 to run it")
    config = STUDIES.parent / "models" / "wang2022_xxl_decoder.yaml"
    overrides = [
        "model.n_layers=2",
        "model.dtype=bfloat16",
        "model.scan_layers=true",
        "model.remat=full",
        "model.dropout=0.1",
        "mesh.data=-1",
        "mesh.fsdp=16",
        "mesh.tensor=4",
        "train.batch_size=1024",
        "objective.name=plm",
        "objective.plm_split=fit",
        "objective.inputs_length=1024",
        "objective.targets_length=256",
    ]
    env = {k: v for k, v in os.environ.items() if k != "LIBTPU_INIT_ARGS"}
    done = subprocess.run(
        [sys.executable, "-c", WANG_FINETUNE_STEP, str(config), *overrides],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled {'data': 2, 'fsdp': 16, 'tensor': 4}" in done.stdout
