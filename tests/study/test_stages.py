"""Finetuning and adaptation stages: bad input refused before anything is written, exact
resume inside a stage, held-out tasks never trained, adaptation's first loss, lineage."""

import json
from pathlib import Path

import numpy as np
import pytest

from scalestudy.config import load_config
from scalestudy.errors import ConfigError
from scalestudy.study import stages
from scalestudy.train import rundir

TINY = [
    "model.d_model=32",
    "model.d_ff=64",
    "model.n_heads=2",
    "model.n_layers=2",
    "model.position=rope",  # causal and non-causal relative-bias tables differ in shape
    "model.dtype=float32",
    "objective.inputs_length=24",
    "objective.targets_length=8",
    "data.synthetic.n_train_documents=200",
    "data.synthetic.n_validation_documents=20",
    "train.batch_size=8",
    "train.steps=4",
    "train.log_every=1",
    "train.checkpoint_every=2",
    "train.eval_batches=1",
    "train.progress=false",
    "train.async_checkpoint=false",
    "optim.learning_rate=0.01",
]
# The stage's own settings at test size (the defaults are Wang et al.'s XXL finetuning).
FT = [
    "steps=4",
    "batch_size=8",
    "inputs_length=24",
    "targets_length=8",
    "dropout=0.0",
    "eval_tasks=[synthetic_probes]",
    "eval_prompts=harness",
    "eval.max_examples=4",
]

QA = """\
templates:
  q1: !Template
    answer_choices: '{{ options | join(" ||| ") }}'
    jinja: 'Q: {{question}} ||| {{ answer_choices[label] }}'
    metadata: !TemplateMetadata
      original_task: true
    name: plain
"""
NLI = """\
templates:
  n1: !Template
    answer_choices: Yes ||| No
    jinja: '{{premise}} So "{{hypothesis}}"? ||| {{ answer_choices[label] }}'
    metadata: !TemplateMetadata
      original_task: true
    name: so
"""


def _mixture(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "qa.yaml").write_text(QA)
    (folder / "nli.yaml").write_text(NLI)
    qa = [
        {"question": f"{i} plus one", "options": [str(i + 1), str(i + 2)], "label": i % 2}
        for i in range(40)
    ]
    nli = [{"premise": f"HELDOUT {i}", "hypothesis": "x", "label": i % 2} for i in range(20)]
    (folder / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in qa))
    (folder / "nli.jsonl").write_text("".join(json.dumps(r) + "\n" for r in nli))
    path = folder / "mix.yaml"
    path.write_text(
        "name: stage_toy\ntasks:\n"
        "  - {name: qa, cluster: qa, path: qa.jsonl, templates: qa.yaml}\n"
        "  - {name: nli, cluster: nli, path: nli.jsonl, templates: nli.yaml, eval_task: rte}\n"
    )
    return path


def _train(workdir: Path, *more: str) -> Path:
    from scalestudy.train.loop import train

    train(load_config(None, [*TINY, *more]), workdir)
    return workdir


@pytest.fixture(scope="module")
def parent(tmp_path_factory) -> Path:
    """A finished causal-decoder FLM run."""
    return _train(tmp_path_factory.mktemp("parent") / "run")


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> Path:
    return _mixture(tmp_path_factory.mktemp("mix"))


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in rundir.read_metrics(run) if "train/loss" in r}


@pytest.mark.parametrize(
    ("case", "error", "match"),
    [
        ("no mixture", ConfigError, "no mixture given"),
        ("held out in train", ConfigError, "'nli' is in held-out cluster 'nli'"),
        ("other arch", stages.StageError, "expects encoder_decoder"),
        ("trained task evaluated", ConfigError, r"\['qa'\] are in the training mixture"),
    ],
)
def test_bad_finetune_input_is_one_error_and_writes_nothing(
    parent: Path, mixture: Path, tmp_path: Path, case, error, match
):
    given = {
        "no mixture": [],
        "held out in train": [f"mixture={tmp_path / 'bad.yaml'}"],
        "other arch": [f"mixture={mixture}", "arch=encoder_decoder"],
        "trained task evaluated": [f"mixture={mixture}", "eval_tasks=[qa]"],
    }[case]
    text = mixture.read_text().replace("path: ", f"path: {mixture.parent}/")
    text = text.replace("templates: ", f"templates: {mixture.parent}/")
    (tmp_path / "bad.yaml").write_text(text + "train: [qa, nli]\n")
    with pytest.raises(error, match=match):
        stages.prepare_finetune(parent, tmp_path / "out", [*FT, *given])
    assert not (tmp_path / "out").exists()


