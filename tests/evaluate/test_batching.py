"""Bucketed scoring: every pair scored once, in a row that holds it whole, with the scores of
the one-shape layout, for every architecture."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from scalestudy.config.experiment import ExperimentConfig
from scalestudy.evaluate.batching import bucket_length, plan_calls
from scalestudy.evaluate.budget import fit_pairs
from scalestudy.evaluate.scorer import Scorer
from scalestudy.models.api import build_model

from .tiny_models import tiny as tiny_model

ARCH_OBJECTIVE = {"causal_decoder": "flm", "noncausal_decoder": "plm", "encoder_decoder": "mlm"}


def tiny(arch: str) -> ExperimentConfig:
    return tiny_model(arch, ARCH_OBJECTIVE[arch], batch_size=4)


def pairs(seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Examples of 1-4 choices over contexts of 0-40 tokens (empty ones as BLiMP's) and
    continuations of 1-30, in no order of length."""
    rng = np.random.default_rng(seed)
    inputs, targets = [], []
    for _ in range(24):
        context = rng.integers(3, 250, int(rng.choice([0, 0, 3, 11, 40]))).tolist()
        for _ in range(int(rng.integers(1, 5))):
            inputs.append(context)
            targets.append(rng.integers(3, 250, int(rng.integers(1, 31))).tolist())
    return inputs, targets


def test_bucket_lengths_form_a_short_ladder_capped_by_the_full_row() -> None:
    ladder = sorted({bucket_length(n, 10_000) for n in range(1, 1025)})
    assert ladder == [8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
    for n in range(1, 300):
        b = bucket_length(n, 10_000)
        assert n <= b
        assert n <= 16 or 3 * (b - n) < b  # above 16 positions, under a third is padding
        assert bucket_length(n, 72) == min(b, 72)


@pytest.mark.parametrize("arch", list(ARCH_OBJECTIVE))
def test_plan_scores_every_pair_once_in_a_row_that_holds_it(arch: str) -> None:
    cfg = tiny(arch)
    inputs, targets = pairs()
    fitted = fit_pairs(cfg, inputs, targets)
    encdec = cfg.model.is_encoder_decoder
    calls = plan_calls(fitted, encdec=encdec, rows=4, min_calls=1)
    scored = np.concatenate([c.pairs for c in calls])
    assert sorted(scored.tolist()) == list(range(len(inputs)))
    full = sum(fitted.lengths)
    for c in calls:
        assert len(c.pairs) <= c.rows and c.rows % 4 == 0
        assert c.rows * sum(c.lengths) <= 4 * full  # no more positions than 4 full rows
        for i in c.pairs:
            n_in, n_tgt = len(fitted.inputs[i]), len(fitted.targets[i])
            if encdec:
                assert max(n_in, 1) <= c.lengths[0] and n_tgt <= c.lengths[1]
            else:
                assert n_in + n_tgt <= sum(c.lengths)
    # By default a length fills its own calls or rides in longer rows: no more compiled
    # shapes, and still every pair once.
    default = plan_calls(fitted, encdec=encdec, rows=4)
    assert sorted(np.concatenate([c.pairs for c in default]).tolist()) == list(range(len(inputs)))
    assert len({(c.lengths, c.rows) for c in default}) <= len({(c.lengths, c.rows) for c in calls})
    # Shorter rows than the full one, and few shapes to compile.
    assert min(sum(c.lengths) for c in calls) < full
    assert len({(c.lengths, c.rows) for c in calls}) <= 12
    if encdec:  # the choices of one context share a call (but where a call ends)
        runs = 1 + sum(inputs[i] != inputs[i - 1] for i in range(1, len(inputs)))
        encoded = sum(len({tuple(inputs[i]) for i in c.pairs}) for c in calls)
        assert encoded <= runs + len(calls) - 1


@pytest.mark.parametrize("arch", list(ARCH_OBJECTIVE))
def test_bucketed_scores_equal_the_one_shape_layout(arch: str) -> None:
    cfg = tiny(arch)
    model = build_model(cfg.model)
    params = model.init(jax.random.key(3))
    inputs, targets = pairs(1)
    owner = np.arange(len(inputs))
    bucketed = Scorer(cfg, model, params, min_calls=1)  # a shape for every length
    reference = Scorer(cfg, model, params, bucketed=False)
    lp, n_tok, correct, cut = bucketed(inputs, targets, owner)
    lp_ref, n_ref, correct_ref, cut_ref = reference(inputs, targets, owner)
    np.testing.assert_allclose(lp, lp_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(n_tok, [len(t) for t in targets])
    np.testing.assert_array_equal(n_tok, n_ref)
    np.testing.assert_array_equal(correct, correct_ref)
    assert cut == cut_ref == 0
    assert len(set(np.round(lp, 3))) > len(lp) // 2  # the pairs really differ
    assert bucketed.positions < reference.positions  # less padding computed


@pytest.mark.parametrize("arch", list(ARCH_OBJECTIVE))
def test_tasks_planned_together_share_shapes_and_score_as_apart(arch: str) -> None:
    """One evaluation's tasks in one plan: each pair scored once, in a row that holds it,
    with fewer compiled shapes than task by task, and the scores of the tasks apart."""
    cfg = tiny(arch)
    encdec = cfg.model.is_encoder_decoder
    parts = []
    for seed, keep in ((2, 6), (3, 40), (4, 18)):  # short, long and middling tasks
        inputs, targets = pairs(seed)
        parts.append(fit_pairs(cfg, [x[:keep] for x in inputs], [t[:keep] for t in targets]))
    sizes = [len(p.inputs) for p in parts]
    together = plan_calls(parts, encdec=encdec, rows=4, min_calls=4)
    assert sorted(np.concatenate([c.pairs for c in together]).tolist()) == list(range(sum(sizes)))
    flat = [(x, t) for p in parts for x, t in zip(p.inputs, p.targets, strict=True)]
    widest = max(sum(p.lengths) for p in parts)
    for c in together:
        assert c.rows * sum(c.lengths) <= 4 * widest
        for i in c.pairs:
            n_in, n_tgt = len(flat[i][0]), len(flat[i][1])
            if encdec:
                assert max(n_in, 1) <= c.lengths[0] and n_tgt <= c.lengths[1]
            else:
                assert n_in + n_tgt <= sum(c.lengths)
    apart = {
        (c.lengths, c.rows)
        for p in parts
        for c in plan_calls(p, encdec=encdec, rows=4, min_calls=4)
    }
    assert len({(c.lengths, c.rows) for c in together}) < len(apart)

    model = build_model(cfg.model)
    params = model.init(jax.random.key(5))
    scorer = Scorer(cfg, model, params, min_calls=4)
    # The one-shape layout scores each part at its own full lengths, every part whole.
    one_shape = Scorer(cfg, model, params, bucketed=False).score_parts(parts)
    together = scorer.score_parts(parts)
    for (lp, n_tok, correct), ref, part in zip(together, one_shape, parts, strict=True):
        for lp_ref, n_ref, correct_ref in (scorer.score(part), ref):
            np.testing.assert_allclose(lp, lp_ref, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(n_tok, n_ref)
            np.testing.assert_array_equal(correct, correct_ref)
        np.testing.assert_array_equal(n_tok, [len(t) - part.unscored for t in part.targets])
        assert len(set(np.round(lp, 3))) > len(lp) // 2
