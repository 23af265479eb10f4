"""The real-text scaling spec: its design holds (sizes, token budgets, learning rates, cadences)
and the study spec accepts the BLiMP task it evaluates."""

from pathlib import Path

import pytest

from scalestudy.config.errors import ConfigError
from scalestudy.study.run import main_job

SPEC = Path(__file__).resolve().parents[2] / "configs" / "studies" / "realtext_scaling.yaml"


@pytest.fixture(scope="module")
def planned():
    study = main_job.load_study(SPEC)
    return study, main_job.expand(study, SPEC.parent)


def test_study_tasks_accept_blimp():
    from scalestudy.evaluate.tasks import check_spelling

    check_spelling(["blimp", "blimp:../shared/data/eval/blimp/adjunct_island.jsonl"], "tasks")
    with pytest.raises(ConfigError, match=r"unknown task 'blimps'.*blimp"):
        check_spelling(["blimps"], "tasks")


def test_two_cells_at_six_growing_sizes(planned):
    _, runs = planned
    cells = {(r.arch, r.objective) for r in runs}
    assert cells == {("causal_decoder", "flm"), ("noncausal_decoder", "plm")}
    for cell in cells:
        n = [
            r.params["non_embedding"] for r in runs if (r.arch, r.objective) == cell and r.seed == 0
        ]
        assert len(n) == 6 and n == sorted(n) and len(set(n)) == 6
        assert n[-1] / n[0] > 25  # more than a decade and a half for the fits
        repeats = [r for r in runs if (r.arch, r.objective) == cell and r.seed != 0]
        # Repeats only at the smallest size, where runs are cheapest.
        assert {r.params["non_embedding"] for r in repeats} == {n[0]} and len(repeats) == 2


def test_every_run_reads_twenty_tokens_per_parameter(planned):
    """Of the rung's causal decoder's parameters (every cell of a size reads the same text)."""
    study, runs = planned
    reference = {r.size: r.params["non_embedding"] for r in runs if r.arch == "causal_decoder"}
    for r in runs:
        cfg = r.cfg
        per_step = cfg.train.batch_size * cfg.objective.inputs_length
        per_step += cfg.train.batch_size * cfg.objective.targets_length
        tokens = cfg.train.steps * per_step
        want = study.budget.tokens_per_param * reference[r.size]
        assert want <= tokens < want + per_step, (r.size, tokens, want)


def test_learning_rate_scales_inversely_with_width(planned):
    study, runs = planned
    base_lr = study.base["optim"]["learning_rate"]
    for r in runs:
        lr, d = r.cfg.optim.learning_rate, r.cfg.model.d_model
        assert lr == pytest.approx(base_lr * study.ladder.lr_reference_width / d)


def test_calls_of_several_steps_line_up_with_rows_and_saves(planned):
    _, runs = planned
    for r in runs:
        t = r.cfg.train
        assert t.steps_per_call > 1
        assert t.log_every % t.steps_per_call == 0
        assert t.checkpoint_every % t.steps_per_call == 0
