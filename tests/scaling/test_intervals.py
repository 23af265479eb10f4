"""Intervals between runs: paired seeds, examples x seeds (coverage on simulated data), Holm."""

import math

import numpy as np
import pytest
from scipy import stats

from scalestudy.scaling.intervals import (
    accuracy_difference,
    accuracy_interval,
    detectable,
    holm,
    paired_difference,
    run_difference,
    seeds_to_resolve,
    simultaneous,
    two_way_bootstrap,
)


def _simulate(rng, seeds, examples, sd_seed=0.4, sd_example=1.5):
    """0/1 answers of `seeds` runs on the same `examples`: logit = difficulty + run effect."""
    logit = rng.normal(0.5, sd_example, examples)[None, :] + rng.normal(0, sd_seed, seeds)[:, None]
    return (rng.random((seeds, examples)) < 1 / (1 + np.exp(-logit))).astype(float)


def test_two_way_bootstrap_covers_and_an_examples_only_interval_does_not():
    rng = np.random.default_rng(0)
    sample = rng.normal(0.5, 1.5, 200_000)[:, None] + rng.normal(0, 0.4, 100)[None, :]
    truth = float((1 / (1 + np.exp(-sample))).mean())  # a new run on new examples
    sims, both, examples_only = 300, 0, 0
    for i in range(sims):
        x = _simulate(rng, seeds=3, examples=200)
        iv = two_way_bootstrap(x, n_boot=300, seed=i)
        both += iv.low <= truth <= iv.high
        pooled = two_way_bootstrap(x.mean(axis=0, keepdims=True), n_boot=300, seed=i)
        examples_only += pooled.low <= truth <= pooled.high
    assert 0.90 <= both / sims <= 0.97
    assert examples_only / sims < 0.85  # seed variance ignored: too narrow


def test_accuracy_interval_counts_seed_spread_and_says_when_it_is_not_between_runs():
    one = accuracy_interval([0.6], examples=100)
    half = 1.959964 * math.sqrt(0.6 * 0.4 / 100)
    assert not one.between_runs and one.seeds == 1
    assert (one.low, one.high) == pytest.approx((0.6 - half, 0.6 + half))
    tight = accuracy_interval([0.6, 0.6, 0.6], examples=100)
    spread = accuracy_interval([0.5, 0.6, 0.7], examples=100)
    assert tight.between_runs and spread.high - spread.low > tight.high - tight.low
    expected = stats.t.ppf(0.975, 2) * math.sqrt(0.6 * 0.4 / 100 + 0.01 / 3)
    assert spread.high - 0.6 == pytest.approx(expected)


def test_paired_difference_is_a_t_interval_on_per_seed_differences():
    a = {0: 0.70, 1: 0.50, 2: 0.61, 3: 0.90}
    b = {0: 0.60, 1: 0.41, 2: 0.50, 4: 0.10}
    iv, unpaired = paired_difference(a, b)
    d = np.array([0.10, 0.09, 0.11])
    half = stats.t.ppf(0.975, 2) * d.std(ddof=1) / math.sqrt(3)
    assert unpaired == [3, 4] and iv.seeds == 3
    assert (iv.mean, iv.low, iv.high) == pytest.approx((0.1, 0.1 - half, 0.1 + half))
    assert iv.p_value < 0.01  # large run effects, constant difference: paired sees it
    with pytest.raises(ValueError, match="no seed is shared"):
        paired_difference({0: 1.0}, {1: 1.0})


def test_one_shared_seed_gives_an_examples_only_difference():
    iv, _ = accuracy_difference({0: 0.7}, {0: 0.6}, examples=200)
    assert not iv.between_runs and "1 seed x 200 examples" in iv.describe()


def test_holm_matches_the_step_down_by_hand():
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])
    assert holm([0.6, 0.9]) == pytest.approx([1.0, 1.0])  # 2 x 0.6 capped at 1


def test_an_accuracy_verdicts_degrees_of_freedom_never_exceed_the_runs():
    # +0.05 on every seed but seed 2: three runs a side give 2 degrees of freedom, whatever
    # the examples behind each run (each run's accuracy already holds their noise).
    a, b = {0: 0.65, 1: 0.45, 2: 0.77}, {0: 0.60, 1: 0.40, 2: 0.70}
    for examples in (100, 800, 100_000):
        iv, _ = accuracy_difference(a, b, examples=examples)
        assert iv.df == 2 and iv.seeds == 3 and iv.examples == examples
        d = np.array([0.05, 0.05, 0.07])
        half = stats.t.ppf(0.975, 2) * d.std(ddof=1) / math.sqrt(3)
        assert (iv.low, iv.high) == pytest.approx((d.mean() - half, d.mean() + half))
        assert iv.p_value == pytest.approx(stats.ttest_1samp(d, 0).pvalue)


def test_cells_without_shared_seeds_get_welch_on_run_means():
    a, b = {0: 0.61, 1: 0.65, 2: 0.60}, {7: 0.50, 8: 0.58, 9: 0.55, 10: 0.52, 11: 0.49}
    iv, unpaired = run_difference(a, b)
    want = stats.ttest_ind(list(a.values()), list(b.values()), equal_var=False)
    assert iv.method == "welch" and unpaired == [] and iv.df <= 3 + 5 - 2
    assert iv.p_value == pytest.approx(want.pvalue)
    assert "unpaired (Welch)" in iv.describe()


def test_a_simultaneous_interval_excluding_zero_is_always_a_holm_rejection():
    rng = np.random.default_rng(1)
    for _ in range(200):
        ivs = [
            run_difference(dict(enumerate(rng.normal(mu, 0.02, 3))), dict.fromkeys(range(3), 0))[0]
            for mu in rng.choice([0.0, 0.02, 0.05], size=6)
        ]
        adjusted = holm([iv.p_value for iv in ivs])
        for iv, p in zip(ivs, adjusted, strict=True):
            wide = simultaneous(iv, len(ivs))
            assert wide.level == pytest.approx(1 - 0.05 / 6)
            assert wide.high - wide.low >= iv.high - iv.low
            if wide.low > 0 or wide.high < 0:
                assert p < 0.05


def test_the_detectable_difference_has_the_power_it_claims():
    # Simulated paired t tests at the detectable difference reject 80% of the time, and the
    # seeds it takes to resolve a margin is the first count that reaches 80%.
    rng = np.random.default_rng(2)
    sd, n, alpha = 0.02, 3, 0.05 / 4
    delta = detectable(sd, n, alpha)
    d = rng.normal(delta, sd, (20_000, n))
    t = d.mean(axis=1) / (d.std(axis=1, ddof=1) / math.sqrt(n))
    assert abs(np.mean(np.abs(t) > stats.t.ppf(1 - alpha / 2, n - 1)) - 0.8) < 0.015
    need = seeds_to_resolve(0.02, sd, alpha)
    assert detectable(sd, need, alpha) <= 0.02 < detectable(sd, need - 1, alpha)
    assert seeds_to_resolve(1e-6, sd, alpha) is None  # more than 1000 runs
