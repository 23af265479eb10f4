"""Objectives: span-corruption statistics and layout, PLM splits, chunk lengths."""

from math import comb

import numpy as np
import pytest

from scalestudy.config.experiment import ObjectiveConfig
from scalestudy.data import DataError
from scalestudy.data.objectives import (
    EOS_ID,
    Objective,
    feature_lengths,
    mlm_piece_length,
    noise_mask,
    piece_spans,
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


# ----------------------------------------------------------------------------- T5 reference
# A small, independent NumPy re-implementation of T5's span-corruption preprocessing
# (t5.data.preprocessors: reduce_concat_tokens, split_tokens, random_spans_noise_mask,
# noise_span_to_unique_sentinel / nonnoise_span_to_unique_sentinel, then EOS), written
# from its published algorithm, with NumPy's RNG in place of TF's stateless shuffles.


def _t5_reduce_concat_split(docs, batch_size, max_tokens):
    """reduce_concat_tokens (join `batch_size` documents) then split_tokens."""
    out = []
    for g in range(0, len(docs), batch_size):
        tokens = np.concatenate(docs[g : g + batch_size])
        out += [tokens[i : i + max_tokens] for i in range(0, tokens.size, max_tokens)]
    return out


def _t5_random_segmentation(num_items, num_segments, rng):
    first_in_segment = np.concatenate(
        [[0], rng.permutation((np.arange(num_items - 1) < num_segments - 1).astype(int))]
    )
    segment_id = np.cumsum(first_in_segment)
    return np.bincount(segment_id)


def _t5_random_spans_noise_mask(length, noise_density, mean_noise_span_length, rng):
    orig_length, length = length, max(length, 2)
    num_noise_tokens = int(np.round(length * noise_density))
    num_noise_tokens = min(max(num_noise_tokens, 1), length - 1)
    num_noise_spans = max(int(np.round(num_noise_tokens / mean_noise_span_length)), 1)
    num_nonnoise_tokens = length - num_noise_tokens
    noise_lengths = _t5_random_segmentation(num_noise_tokens, num_noise_spans, rng)
    nonnoise_lengths = _t5_random_segmentation(num_nonnoise_tokens, num_noise_spans, rng)
    interleaved = np.stack([nonnoise_lengths, noise_lengths], axis=1).reshape(-1)
    span_starts = np.cumsum(interleaved)[:-1]
    indicator = np.zeros(length, int)
    np.add.at(indicator, span_starts, 1)
    return (np.cumsum(indicator) % 2 == 1)[:orig_length]


def _t5_sentinels(tokens, mask, vocab_size):
    """noise_span_to_unique_sentinel: each noise span -> one sentinel, counting down."""
    prev = np.concatenate([[False], mask[:-1]])
    first = mask & ~prev
    sentinel = vocab_size - np.cumsum(first)
    return np.where(first, sentinel, tokens)[~(mask & prev)]


def _t5_random_spans_helper(inputs_length, noise_density=0.15, mean_span=3.0):
    """(raw tokens per piece, targets length) for inputs of `inputs_length` (EOS included)."""

    def lengths(n):
        noise = round(n * noise_density)
        spans = round(noise / mean_span)
        return n - noise + spans + 1, noise + spans + 1

    n = inputs_length - 1
    while lengths(n + 1)[0] <= inputs_length:
        n += 1
    return n, lengths(n)[1]


def _t5_span_corruption(docs, inputs_length, vocab_size, rng):
    raw, _ = _t5_random_spans_helper(inputs_length)
    out = []
    for piece in _t5_reduce_concat_split(docs, 128, raw):
        mask = _t5_random_spans_noise_mask(piece.size, 0.15, 3.0, rng)
        inputs = np.append(_t5_sentinels(piece, mask, vocab_size), EOS_ID)
        targets = np.append(_t5_sentinels(piece, ~mask, vocab_size), EOS_ID)
        out.append((piece, mask, inputs, targets))
    return out


def _spans(mask):
    starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
    ends = np.flatnonzero(mask & ~np.concatenate([mask[1:], [False]]))
    return ends - starts + 1


def _docs(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, size=int(rng.integers(5, 400))).astype(np.int32) for _ in range(n)]


def _our_mlm_examples(docs, objective, first_index=0):
    offsets = np.concatenate([[0], np.cumsum([d.size for d in docs])])
    tokens = np.concatenate(docs)
    starts, lengths = piece_spans(
        offsets, objective.piece_length, objective.min_piece, objective.group
    )
    out = []
    for k, (s, n) in enumerate(zip(starts, lengths), start=first_index):
        piece = tokens[s : s + n]
        out.append((piece, *objective.example(piece, k)))
    return out


