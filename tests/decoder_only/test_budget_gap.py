"""The speed-or-final-loss verdict on simulated gap curves (`decoder_only/budget_gap.py`)."""

from __future__ import annotations

import numpy as np
import pytest

from scalestudy.decoder_only import budget_gap

BUDGETS = (125, 250, 500, 1000)


def _curves(shape, seeds: int, noise: float, seed: int = 0) -> dict[tuple[int, int], float]:
    """(seed, budget) -> gap: `shape(budget)` plus independent normal noise per run pair."""
    rng = np.random.default_rng(seed)
    return {(s, b): shape(b) + noise * rng.standard_normal() for s in range(seeds) for b in BUDGETS}


def speed(b: float) -> float:
    """Pure optimisation-speed effect: the treatment needs 4x the steps for the same loss
    (losses 0.4 + 2 * steps ** -0.5), so the gap falls as a power of the budget towards 0."""
    return 2 * ((b / 4) ** -0.5 - b**-0.5)


def final(b: float) -> float:
    """Pure final-loss effect: the same gap at every budget."""
    return 0.3


def _call(gaps: dict) -> tuple[str, dict]:
    result = budget_gap.analyse({"x": gaps})["comparisons"]["x"]
    return result["call"], result


@pytest.mark.parametrize("seed", range(5))
def test_a_pure_speed_effect_and_a_pure_final_loss_effect_are_told_apart(seed):
    call, r = _call(_curves(speed, seeds=3, noise=0.003, seed=seed))
    assert call == "speed", r
    assert r["asymptote"]["low"] <= 0 <= r["asymptote"]["high"]
    assert r["trend"]["high"] < 0  # the gap shrinks with every doubling
    call, r = _call(_curves(final, seeds=3, noise=0.003, seed=seed))
    assert call == "final loss", r
    assert r["asymptote"]["low"] < 0.3 < r["asymptote"]["high"]


def test_a_gap_that_narrows_towards_a_nonzero_asymptote_is_both():
    call, r = _call(_curves(lambda b: 0.3 + speed(b), seeds=3, noise=0.002))
    assert call == "both", r
    assert r["asymptote"]["low"] > 0.2


@pytest.mark.parametrize("shape", [speed, final])
def test_noise_larger_than_the_effect_is_not_distinguishable(shape):
    """With seed spread far above the gap, neither a speed nor a final-loss call is made."""
    call, r = _call(_curves(shape, seeds=3, noise=0.5))
    assert call in ("not distinguishable", "no gap"), r


def test_no_gap_is_called_no_gap():
    call, _ = _call(_curves(lambda b: 0.0, seeds=4, noise=0.01))
    assert call == "no gap"


def test_one_seed_gives_no_interval_and_no_call():
    r_gaps = _curves(final, seeds=1, noise=0.0)
    call, r = _call(r_gaps)
    assert r["by_budget"][0]["low"] is None and r["asymptote"]["p"] is None
    assert call == "one seed"  # no between-run interval, so no call
    assert "no call: one seed" in budget_gap.render(budget_gap.analyse({"x": r_gaps}))


def test_holm_runs_over_every_comparison_and_budget():
    """Adding comparisons can only raise a test's adjusted p (one family for the report)."""
    gaps = _curves(final, seeds=3, noise=0.1, seed=3)
    alone = budget_gap.analyse({"a": gaps})["comparisons"]["a"]
    more = budget_gap.analyse({"a": gaps, "b": _curves(speed, seeds=3, noise=0.1, seed=4)})
    assert more["tests"] == 2 * (len(BUDGETS) + 2)  # per comparison: budgets, trend, asymptote
    for s_alone, s_more in zip(alone["by_budget"], more["comparisons"]["a"]["by_budget"]):
        assert s_more["p_holm"] >= s_alone["p_holm"]


def test_the_profiled_exponent_recovers_a_power_law():
    b = np.array(BUDGETS, dtype=float)
    assert budget_gap.profile_alpha(b, 0.1 + 3.0 * b**-0.7) == pytest.approx(0.7, abs=0.051)
    # a flat curve fits every exponent: the largest, which extrapolates least, is taken
    assert budget_gap.profile_alpha(b, np.full(4, 0.3)) == budget_gap.ALPHAS[-1]


def test_the_report_shows_each_call_with_its_n():
    results = budget_gap.analyse({"noncausal": _curves(final, seeds=3, noise=0.003)})
    text = budget_gap.render(results)
    assert "final-loss effect" in text and "(n = 3 seeds)" in text
    assert text.count("| 125 |") == 1


def test_a_lasting_gap_is_not_extrapolated_along_a_power_law_its_noise_suggests():
    """A constant gap measured with seed noise shows no sign of closing, so its asymptote is
    the gap where training left it, not an extrapolation of the noise (which called it not
    distinguishable)."""
    for seed in range(5):
        call, r = _call(_curves(final, seeds=3, noise=0.03, seed=seed))
        assert call == "final loss", r
        assert r["model"] == "last"


def test_gaps_equal_across_seeds_are_exact_not_significant_by_rounding():
    exact = {(s, b): speed(b) for s in range(3) for b in BUDGETS}
    call, r = _call(exact)
    assert call == "speed", r
    assert r["asymptote"]["p"] == 1.0


def _transition(b: float) -> float:
    """A reference loss curve with its transition near 400 steps (0.4 at the end)."""
    return 0.4 + 2.0 / (1.0 + (b / 400.0) ** 2)


@pytest.mark.parametrize("slower", [4, 8, 16])
def test_a_slower_learner_whose_gap_still_widens_is_no_final_loss(slower):
    """The treatment needs 4x, 8x or 16x the steps for the same loss and the same asymptote:
    at these budgets its gap grows (the measured NoPE pattern), which is no final-loss
    evidence; without a proved bound there is no call, with one the call is the bound."""
    gaps = _curves(lambda b: _transition(b / slower) - _transition(b), seeds=3, noise=0.005)
    call, r = _call(gaps)
    assert r["by_budget"][-1]["mean"] > r["by_budget"][0]["mean"]  # widening
    assert call == "widening", r
    bounded = budget_gap.analyse({"x": gaps}, floors={"x": 0.1})["comparisons"]["x"]
    assert bounded["call"] == "floor" and bounded["floor"] == 0.1
    assert "at least the proved floor" in budget_gap.render(
        budget_gap.analyse({"x": gaps}, floors={"x": 0.1})
    )
