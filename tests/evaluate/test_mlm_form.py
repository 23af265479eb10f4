"""Span corruption scored as trained: every MLM training target starts with <extra_id_0>, so
every scored continuation does too (read, not scored); other objectives are unchanged."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from scalestudy.data import pipeline
from scalestudy.data.objectives import EOS_ID, Objective
from scalestudy.data.vocab import get_vocabulary, sentinel_id
from scalestudy.evaluate import rank
from scalestudy.evaluate.budget import fit_pairs
from scalestudy.models.api import build_model

from .tiny_models import reference_logprob, tiny

PAIRS = [
    ("The cat sat on", " a mat."),
    ("Once upon a ti", " me, a "),
    ("A b c d e f g ", "h i j k"),
]


def _encoded(cfg):
    vocab = get_vocabulary(cfg.data)
    return [vocab.encode(c) for c, _ in PAIRS], [vocab.encode(t) for _, t in PAIRS], vocab


def test_every_mlm_training_target_starts_with_the_first_sentinel():
    cfg = tiny("encoder_decoder", "mlm")
    vocab = get_vocabulary(cfg.data)
    obj = Objective(cfg.objective, vocab.vocab_size, cfg.data.extra_ids, seed=0)
    rng = np.random.default_rng(0)
    for k in range(50):
        piece = rng.integers(3, 250, size=int(rng.integers(2, obj.piece_length + 1)))
        _, targets = obj.example(piece, k)
        assert targets[0] == sentinel_id(vocab, 0)


@pytest.mark.parametrize("arch", ["causal_decoder", "noncausal_decoder", "encoder_decoder"])
def test_mlm_scores_the_continuation_after_the_sentinel(arch):
    cfg = tiny(arch, "mlm")
    inputs, targets, vocab = _encoded(cfg)
    fitted = fit_pairs(cfg, inputs, targets)
    sentinel = sentinel_id(vocab, 0)
    assert all(t == [sentinel, *raw] for t, raw in zip(fitted.targets, targets, strict=True))
    batch, _ = pipeline.scoring_batch(cfg, fitted.inputs, fitted.targets, fitted.unscored)
    first = np.argmax(batch["decoder_target_tokens"] == sentinel, axis=1)
    rows = np.arange(len(PAIRS))
    assert (batch["decoder_loss_weights"][rows, first] == 0).all()  # read, not scored
    np.testing.assert_array_equal(batch["decoder_loss_weights"].sum(1), [len(t) for t in targets])

    model = build_model(cfg.model)
    params = model.init(jax.random.key(2))
    lp, n_tok, _, _ = rank.Scorer(cfg, model, params)(inputs, targets, rows)
    np.testing.assert_array_equal(n_tok, [len(t) for t in targets])
    contexts = [[*x, EOS_ID] for x in inputs]  # span corruption's inputs end in EOS
    with_sentinel = reference_logprob(cfg, model, params, contexts, fitted.targets)
    sentinel_only = reference_logprob(cfg, model, params, contexts, [[sentinel]] * len(PAIRS))
    np.testing.assert_allclose(lp, with_sentinel - sentinel_only, rtol=1e-4, atol=1e-4)
    # Without the sentinel before it the same continuation scores otherwise.
    without = reference_logprob(cfg, model, params, contexts, targets)
    assert np.all(np.abs(without - lp) > 1e-4)


@pytest.mark.parametrize("objective", ["flm", "plm"])
def test_other_objectives_score_the_continuation_alone(objective):
    cfg = tiny("encoder_decoder" if objective == "plm" else "causal_decoder", objective)
    inputs, targets, _ = _encoded(cfg)
    fitted = fit_pairs(cfg, inputs, targets)
    assert fitted.targets == targets and fitted.inputs == inputs and fitted.unscored == 0
