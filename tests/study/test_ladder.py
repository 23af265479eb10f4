"""Size ladder rule, presets, matched comparisons and token budgets."""

import math

import pytest

from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import ExperimentConfig
from scalestudy.study.plan import ladder
from scalestudy.study.plan.spec import BudgetConfig, LadderConfig

counting = pytest.importorskip("scalestudy.models.counting")

RULE = LadderConfig(preset="decades")


def _approx_params(shape: dict) -> float:
    d, f = shape["d_model"], shape["d_ff"]
    return shape["n_layers"] * (4 * d * d + 3 * d * f)


@pytest.mark.parametrize("target", [1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11])
def test_rule_hits_target_with_valid_shapes(target):
    shape = ladder.shape_for(target, RULE)
    assert shape["d_model"] % shape["n_heads"] == 0
    assert 0.6 < _approx_params(shape) / target < 1.6
    # Aspect ratio grows with size, within the configured band (up to rounding).
    aspect = shape["d_model"] / shape["n_layers"]
    assert RULE.aspect_small / 2 <= aspect <= RULE.aspect_large * 1.5


def test_rule_is_monotone_and_counted_exactly():
    shapes = [ladder.shape_for(t, RULE) for t in (1e5, 1e6, 1e7, 1e8)]
    counts = [
        counting.count_params(ExperimentConfig().model.replace(**s))["non_embedding"]
        for s in shapes
    ]
    assert counts == sorted(counts) and len(set(counts)) == len(counts)


def test_presets_and_errors():
    names = [r.name for r in ladder.resolve_ladder(LadderConfig(preset="half_decades"))]
    assert names[0] == "100K" and names[-1] == "100B" and len(names) == 13
    rungs = ladder.resolve_ladder(
        LadderConfig(sizes=["1M", 2e6, "5e6", {"name": "x", "d_model": 32}])
    )
    assert [r.name for r in rungs] == ["1M", "2M", "5M", "x"]
    assert rungs[3].model == {"d_model": 32}
    with pytest.raises(ConfigError, match="preset"):
        ladder.resolve_ladder(LadderConfig(preset="nope"))
    with pytest.raises(ConfigError, match="cannot read"):
        ladder.resolve_ladder(LadderConfig(sizes=["huge"]))
    with pytest.raises(ConfigError, match="duplicate"):
        ladder.resolve_ladder(LadderConfig(sizes=["1M", 1e6]))


@pytest.mark.parametrize("target", [2e5, 1e6, 1e7])
def test_equal_total_params_matches_decoder_within_tolerance(target):
    base = ExperimentConfig().model.replace(**ladder.shape_for(target, RULE))
    decoder = counting.count_params(base)["total"]
    ed = ladder.match_model(base, "encoder_decoder", "equal_total_params", tolerance=0.03)
    assert ed.arch == "encoder_decoder"
    assert ed.n_layers + ed.encoder_layers <= base.n_layers + 1  # each stack about half as deep
    assert abs(counting.count_params(ed)["total"] - decoder) <= 0.03 * decoder


def test_equal_stack_shape_doubles_parameters():
    base = ExperimentConfig().model.replace(**ladder.shape_for(1e6, RULE))
    ed = ladder.match_model(base, "encoder_decoder", "equal_stack_shape")
    assert (ed.encoder_layers, ed.n_layers, ed.d_model, ed.d_ff) == (
        base.n_layers,
        base.n_layers,
        base.d_model,
        base.d_ff,
    )
    ratio = (
        counting.count_params(ed)["non_embedding"] / counting.count_params(base)["non_embedding"]
    )
    assert 1.9 < ratio < 2.6  # two stacks plus cross-attention
    nc = ladder.match_model(base, "noncausal_decoder", "equal_total_params")
    assert nc.arch == "noncausal_decoder" and nc.model_dump(exclude={"arch"}) == base.model_dump(
        exclude={"arch"}
    )


def test_budgets_hand_computed():
    cfg = ExperimentConfig().replace(train={"batch_size": 4, "steps": 1})
    per_example = counting.flops(cfg)
    positions = per_example["positions_per_example"]
    tokens = BudgetConfig(kind="tokens", tokens=1000 * positions)
    assert ladder.steps_for_budget(cfg, tokens) == 250
    tpp = BudgetConfig(kind="tokens_per_param", tokens_per_param=20)
    n = counting.count_params(cfg.model)["non_embedding"]
    assert ladder.steps_for_budget(cfg, tpp) == math.ceil(20 * n / (4 * positions))
    c = 37 * 4 * per_example["flops_per_example"]
    iso = BudgetConfig(kind="isoflop", compute=[c], min_steps=10)
    [(tag, compute)] = ladder.budget_points(iso)
    assert compute == c and tag.startswith("C")
    assert ladder.steps_for_budget(cfg, iso, compute) == 37
    assert ladder.steps_for_budget(cfg, iso, c / 10) == 0  # 3 steps < min_steps: dropped