def test_an_unfinished_parent_is_refused(tmp_path: Path, mixture: Path):
    run = _train(tmp_path / "half", "train.stop_after_steps=2")
    with pytest.raises(stages.StageError, match="unfinished"):
        stages.prepare_finetune(run, tmp_path / "out", [*FT, f"mixture={mixture}"])
    with pytest.raises(stages.StageError, match="no such run"):
        stages.prepare_adapt(tmp_path / "nowhere", tmp_path / "out", ["objective=mlm"])
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_finetune_resumes_exactly_and_records_its_lineage(
    parent: Path, mixture: Path, tmp_path: Path
):
    over = [*FT, f"mixture={mixture}"]
    cfg, record = stages.prepare_finetune(parent, tmp_path / "straight", over)
    assert record["train_tasks"] == ["qa"] and record["held_out_tasks"] == ["nli"]
    assert cfg.train.steps == 4 + 4 and cfg.data.seqio_task == "prompted.stage_toy"
    summary = stages.run_stage(cfg, record, tmp_path / "straight", evaluate=True)
    assert summary["lineage"] == {
        "stage": "finetune",
        "parent": str(parent.resolve()),
        "parent_step": 4,
    }
    assert json.loads((tmp_path / "straight" / "summary.json").read_text())["lineage"]
    assert summary["eval"]  # zero-shot after finetuning

    split = tmp_path / "split"
    cfg, record = stages.prepare_finetune(parent, split, [*over, "train.stop_after_steps=6"])
    stages.run_stage(cfg, record, split, evaluate=False)
    cfg, record = stages.prepare_finetune(parent, split, over)
    stages.run_stage(cfg, record, split, evaluate=False)
    straight, resumed = _losses(tmp_path / "straight"), _losses(split)
    assert sorted(straight) == [5, 6, 7, 8]
    assert resumed == straight


@pytest.mark.slow
def test_adaptation_first_loss_is_the_old_weights_under_the_new_objective(
    parent: Path, tmp_path: Path
):
    import jax

    from scalestudy.data.pipeline import make_iterator
    from scalestudy.models.api import build_model
    from scalestudy.train.saved import restore_params

    out = tmp_path / "adapted"
    cfg, record = stages.prepare_adapt(
        parent, out, ["arch=noncausal_decoder", "objective=mlm", "steps=2"]
    )
    assert (cfg.model.arch, cfg.objective.name, cfg.train.steps) == ("noncausal_decoder", "mlm", 6)
    summary = stages.run_stage(cfg, record, out, evaluate=False)
    assert summary["lineage"]["parent_step"] == 4

    _, params, _ = restore_params(parent)
    batch = next(make_iterator(cfg))
    model = build_model(cfg.model)
    want, _ = model.loss(params, batch, None, z_loss=cfg.train.z_loss, deterministic=True)
    got = _losses(out)[5]
    np.testing.assert_allclose(got, float(jax.device_get(want)), rtol=2e-5)
    # The parent under its own objective scores the same weights differently.
    assert _losses(parent)[4] != pytest.approx(got, rel=1e-3)


def test_adapting_between_models_of_other_parameters_is_refused(parent: Path, tmp_path: Path):
    with pytest.raises(stages.StageError, match="do not share parameters"):
        stages.prepare_adapt(parent, tmp_path / "out", ["arch=encoder_decoder", "objective=mlm"])
    with pytest.raises(stages.StageError, match=r"parameter .* in the parent"):
        stages.prepare_adapt(
            parent, tmp_path / "out", ["arch=noncausal_decoder", "objective=mlm", "model.d_ff=32"]
        )
    assert not (tmp_path / "out").exists()


