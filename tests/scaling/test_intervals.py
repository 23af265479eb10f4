"""Intervals between runs: paired seeds, examples x seeds (coverage on simulated data), Holm."""

import math

import numpy as np
import pytest
from scipy import stats

from scalestudy.scaling.intervals import (
    accuracy_difference,
    accuracy_interval,
    holm,
    paired_difference,
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


def test_an_accuracy_difference_counts_the_examples_variance_too():
    a, b = {0: 0.65, 1: 0.45, 2: 0.75}, {0: 0.60, 1: 0.40, 2: 0.70}  # +0.05 on every seed
    few, _ = accuracy_difference(a, b, examples=100)
    many, _ = accuracy_difference(a, b, examples=100_000)
    assert few.low < 0 < few.high  # 100 examples cannot tell 0.05 apart
    assert many.low > 0 and few.examples == 100 and few.seeds == 3
    v = sum(a[s] * (1 - a[s]) + b[s] * (1 - b[s]) for s in a) / 3 / 100
    assert few.high - few.mean >= 1.959964 * math.sqrt(v)  # at least the examples' share
