"""`scalestudy compile --spec`: one ahead-of-time plan per train-step shape of a study,
pretraining and the stages after it (finetuning at its own lengths and batch)."""

from pathlib import Path

import pytest

from scalestudy.study.compile_plan import study_shapes

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
    from scalestudy.cli import main

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
    from scalestudy.cli import main

    assert main(["compile"]) == 2
    assert "give --config FILE (one run) or --spec STUDY" in capsys.readouterr().err