def test_the_cli_prints_a_bad_stage_as_one_line(parent: Path, tmp_path: Path, capsys):
    from scalestudy.cli import main

    assert main(["finetune", "--from", str(parent), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: finetune: no mixture given")


SMOKE = Path(__file__).resolve().parents[2] / "configs" / "studies" / "wang2022_smoke.yaml"
SMOKE_TINY = [
    "budget.steps=4",
    "stages.finetune.steps=2",
    "base.eval.max_examples=4",
    "base.train.checkpoint_every=2",
    "base.train.eval_batches=1",
]


def test_the_smoke_spec_plans_every_stage_and_dry_run_writes_nothing(tmp_path: Path, capsys):
    from scalestudy.cli import main
    from scalestudy.study import pipeline
    from scalestudy.study.sweep import load_study

    study = load_study(SMOKE, SMOKE_TINY)
    planned = pipeline.plan(study, SMOKE.parent, tmp_path / "out")
    assert [r.stage for r in planned] == ["adapt", "finetune", "finetune"] * 2
    adapt = [r for r in planned if r.stage == "adapt"]
    assert {(r.cfg.model.arch, r.cfg.objective.name) for r in adapt} == {
        ("causal_decoder", "flm"),
        ("noncausal_decoder", "mlm"),
    }
    assert all(r.extra_steps == 1 and r.cfg.train.steps == 5 for r in adapt)  # 0.25 x 4
    ft_parents = {r.parent.name for r in planned if r.stage == "finetune"}
    assert {r.name for r in adapt} <= ft_parents  # adapted runs are finetuned too
    assert (
        main(
            [
                "study",
                "--spec",
                str(SMOKE),
                "--out",
                str(tmp_path / "out"),
                "--dry-run",
                *SMOKE_TINY,
            ]
        )
        == 0
    )
    assert "6 stage runs" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_smoke_pipeline_pretrains_adapts_finetunes_and_tabulates(tmp_path: Path):
    from scalestudy.cli import main
    from scalestudy.study import pipeline

    out = tmp_path / "out"
    assert main(["study", "--spec", str(SMOKE), "--out", str(out), *SMOKE_TINY]) == 0
    rows = [
        line.split(" | ")
        for line in (out / pipeline.TABLE).read_text().splitlines()
        if line.startswith("| wang2022_smoke")
    ]
    assert len(rows) == 2
    for cells in rows:  # pretrain, + finetune, adapted, adapted + finetune: all measured
        assert all("±" in cells[i] for i in (2, 3, 5, 6)), cells
    for stage in (out / "stages").iterdir():
        summary = json.loads((stage / "summary.json").read_text())
        assert summary["lineage"]["parent_step"] in (4, 5)


def test_the_table_average_and_its_interval():
    from scalestudy.study.pipeline import average

    evals = {"a/acc": 0.5, "a/n": 100, "b/acc": 0.8, "b/n": 25}
    mean, half = average(evals, ("a", "b"))
    assert mean == pytest.approx(0.65)
    assert half == pytest.approx(1.96 * (0.25 / 100 + 0.16 / 25) ** 0.5 / 2)
    assert average(evals, ("a", "c")) is None  # a task not evaluated: no number


def test_the_table_puts_each_stage_in_its_column_beside_the_paper(tmp_path: Path):
    from scalestudy.study import pipeline
    from scalestudy.study.sweep import load_study

    planned = pipeline.plan(load_study(SMOKE, SMOKE_TINY), SMOKE.parent, tmp_path)
    scores = iter([0.30, 0.40, 0.50, 0.60, 0.70, 0.80, 0.90, 0.20])
    for r in planned:
        if r.stage != "finetune":
            continue
        where = tmp_path / "stages" / r.name
        where.mkdir(parents=True)
        before, after = next(scores), next(scores)
        (where / stages.STAGE_FILE).write_text(
            json.dumps({"eval_before": {"synthetic_probes/acc": before, "synthetic_probes/n": 100}})
        )
        (where / "summary.json").write_text(
            json.dumps({"eval": {"synthetic_probes/acc": after, "synthetic_probes/n": 100}})
        )
    published = {"cells": {"causal_decoder/flm": {"pretrain": 44.0, "finetune": 55.0}}}
    lines = pipeline.table(planned, tmp_path, published).splitlines()
    causal = next(line for line in lines if ".causal_decoder.flm." in line).split(" | ")
    # pretrain, + finetune, adapted to, adapted, adapted + finetune, paper, paper
    assert [c.split(" ±")[0] for c in causal[2:9]] == [
        "30.0",
        "40.0",
        "noncausal_decoder/mlm",
        "50.0",
        "60.0",
        "44.0",
        "55.0 |",
    ]
    noncausal = next(line for line in lines if ".noncausal_decoder.mlm." in line)
    assert "| 70.0 ± 9.0 | 80.0 ± 7.8 | causal_decoder/flm | 90.0 ± 5.9 | 20.0 ± 7.8 |" in (
        noncausal
    )