def test_span_corruption_over_concatenated_documents_matches_t5():
    """Pieces, lengths, noise density, spans and sentinels as T5's span_corruption."""
    docs = _docs(300)  # 2 groups of 128 and one of 44, about 60k tokens
    cfg = ObjectiveConfig(name="mlm", inputs_length=64, targets_length=20)
    assert cfg.pieces == "concatenated"  # the T5 setting is the default
    objective = Objective(cfg, V, 100, 0)
    ours = _our_mlm_examples(docs, objective)
    ref = _t5_span_corruption(docs, 64, V, np.random.default_rng(0))
    # The same raw pieces, cut across document boundaries within groups of 128 documents.
    assert len(ours) == len(ref)
    for (p, *_), (q, *_) in zip(ours, ref):
        assert np.array_equal(p, q)
    assert max(len(p) for p, *_ in ours) == objective.piece_length == _t5_random_spans_helper(64)[0]
    # Per example: input and target lengths, noise tokens and spans exactly as T5's.
    span_lengths_ours, span_lengths_ref = [], []
    for (piece, inputs, targets), (_, mask, ref_in, ref_tgt) in zip(ours, ref):
        assert (inputs.size, targets.size) == (ref_in.size, ref_tgt.size)
        assert inputs.size <= 64 and targets.size <= 20
        sentinels = targets[targets >= V - 100]
        ref_sentinels = ref_tgt[ref_tgt >= V - 100]
        assert sentinels.tolist() == ref_sentinels.tolist()  # V-1, V-2, ... in order
        assert inputs[inputs >= V - 100].tolist() == sentinels.tolist()
        assert targets.size - sentinels.size - 1 == mask.sum()  # noise tokens
        restored, _ = _reassemble(inputs, targets)
        assert restored == piece.tolist()
        # Our span lengths: the tokens between consecutive sentinels of the targets.
        at = np.append(np.flatnonzero(targets >= V - 100), targets.size - 1)
        span_lengths_ours += (np.diff(at) - 1).tolist()
        span_lengths_ref += _spans(mask).tolist()
    # The span lengths follow the same distribution (uniform random compositions).
    assert len(span_lengths_ours) == len(span_lengths_ref)
    assert abs(np.mean(span_lengths_ours) - np.mean(span_lengths_ref)) < 0.1
    assert sum(span_lengths_ours) == sum(mask.sum() for _, mask, *_ in ref)  # noise density
    assert abs(sum(span_lengths_ours) / sum(p.size for p, *_ in ours) - 0.15) < 0.01
    hist = lambda x: np.bincount(x, minlength=12)[:12] / len(x)
    assert np.abs(hist(span_lengths_ours) - hist(span_lengths_ref)).max() < 0.03


