"""The encoder-decoder prefix LM is scored in the form it was trained on (smoke settings).

With 128-byte pieces at lr 5e-3 the smoke study's encoder-decoder PLM probes sat near chance
while its decoder-only cells learnt them; docs/results-smoke.md shows why (the cross-attention
path was not yet used at the smoke budget). This pins the part that is not the cause: a
training example of that cell, scored as a (context, continuation) pair by the scorer's own
path, is laid out exactly as training laid it out (no end marker on either side, decoder
starting from id 0 at position 0, loss on every continuation token).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from scalestudy.data.pipeline import make_iterator, scoring_batch
from scalestudy.evaluate.budget import fit_pairs, scoring_lengths
from scalestudy.evaluate.scorer import scoring_config
from scalestudy.study.run.main_job import expand, load_study

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "studies" / "smoke.yaml"


def _smoke_encdec_plm():
    run = next(
        r for r in expand(load_study(SMOKE)) if (r.arch, r.objective) == ("encoder_decoder", "plm")
    )
    data = run.cfg.data
    small = data.synthetic.replace(n_train_documents=200, n_validation_documents=20)
    return run.cfg.replace(data=data.replace(synthetic=small))


def test_encdec_plm_training_examples_score_in_their_training_form():
    cfg = _smoke_encdec_plm()
    batch = next(make_iterator(cfg))
    # Rows sized to each pair (eval lengths unset), so that whole training examples fit.
    scoring = scoring_config(cfg.replace(eval=cfg.eval.replace(inputs_length=None)))
    checked = 0
    for r in range(batch["decoder_target_tokens"].shape[0]):
        for seg in range(1, int(batch["decoder_segment_ids"][r].max()) + 1):
            eidx = np.flatnonzero(batch["encoder_segment_ids"][r] == seg)
            didx = np.flatnonzero(batch["decoder_segment_ids"][r] == seg)
            context = batch["encoder_input_tokens"][r, eidx].tolist()
            continuation = batch["decoder_target_tokens"][r, didx].tolist()
            fitted = fit_pairs(scoring, [context], [continuation])
            assert not fitted.cut.any()
            rows, n_cut = scoring_batch(
                scoring_lengths(scoring, fitted.lengths), fitted.inputs, fitted.targets
            )
            assert n_cut == 0
            n, m = len(context), len(continuation)
            # Encoder: the context alone, positions from 0, nothing appended.
            assert rows["encoder_input_tokens"][0, :n].tolist() == context
            assert not rows["encoder_input_tokens"][0, n:].any()
            assert rows["encoder_positions"][0, :n].tolist() == list(range(n))
            assert (rows["encoder_segment_ids"][0, :n] == 1).all()
            # Decoder: what training fed it, position by position, loss on every token.
            for name in ("decoder_input_tokens", "decoder_target_tokens", "decoder_positions"):
                assert rows[name][0, :m].tolist() == batch[name][r, didx].tolist(), name
            assert rows["decoder_input_tokens"][0, 0] == 0
            assert rows["decoder_loss_weights"][0, :m].all()
            assert batch["decoder_loss_weights"][r, didx].all()
            assert not rows["decoder_loss_weights"][0, m:].any()
            checked += 1
    assert checked >= batch["decoder_target_tokens"].shape[0]  # a row holds one or two
