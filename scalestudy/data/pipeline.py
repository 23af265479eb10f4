"""The data room's front door: batch iterators for training, unpacked rows for scoring.

`make_iterator(cfg, split, process_index, process_count)` returns a `batches.BatchIterator`
(the one contract training speaks): the NumPy pipeline (`numpy_pipeline.py`) for the
synthetic/order/text/grain/tfds sources, or the seqio streaming pipeline
(`seqio_pipeline.py`) for `data.source: seqio`. Neither iterator imports this module, and
this module imports the seqio one only when it is asked for, so the default path never
builds tf.data graphs. Feature conversion (which positions each architecture sees) is
described in `numpy_pipeline.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scalestudy.config.experiment import ExperimentConfig
from scalestudy.data import DataError
from scalestudy.data.batches import (
    DECODER_FEATURES,
    ENCODER_FEATURES,
    BatchIterator,
    empty_features,
    write_decoder,
    write_encoder,
)
from scalestudy.data.numpy_pipeline import NumpyBatchIterator
from scalestudy.data.objectives import (
    EOS_ID,
    feature_lengths,
    mlm_piece_length,
    scores_zero_shot,
)
from scalestudy.data.vocab import Vocabulary, encode_pair

__all__ = [
    "DECODER_FEATURES",
    "ENCODER_FEATURES",
    "BatchIterator",
    "ScoringRows",
    "document_tokens_per_row",
    "empty_features",
    "encode_scoring_pair",
    "make_iterator",
    "prompted_lengths",
    "scoring_batch",
    "size_scoring_rows",
    "write_decoder",
]


def make_iterator(
    cfg: ExperimentConfig, split: str = "train", *, process_index: int = 0, process_count: int = 1
) -> BatchIterator:
    """This process's share (rows) of the global batches of `split` for the run `cfg`."""
    if cfg.data.source == "seqio":
        # seqio Tasks/Mixtures (data/seqio_pipeline.py); imported only here, so the default
        # NumPy path neither builds tf.data graphs nor registers Tasks.
        from scalestudy.data import require_seqio

        require_seqio("data.source='seqio'")
        from scalestudy.data.seqio_pipeline import SeqioBatchIterator

        return SeqioBatchIterator(
            cfg, split, process_index=process_index, process_count=process_count
        )
    return NumpyBatchIterator(cfg, split, process_index=process_index, process_count=process_count)


def document_tokens_per_row(cfg: ExperimentConfig) -> float:
    """Document tokens one full training row of `cfg` consumes: one piece of the objective's
    piece length (the decoder length; for span corruption the raw span that fills the inputs),
    two for the uniform-split prefix-LM encoder-decoder, whose encoder and decoder rows of L
    positions each hold a mirrored pair of examples (`objectives.feature_lengths`)."""
    obj = cfg.objective
    if obj.name == "mlm":
        piece = mlm_piece_length(obj.inputs_length, obj.noise_density, obj.mean_noise_span_length)
    else:
        piece = obj.decoder_length
    encoder, decoder = feature_lengths(obj, cfg.model.is_encoder_decoder)
    pieces = 2 if encoder == decoder == obj.decoder_length else 1
    return float(piece * pieces)


# ----------------------------------------------------------------------------- scoring

# Scoring row lengths are rounded up to a multiple of this, so tasks of similar lengths share
# a shape (and a compiled program).
SCORING_ROUND = 8


def prompted_lengths(cfg: ExperimentConfig) -> tuple[int, int, bool]:
    """(input tokens, target tokens, whether they share one row) a prompted example is cut to:
    a decoder-only row holds inputs_length + targets_length positions for prompt and target
    together; the encoder-decoder's encoder reads inputs_length, its decoder targets_length."""
    obj = cfg.objective
    if cfg.model.is_encoder_decoder:
        return obj.inputs_length, obj.targets_length, False
    return obj.decoder_length, obj.targets_length, True


