"""Objectives: span-corruption statistics and layout, PLM splits, chunk lengths."""

from math import comb

import numpy as np
import pytest

from scalestudy.config import ObjectiveConfig
from scalestudy.data import DataError
from scalestudy.data.objectives import (
    EOS_ID,
    Objective,
    mlm_piece_length,
    noise_mask,
    span_corrupt,
    span_counts,
    uniforms,
)

V = 359  # ByteVocabulary(extra_ids=100)


def test_uniforms_are_pure_and_prefix_stable():
    a = uniforms(7, 12, 100)
    assert np.array_equal(a[:10], uniforms(7, 12, 10))
    assert not np.array_equal(a, uniforms(7, 13, 100))
    assert not np.array_equal(a, uniforms(8, 12, 100))
    assert a.min() >= 0.0 and a.max() < 1.0
    big = uniforms(0, 0, 200_000)
    assert abs(big.mean() - 0.5) < 0.005 and abs(np.mean(big < 0.1) - 0.1) < 0.005


def test_t5_lengths():
    # T5 / Wang et al.: 568 raw tokens -> 512 inputs and 114 targets (EOS included).
    assert mlm_piece_length(512, 0.15, 3.0) == 568
    noise, spans = span_counts(568, 0.15, 3.0)
    assert (568 - noise + spans + 1, noise + spans + 1) == (512, 114)


def test_span_corruption_by_hand():
    piece = np.arange(10, 20, dtype=np.int32)
    mask = np.array([0, 0, 1, 1, 0, 0, 0, 1, 0, 0], bool)
    inputs, targets = span_corrupt(piece, mask, V)
    assert inputs.tolist() == [10, 11, V - 1, 14, 15, 16, V - 2, 18, 19, EOS_ID]
    assert targets.tolist() == [V - 1, 12, 13, V - 2, 17, EOS_ID]


def _reassemble(inputs, targets):
    """Put noise spans back in place of their sentinels (the inverse of span corruption)."""
    spans, cur = {}, None
    for t in targets[:-1]:
        if t >= V - 100:
            cur = int(t)
            spans[cur] = []
        else:
            spans[cur].append(int(t))
    out = []
    for t in inputs[:-1]:
        out.extend(spans[int(t)] if t >= V - 100 else [int(t)])
    return out, list(spans)


def test_span_corruption_statistics():
    """Exact noise density and span count per example; T5's span-length distribution."""
    n, density, mean_span = 100, 0.15, 3.0
    num_noise, num_spans = span_counts(n, density, mean_span)
    assert (num_noise, num_spans) == (15, 5)
    lengths, first_noise = [], 0
    piece = np.arange(3, 3 + n, dtype=np.int32)
    for k in range(3000):
        mask = noise_mask(n, density, mean_span, uniforms(1, k, n - 2))
        assert mask.sum() == num_noise
        starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
        assert starts.size == num_spans
        first_noise += mask[0]
        ends = np.flatnonzero(mask & ~np.concatenate([mask[1:], [False]]))
        lengths.extend((ends - starts + 1).tolist())
        if k < 200:
            inputs, targets = span_corrupt(piece, mask, V)
            restored, sentinels = _reassemble(inputs, targets)
            assert restored == piece.tolist()
            assert sentinels == [V - 1 - i for i in range(num_spans)]  # counting down
    assert first_noise == 0  # T5 layout: the first span is never noise
    # One part of a uniform random composition of m into k parts has length j with
    # probability C(m-j-1, k-2) / C(m-1, k-1).
    m, k = num_noise, num_spans
    expected = np.array([comb(m - j - 1, k - 2) / comb(m - 1, k - 1) for j in range(1, m)])
    observed = np.bincount(lengths, minlength=m)[1:m] / len(lengths)
    assert np.abs(observed - expected).max() < 0.02
    assert abs(np.mean(lengths) - mean_span) < 0.05


def test_plm_splits_uniform_and_fit():
    obj = Objective(ObjectiveConfig(name="plm", inputs_length=48, targets_length=16), V, 100, 0)
    splits = np.array([obj.sizes(64, k)[0] for k in range(6000)])
    assert splits.min() == 1 and splits.max() == 63
    counts = np.bincount(splits, minlength=64)[1:]
    assert counts.min() > 0.6 * counts.mean()  # roughly flat over 1..63
    fit = Objective(
        ObjectiveConfig(name="plm", inputs_length=48, targets_length=16, plm_split="fit"), V, 100, 0
    )
    assert {fit.sizes(64, k) for k in range(100)} == {(48, 16)}
    short = {fit.sizes(30, k)[0] for k in range(500)}
    assert short == set(range(14, 30))  # max(1, 30-16) .. min(29, 48)
    piece = np.arange(5, 69, dtype=np.int32)
    for k in range(20):
        inputs, targets = obj.example(piece, k)
        assert np.array_equal(np.concatenate([inputs, targets]), piece)
        assert (inputs.size, targets.size) == obj.sizes(64, k)


def test_mlm_errors_name_the_fix():
    with pytest.raises(DataError, match="targets_length >= 12"):
        Objective(ObjectiveConfig(name="mlm", inputs_length=48, targets_length=8), V, 100, 0)
    with pytest.raises(DataError, match="extra_ids >= "):
        Objective(ObjectiveConfig(name="mlm", inputs_length=48, targets_length=16), V, 1, 0)
    with pytest.raises(DataError, match="too short for span corruption"):
        Objective(ObjectiveConfig(name="mlm", inputs_length=2, targets_length=16), V, 100, 0)


def test_scalar_uniform_matches_vector():
    for seed, index in [(0, 0), (3, 17), (2**40, 2**50)]:
        from scalestudy.data.objectives import uniform

        assert uniform(seed, index) == uniforms(seed, index, 1)[0]