def test_per_document_pieces_stay_an_option():
    docs = _docs(40, seed=1)
    cfg = ObjectiveConfig(name="mlm", inputs_length=64, targets_length=20, pieces="per_document")
    objective = Objective(cfg, V, 100, 0)
    assert objective.group == 1
    offsets = np.concatenate([[0], np.cumsum([d.size for d in docs])])
    starts, lengths = piece_spans(offsets, objective.piece_length, 2, objective.group)
    doc_of = np.searchsorted(offsets, starts, side="right") - 1
    assert (starts + lengths <= offsets[doc_of + 1]).all()  # no piece crosses a document
    assert len(starts) == sum(-(-d.size // objective.piece_length) for d in docs)


def test_the_pipeline_cuts_concatenated_pieces_by_default():
    from scalestudy.config.experiment import ExperimentConfig
    from scalestudy.data.pipeline import make_iterator

    def pieces(**obj):
        cfg = ExperimentConfig(
            model={"arch": "encoder_decoder"},
            objective={"name": "mlm", "inputs_length": 48, "targets_length": 16, **obj},
            data={"synthetic": {"n_train_documents": 300, "n_validation_documents": 30}},
        )
        return make_iterator(cfg)._pieces

    concatenated, per_doc = pieces(), pieces(pieces="per_document")
    R = mlm_piece_length(48, 0.15, 3.0)
    full = concatenated.lengths == R
    assert full.mean() > 0.95 and concatenated.lengths.sum() >= per_doc.lengths.sum()
    assert (concatenated.lengths < R).sum() <= 3  # one short tail per 128 documents
    assert (per_doc.lengths < R).sum() > 0.9 * 300  # about one per document


# ----------------------------------------------------------------------------- prefix LM


def test_feature_lengths_give_every_architecture_the_whole_plm_piece():
    plm = ObjectiveConfig(name="plm", inputs_length=512, targets_length=114)
    assert feature_lengths(plm, encoder_decoder=False) == (0, 626)
    assert feature_lengths(plm, encoder_decoder=True) == (626, 626)  # T5 / Wang et al.
    fit = plm.replace(plm_split="fit")
    assert feature_lengths(fit, encoder_decoder=True) == (512, 114)
    mlm = plm.replace(name="mlm")
    assert feature_lengths(mlm, encoder_decoder=True) == (512, 114)


def test_plm_uniform_split_is_t5s_mirrored_pairs():
    """Splits uniform on 1..L-1; example 2j+1 is split at L - s of example 2j (T5 packs such a
    pair into one encoder-decoder row)."""
    cfg = ObjectiveConfig(name="plm", inputs_length=48, targets_length=16)
    obj = Objective(cfg, V, 100, 3)
    s = np.array([obj.sizes(64, k)[0] for k in range(8000)])
    assert (s[0::2] + s[1::2] == 64).all()
    assert s.min() == 1 and s.max() == 63
    counts = np.bincount(s[0::2], minlength=64)[1:]
    assert counts.min() > 0.5 * counts.mean()
    assert abs(s.mean() - 32) < 0.5
    # A short piece (the tail of a group) is split inside it.
    assert {obj.sizes(10, k)[0] for k in range(200)} <= set(range(1, 10))


@pytest.mark.parametrize("pieces", ["concatenated", "per_document"])
def test_plm_loss_tokens_per_example_equal_across_architectures(pieces):
    """Every PLM cell trains on the same examples and the same loss-bearing tokens; the
    encoder-decoder no longer cuts targets at targets_length."""
    from scalestudy.config.experiment import ExperimentConfig
    from scalestudy.data.pipeline import make_iterator

    per_cell = {}
    for arch in ("causal_decoder", "noncausal_decoder", "encoder_decoder"):
        cfg = ExperimentConfig(
            model={"arch": arch},
            objective={"name": "plm", "inputs_length": 24, "targets_length": 8, "pieces": pieces},
            data={"synthetic": {"n_train_documents": 200, "n_validation_documents": 20}},
            train={"batch_size": 8},
        )
        it = make_iterator(cfg)
        examples = loss = rows = 0
        while examples < 200:
            b = next(it)
            examples += int(b["decoder_segment_ids"].max(axis=1).sum())
            loss += int(b["decoder_loss_weights"].sum())
            rows += b["decoder_segment_ids"].shape[0]
        per_cell[arch] = (it.state()["cursor"], examples, loss, rows)
    # Over the same first examples, the same number of loss-bearing tokens.
    n = min(c[0] for c in per_cell.values())
    totals = {}
    for arch in per_cell:
        cfg = ExperimentConfig(
            model={"arch": arch},
            objective={"name": "plm", "inputs_length": 24, "targets_length": 8, "pieces": pieces},
            data={"synthetic": {"n_train_documents": 200, "n_validation_documents": 20}},
        )
        it = make_iterator(cfg)
        obj, p = it._objective, it._pieces
        totals[arch] = sum(obj.sizes(int(p.lengths[it._piece(k)]), k)[1] for k in range(n))
    assert len(set(totals.values())) == 1
    for _, examples, loss, _ in per_cell.values():
        assert loss / examples > 0.4 * 32  # about L / 2 = 16 for full pieces, not <= 8
    if pieces == "concatenated":
        _, examples, _, rows = per_cell["encoder_decoder"]
        assert examples / rows > 1.8  # mirrored pairs fill encoder-decoder rows


@pytest.mark.parametrize("inputs_length", [16, 64, 512, 1024])
def test_mlm_piece_length_is_t5s_random_spans_helper(inputs_length):
    raw, targets = _t5_random_spans_helper(inputs_length)
    assert mlm_piece_length(inputs_length, 0.15, 3.0) == raw
    noise, spans = span_counts(raw, 0.15, 3.0)
    assert noise + spans + 1 == targets


def test_seqio_encoder_decoder_plm_rows_hold_mirrored_pairs(seqio_encdec_plm_cfg):
    """The seqio path pairs PLM examples after its shuffle: rows of L + L hold two examples
    whose encoder parts and decoder parts each fill L positions, as in T5."""
    from scalestudy.data.pipeline import make_iterator

    cfg = seqio_encdec_plm_cfg
    it = make_iterator(cfg)
    b = next(it)
    it.close()
    assert b["encoder_input_tokens"].shape == b["decoder_target_tokens"].shape == (8, 32)
    full = 0
    for r in range(8):
        enc = np.bincount(b["encoder_segment_ids"][r], minlength=3)[1:]
        dec = np.bincount(b["decoder_segment_ids"][r], minlength=3)[1:]
        if enc.size == 2 and (enc + dec == 32).all():  # two full 32-token pieces
            full += 1
            assert enc.sum() == dec.sum() == 32 and enc[0] == dec[1]
    assert full >= 6