def _round_up(n: int) -> int:
    return max(SCORING_ROUND, -(-n // SCORING_ROUND) * SCORING_ROUND)


@dataclass(frozen=True)
class ScoringRows:
    """Scoring rows sized for a set of (context, continuation) pairs."""

    kept: np.ndarray  # per pair: context tokens kept (cut from the left)
    lengths: tuple[int, int]  # (inputs_length, targets_length) scoring_batch lays rows out by
    positions: int  # positions of the longest stack of such a row
    # The largest context budget that fits eval.max_length beside the longest continuation
    # (below 1: not even an empty context fits).
    context_room: int


def size_scoring_rows(
    cfg: ExperimentConfig, n_ctx: np.ndarray, n_tgt: np.ndarray, n_suffix: int
) -> ScoringRows:
    """Size scoring rows for pairs of `n_ctx` context and `n_tgt` continuation tokens (each
    context followed by `n_suffix` input-form tokens) under `cfg.eval`'s context rule, so
    that no continuation is cut (the rules: evaluate/budget.py).

    Decoder-only rows hold context and continuation in one stack; the encoder-decoder's
    encoder holds the context and its decoder the continuation.
    """
    ev, obj = cfg.eval, cfg.objective
    encdec = cfg.model.is_encoder_decoder
    longest_tgt = int(n_tgt.max(initial=0))
    if ev.context_rule == "same":
        limit = n_ctx.max(initial=0) if ev.inputs_length is None else ev.inputs_length
        budget = np.full_like(n_ctx, limit)
        room_tgt = max(longest_tgt, ev.targets_length or 0)
    else:  # wang2022
        i_len = ev.inputs_length or obj.inputs_length
        t_len = ev.targets_length or obj.targets_length
        if encdec:
            budget = np.full_like(n_ctx, max(i_len - n_suffix, 0))
            room_tgt = max(longest_tgt, t_len)
        else:  # each context keeps L minus its own continuation, whatever the others are
            budget = np.maximum(i_len + t_len - n_tgt - n_suffix, 0)
            room_tgt = longest_tgt
    kept = np.minimum(n_ctx, budget)
    if ev.context_rule == "wang2022" and not encdec:  # one shared row: context + continuation
        need = int((kept + n_tgt).max(initial=0)) + n_suffix
        lengths = (max(need - room_tgt, 1), room_tgt)
    else:
        lengths = (max(int(kept.max(initial=0)) + n_suffix, 1), room_tgt)
    lengths = (_round_up(lengths[0]), _round_up(lengths[1]))
    return ScoringRows(
        kept=kept,
        lengths=lengths,
        positions=max(lengths) if encdec else sum(lengths),
        context_room=ev.max_length - n_suffix - (0 if encdec else _round_up(longest_tgt)),
    )


def encode_scoring_pair(
    cfg: ExperimentConfig, vocab: Vocabulary, context: str, continuation: str
) -> tuple[list[int], list[int]]:
    """A scored pair's (context, continuation) tokens, as lm-evaluation-harness tokenises
    them: a decoder-only row reads context and continuation as one text, so the pair is
    encoded as one and split at the context's tokens; the encoder-decoder reads them apart."""
    return encode_pair(vocab, context, continuation, joint=not cfg.model.is_encoder_decoder)


def scoring_batch(
    cfg: ExperimentConfig,
    inputs: list[list[int]],
    targets: list[list[int]],
    unscored: int = 0,
) -> tuple[dict[str, np.ndarray], int]:
    """One unpacked row per (inputs, targets) pair for scoring; (batch, rows truncated).

    Loss weights are 1 exactly on the target tokens past the first `unscored` (a form prefix
    such as span corruption's sentinel: read, not scored). Inputs are cut from the left to fit
    (decoder-only rows hold L = inputs_length + targets_length positions; the encoder
    inputs_length); targets longer than the decoder are cut at the right (counted too). An
    encoder-decoder row with no inputs gets a lone EOS so that the encoder sees one token.
    """
    if len(inputs) != len(targets):
        raise DataError(
            f"scoring_batch: {len(inputs)} inputs but {len(targets)} targets; give one each"
        )
    refusal = scores_zero_shot(cfg.objective)
    if refusal:
        raise DataError(refusal)
    return _pair_rows(cfg, inputs, targets, unscored)


def _pair_rows(
    cfg: ExperimentConfig, inputs: list[list[int]], targets: list[list[int]], unscored: int = 0
) -> tuple[dict[str, np.ndarray], int]:
    """`scoring_batch`'s rows, for any objective: inputs where the architecture reads its
    inputs, targets where it predicts; (batch, rows truncated)."""
    encdec = cfg.model.is_encoder_decoder
    obj = cfg.objective
    S = obj.inputs_length if encdec else 0
    L = obj.targets_length if encdec else obj.decoder_length
    n = len(inputs)
    f = empty_features(n, L, S)
    truncated = 0
    for r, (inp, tgt) in enumerate(zip(inputs, targets)):
        if not len(tgt):
            raise DataError(f"scoring_batch: row {r} has no target tokens to score")
        inp_a = np.asarray(inp, np.int32)
        tgt_a = np.asarray(tgt, np.int32)[:L]
        room = S if encdec else L - tgt_a.size
        cut_inp = inp_a[max(inp_a.size - room, 0) :] if room > 0 else inp_a[:0]
        truncated += int(cut_inp.size < inp_a.size or tgt_a.size < len(tgt))
        if encdec:
            if cut_inp.size == 0:
                cut_inp = np.array([EOS_ID], np.int32)
            write_encoder(f, r, 0, cut_inp, 1)
            cut_inp = cut_inp[:0]  # the decoder row holds the targets only
            write_decoder(f, r, 0, cut_inp, tgt_a, 1, prefix=False)
        else:
            write_decoder(f, r, 0, cut_inp, tgt_a, 1, prefix=cfg.model.arch == "noncausal_decoder")
        f["decoder_loss_weights"][r, cut_inp.size : cut_inp.size + unscored] = 0
    return f, truncated


# ----------------------------------------------------------------------------- reading text


def reading_length(cfg: ExperimentConfig) -> int:
    """Text tokens one row of `reading_batch` holds at most: a decoder-only row's positions;
    the encoder-decoder's encoder and decoder positions together."""
    obj = cfg.objective
    if cfg.model.is_encoder_decoder:
        return obj.inputs_length + obj.targets_length
    return obj.decoder_length


def reading_batch(cfg: ExperimentConfig, rows: list[np.ndarray]) -> dict[str, np.ndarray]:
    """One unpacked row per text (2 to `reading_length(cfg)` ids, each > 0), read as the
    architecture reads text: its first part as inputs, the rest as targets. A decoder-only row
    holds both (inputs: the first half, a bidirectional prefix for the non-causal decoder); the
    encoder-decoder's encoder reads the inputs (at most inputs_length, at least half the text)
    and its decoder the targets. `<stack>_input_tokens` holds the id each position reads, 0
    where it reads none (the decoder's first position, padding): laying out another array of
    ids > 0 of the same lengths (labels) puts each label where its token is read."""
    obj, encdec = cfg.objective, cfg.model.is_encoder_decoder
    inputs, targets = [], []
    for r, row in enumerate(rows):
        text = np.asarray(row, np.int32)
        n = text.size
        if not 2 <= n <= reading_length(cfg) or (text <= 0).any():
            raise DataError(
                f"reading_batch: row {r} holds {n} ids (min {text.min(initial=0)}); give 2 to "
                f"{reading_length(cfg)} ids, each > 0"
            )
        a = min(obj.inputs_length, max(n - obj.targets_length, n // 2)) if encdec else n // 2
        inputs.append(text[:a])
        targets.append(text[a:])
    return _pair_rows(cfg, inputs, targets)[0]  # every part fits: nothing is cut
