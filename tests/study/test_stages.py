"""Finetuning and adaptation stages: bad input refused before anything is written, exact
resume inside a stage, held-out tasks never trained, adaptation's first loss, lineage."""

import json
from pathlib import Path

import numpy as np
import pytest

from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import load_config
from scalestudy.study.plan import stages_spec
from scalestudy.study.record import lineage
from scalestudy.study.record.rows import RunRow
from scalestudy.study.run import stages
from scalestudy.train.loop import Preempted
from scalestudy.train.rundir import layout as rundir

TINY = [
    "model.d_model=32",
    "model.d_ff=64",
    "model.n_heads=2",
    "model.n_layers=2",
    # rope: the default relative bias (`mirrored`) gives the non-causal decoder a table half
    # the causal one lacks; Wang et al.'s single table is tested on its own below.
    "model.position=rope",
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
        ("other arch", stages_spec.StageError, "expects encoder_decoder"),
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
    with pytest.raises(stages_spec.StageError, match="unfinished"):
        stages.prepare_finetune(run, tmp_path / "out", [*FT, f"mixture={mixture}"])
    with pytest.raises(stages_spec.StageError, match="no such run"):
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
    from scalestudy.train.rundir.saved_run import restore_params

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
    with pytest.raises(stages_spec.StageError, match="do not share parameters"):
        stages.prepare_adapt(parent, tmp_path / "out", ["arch=encoder_decoder", "objective=mlm"])
    with pytest.raises(stages_spec.StageError, match=r"parameter .* in the parent"):
        stages.prepare_adapt(
            parent, tmp_path / "out", ["arch=noncausal_decoder", "objective=mlm", "model.d_ff=32"]
        )
    assert not (tmp_path / "out").exists()


def test_the_cli_prints_a_bad_stage_as_one_line(parent: Path, tmp_path: Path, capsys):
    from scalestudy.cli.main import main

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
    from scalestudy.cli.main import main
    from scalestudy.study.run import after_pretraining
    from scalestudy.study.run.main_job import load_study

    study = load_study(SMOKE, SMOKE_TINY)
    planned = after_pretraining.plan_stages(study, SMOKE.parent, tmp_path / "out")
    assert [r.stage for r in planned] == ["adapt", "scratch", *["finetune"] * 3] * 2
    adapt = [r for r in planned if r.stage == "adapt"]
    assert {(r.cfg.model.arch, r.cfg.objective.name) for r in adapt} == {
        ("causal_decoder", "flm"),
        ("noncausal_decoder", "mlm"),
    }
    assert all(r.extra_steps == 1 and r.cfg.train.steps == 5 for r in adapt)  # 0.25 x 4
    # Wang et al.'s decoder-only relative bias (one table for both masks): the adaptations
    # keep every parameter of their parents.
    assert all(r.cfg.model.position == "relative_bias" for r in planned)
    parents = {r.name: r.pretrained.cfg for r in adapt}
    for r in adapt:
        stages_spec.check_same_parameters(parents[r.name], r.cfg)
    for s in (r for r in planned if r.stage == "scratch"):  # same FLOPs as pretrain + adapt
        a = next(r for r in adapt if r.name == s.matches)
        assert s.parent is None and s.cfg.train.init_from is None
        assert (s.cfg.model, s.cfg.objective) == (a.cfg.model, a.cfg.objective)
        total = a.pretrained.planned_flops + a.planned_flops
        per_step = s.planned_flops / s.extra_steps
        assert abs(s.planned_flops - total) <= per_step / 2
    ft_parents = {r.parent.name for r in planned if r.stage == "finetune"}
    scratch = {r.name for r in planned if r.stage == "scratch"}
    assert {r.name for r in adapt} | scratch <= ft_parents  # adapted runs are finetuned too
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
    assert "10 stage runs" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_smoke_pipeline_pretrains_adapts_finetunes_and_tabulates(tmp_path: Path):
    from scalestudy.cli.main import main
    from scalestudy.study.record.registry import load_runs
    from scalestudy.study.run import after_pretraining

    out = tmp_path / "out"
    assert main(["study", "--spec", str(SMOKE), "--out", str(out), *SMOKE_TINY]) == 0
    text = (out / after_pretraining.TABLE).read_text()
    table = text.split("## ")[0].splitlines()
    rows = [line.split(" | ") for line in table if line.startswith("| wang2022_smoke")]
    assert len(rows) == 2
    for cells in rows:  # pretrain, + finetune, adapted, adapted + finetune: all measured
        assert all("±" in cells[i] for i in (2, 3, 5, 6)), cells
    # The paper's numbers (EAI / T0) beside: causal FLM after pretraining, after finetuning,
    # adapted to non-causal MLM and finetuned; non-causal MLM after finetuning only.
    assert "| 44.2 / 42.4 | 50.4 / 51.4 | 52.3 / 54.9 |" in text
    assert "| - | 51.0 / 55.2 | - |" in text

    # Lineage in the registry, as in each stage run's summary; pretraining queries see the
    # pretrained runs only.
    pretrained = {r["run_id"]: r for r in load_runs(out)}
    assert len(pretrained) == 2 and all(r["stage"] is None for r in pretrained.values())
    runs = {r["run_id"]: r for r in load_runs(out, stages=True)}
    assert all(r["status"] == "done" for r in runs.values()) and len(runs) == 12
    by_stage = {s: [r for r in runs.values() if r["stage"] == s] for s in ("adapt", "scratch")}
    for a in by_stage["adapt"]:
        assert a["parent_run_id"] in pretrained and a["parent_step"] == 4 and a["steps"] == 1
    for r in runs.values():
        if r["stage"] in ("adapt", "finetune"):  # parent_step: where the parent finished
            p = runs[r["parent_run_id"]]
            assert r["parent_step"] == p["steps"] + (p["parent_step"] or 0)
        if r["stage"]:
            recorded = json.loads((Path(r["workdir"]) / "summary.json").read_text())["lineage"]
            assert recorded["parent_step"] == r["parent_step"]

    # Adapted vs from scratch at equal total compute: the scratch run's measured FLOPs equal
    # the adapted run's parent's + its own within half a step of the scratch run.
    assert "## Adapted vs from scratch at equal total compute" in text
    for s in by_stage["scratch"]:
        a = runs[s["matches_run_id"]]
        total = pretrained[a["parent_run_id"]]["flops"] + a["flops"]
        assert abs(s["flops"] / total - 1) <= 0.5 / s["steps"]
        p = pretrained[a["parent_run_id"]]
        cell = f"{p['arch']}/{p['objective']}"
        row = next(line for line in text.splitlines() if line.startswith(f"| {cell} | {a['arch']}"))
        assert f"| {s['flops'] / total:.4f} |" in row and "one seed" in row
    assert "## Stage runs" in text


def test_the_table_average_and_its_interval():
    from scalestudy.study.report.wang_report import average

    evals = {"a/acc": 0.5, "a/n": 100, "b/acc": 0.8, "b/n": 25}
    mean, half = average(evals, ("a", "b"))
    assert mean == pytest.approx(0.65)
    assert half == pytest.approx(1.96 * (0.25 / 100 + 0.16 / 25) ** 0.5 / 2)
    assert average(evals, ("a", "c")) is None  # a task not evaluated: no number


def test_the_table_puts_each_stage_in_its_column_beside_the_paper(tmp_path: Path):
    from scalestudy.study.report import wang_report
    from scalestudy.study.run import after_pretraining
    from scalestudy.study.run.main_job import load_study

    planned = after_pretraining.plan_stages(load_study(SMOKE, SMOKE_TINY), SMOKE.parent, tmp_path)
    scores = iter([0.30, 0.40, 0.50, 0.60, 0.11, 0.12, 0.70, 0.80, 0.90, 0.20, 0.13, 0.14])
    for r in planned:
        if r.stage != "finetune":
            continue
        where = tmp_path / "stages" / r.name
        where.mkdir(parents=True)
        before, after = next(scores), next(scores)
        (where / lineage.STAGE_FILE).write_text(
            json.dumps({"eval_before": {"synthetic_probes/acc": before, "synthetic_probes/n": 100}})
        )
        (where / "summary.json").write_text(
            json.dumps({"eval": {"synthetic_probes/acc": after, "synthetic_probes/n": 100}})
        )
    published = {
        "cells": {"causal_decoder/flm": {"pretrain": 44.0, "finetune": {"eai": 55.0, "t0": 5}}},
        "adapted": {"causal_decoder/flm -> noncausal_decoder/mlm": {"finetune": {"eai": 1.5}}},
    }
    lines = wang_report.table(planned, tmp_path, published).splitlines()
    causal = next(line for line in lines if ".causal_decoder.flm." in line).split(" | ")
    # pretrain, + finetune, adapted to, adapted, adapted + finetune, paper (3 columns); the run
    # from scratch (0.11, 0.12) is not a row of this table
    assert [c.split(" ±")[0] for c in causal[2:10]] == [
        "30.0",
        "40.0",
        "noncausal_decoder/mlm",
        "50.0",
        "60.0",
        "44.0",
        "55.0 / 5",
        "1.5 / - |",
    ]
    noncausal = next(line for line in lines if ".noncausal_decoder.mlm." in line)
    assert "| 70.0 ± 9.0 | 80.0 ± 7.8 | causal_decoder/flm | 90.0 ± 5.9 | 20.0 ± 7.8 |" in (
        noncausal
    )


def test_adapted_vs_scratch_is_paired_by_seed_with_an_interval(tmp_path: Path):
    """Two seeds: the comparison's Δ is the mean of the per-seed differences, with a t
    interval over the two seeds; the FLOPs ratio is the registry's."""
    from scalestudy.study.report import wang_report
    from scalestudy.study.run import after_pretraining
    from scalestudy.study.run.main_job import load_study

    only = (
        "[{from_cell: [causal_decoder, flm], arch: noncausal_decoder, objective: mlm, "
        "fraction: 0.25}]"
    )
    cells = ["cells=[[causal_decoder,flm]]", f"stages.adapt={only}"]  # one cell, its adaptation
    study = load_study(SMOKE, [*SMOKE_TINY, "seeds=[0,1]", *cells])
    planned = [
        r
        for r in after_pretraining.plan_stages(study, SMOKE.parent, tmp_path)
        if r.stage != "finetune"
    ]
    losses = {("adapt", 0): 2.0, ("adapt", 1): 2.2, ("scratch", 0): 2.5, ("scratch", 1): 2.9}
    runs = {}
    for r in planned:
        loss = losses[r.stage, r.pretrained.seed]
        runs[r.run_id] = RunRow(r.run_id, flops=r.planned_flops, loss=loss)
        runs[r.pretrained.run_id] = RunRow(r.pretrained.run_id, flops=r.pretrained.planned_flops)
    records = wang_report.equal_compute(planned, tmp_path, runs)
    assert sorted(r.seed for r in records) == [0, 1]
    for rec in records:
        assert rec.ratio == pytest.approx(rec.scratch_flops / rec.adapted_flops)
    [row] = [line for line in wang_report.equal_compute_lines(records) if "| 2 |" in line]
    d = np.array([2.0 - 2.5, 2.2 - 2.9])
    half = 12.706 * d.std(ddof=1) / np.sqrt(2)  # t(0.975, 1 df)
    assert f"{d.mean():+.3f} [{d.mean() - half:+.3f}, {d.mean() + half:+.3f}]" in row


def test_lineage_under_relative_bias_needs_wangs_single_table():
    """Causal <-> non-causal adaptation with relative position bias keeps every parameter
    under Wang et al.'s layout (rel_prefix_buckets=causal) and is refused, naming the fix,
    under the mirrored one."""
    tiny = [t for t in TINY if not t.startswith("model.position")]
    for buckets, ok in (("causal", True), ("mirrored", False)):
        cfg = load_config(
            None, [*tiny, "model.position=relative_bias", f"model.rel_prefix_buckets={buckets}"]
        )
        for src, src_obj, dst, obj in (
            ("causal_decoder", "flm", "noncausal_decoder", "mlm"),
            ("noncausal_decoder", "mlm", "causal_decoder", "flm"),
        ):
            parent = cfg.replace(
                model=cfg.model.replace(arch=src), objective=cfg.objective.replace(name=src_obj)
            )
            ad = stages_spec.AdaptConfig(arch=dst, objective=obj, steps=1)
            new = stages_spec.adapt_config(parent, Path("parent"), 4, ad)
            if ok:
                stages_spec.check_same_parameters(parent, new)
            else:
                with pytest.raises(stages_spec.StageError, match="rel_prefix_buckets=causal"):
                    stages_spec.check_same_parameters(parent, new)


@pytest.mark.parametrize(
    "error,status",
    [(Preempted("SIGTERM received", 15), "interrupted"), (ValueError("broken"), "failed")],
    ids=["signal", "error"],
)
def test_a_stage_run_stopped_is_interrupted_and_one_that_raised_is_failed(
    tmp_path: Path, monkeypatch, error, status
):
    """The registry row of a stage run says what happened to it; the runs after it stay
    pending, and the plan's rows are all there before any trains."""
    from scalestudy.study.record.registry import load_runs
    from scalestudy.study.run import after_pretraining, main_job

    study = main_job.load_study(SMOKE, SMOKE_TINY)
    runs = main_job.expand(study, SMOKE.parent)

    def stop(r, where):
        raise error

    monkeypatch.setattr(after_pretraining, "_run_one", stop)
    with pytest.raises(type(error)):
        after_pretraining.run_stages(study, SMOKE.parent, tmp_path, runs)
    rows = load_runs(tmp_path, stages=True)
    assert [r["status"] for r in rows] == [status] + ["pending"] * 9
    assert rows[0]["stage"] == "adapt" and rows[0]["error"]
    assert load_runs(tmp_path) == []  # no pretraining row was touched (none was planned here)


def test_collecting_a_study_with_stages_trains_no_stage(tmp_path: Path, monkeypatch, capsys):
    """`--collect` records cluster-trained runs and never trains: not the stages either (the
    stage runs missing here are listed, and the command fails)."""
    from scalestudy.cli.main import main
    from scalestudy.study.run import after_pretraining, main_job

    study = main_job.load_study(SMOKE, SMOKE_TINY)
    runs = main_job.expand(study, SMOKE.parent)
    monkeypatch.setattr(main_job, "run_study", lambda *a, **k: (study, runs))
    monkeypatch.setattr(
        after_pretraining, "run_stages", lambda *a, **k: pytest.fail("stages trained")
    )
    monkeypatch.setattr(
        after_pretraining, "_run_one", lambda *a, **k: pytest.fail("a stage trained")
    )
    out = str(tmp_path / "out")
    assert main(["study", "--spec", str(SMOKE), "--out", out, "--collect", *SMOKE_TINY]) == 2
    assert "0 of 10 stage runs complete" in capsys.readouterr().out


@pytest.mark.slow
def test_the_score_before_a_stage_is_the_parents_own_evaluation(tmp_path: Path, monkeypatch):
    """An MLM parent is scored before adaptation as `scalestudy eval` scores it: with the EOS
    its span-corruption inputs ended in and the sentinel its targets began with, not in the
    adapted objective's form."""
    from scalestudy.evaluate.rank import evaluate_run, make_eval_fn
    from scalestudy.models.api import build_model
    from scalestudy.train.rundir.saved_run import restore_params

    evaluation = ["eval.tasks=[synthetic_probes]", "eval.max_examples=16"]
    parent = _train(
        tmp_path / "mlm", "model.arch=encoder_decoder", "objective.name=mlm", *evaluation
    )
    out = tmp_path / "adapted"
    cfg, record = stages.prepare_adapt(parent, out, ["objective=plm", "steps=1"])
    stages.run_stage(cfg, record, out, evaluate=True)
    before = lineage.read_lineage(out)["eval_before"]
    own = evaluate_run(
        parent,
        overrides=[
            f"eval.inputs_length={cfg.objective.inputs_length}",
            f"eval.targets_length={cfg.objective.targets_length}",
        ],
    )
    scored = {k: v for k, v in before.items() if k.endswith("/acc") or k.endswith("task_loss")}
    assert scored and all(own[k] == pytest.approx(v, rel=1e-6) for k, v in scored.items())
    # Scored in the adapted objective's form (no end-of-input EOS), the same weights differ.
    _, params, step = restore_params(parent)
    other = make_eval_fn(cfg)(build_model(cfg.model), params, step)
    assert any(other[k] != pytest.approx(v, rel=1e-6) for k, v in scored.items())
    # The trained form holds the sentinel: without it the parent's own scores differ too.
    from scalestudy.evaluate import budget

    parent_cfg, _, _ = restore_params(parent)
    eval_cfg = parent_cfg.replace(eval=cfg.eval.replace(**{k: getattr(cfg.objective, k)
                                  for k in ("inputs_length", "targets_length")}))  # fmt: skip
    monkeypatch.setattr(budget, "targets_prefix", lambda cfg: [])
    bare = make_eval_fn(eval_cfg)(build_model(parent_cfg.model), params, step)
    assert any(bare[k] != pytest.approx(v, rel=1e-6) for k, v in scored.items())


def _rates(run: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in rundir.read_metrics(run) if "lr" in r}


@pytest.mark.slow
def test_adaptation_continues_its_parents_schedule_unless_told_to_stretch_it(
    parent: Path, tmp_path: Path
):
    """A cosine parent ends at its final rate; "continue" (Wang et al.'s choice, the default)
    stays there, "stretch" lays the cosine over parent + extra steps and raises it again."""
    before = _rates(parent)
    last = before[max(before)]
    peak, final = 0.01, 0.1  # TINY's learning rate; the default final_lr_fraction
    runs = {}
    for how in ("continue", "stretch"):
        out = tmp_path / how
        cfg, record = stages.prepare_adapt(
            parent, out, ["objective=plm", "steps=2", f"schedule={how}"]
        )
        assert record["settings"]["schedule"] == how
        stages.run_stage(cfg, record, out, evaluate=False)
        runs[how] = _rates(out)
    assert sorted(runs["continue"]) == [5, 6]
    assert all(r == pytest.approx(peak * final) and r <= last for r in runs["continue"].values())
    assert runs["stretch"][5] > last * 1.2  # the decayed rate jumps back up
