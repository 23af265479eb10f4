"""The data room's front door: batch iterators for training, unpacked rows for scoring.

`make_iterator(cfg, split, process_index, process_count)` returns a `batches.BatchIterator`
(the one contract training speaks): the NumPy pipeline (`numpy_pipeline.py`) for the
synthetic/text/tfds sources, or the seqio streaming pipeline (`seqio_pipeline.py`) for
`data.source: seqio`. Neither iterator imports this module, and this module imports the seqio
one only when it is asked for, so the default path never builds tf.data graphs. Feature
conversion (which positions each architecture sees) is described in `numpy_pipeline.py`.
"""

from __future__ import annotations

import numpy as np

from scalestudy.config import ExperimentConfig
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
from scalestudy.data.objectives import EOS_ID, scores_zero_shot

__all__ = [
    "DECODER_FEATURES",
    "ENCODER_FEATURES",
    "BatchIterator",
    "empty_features",
    "make_iterator",
    "scoring_batch",
    "write_decoder",
]


def make_iterator(
    cfg: ExperimentConfig, split: str = "train", *, process_index: int = 0, process_count: int = 1
) -> BatchIterator:
    """This process's share (rows) of the global batches of `split` for the run `cfg`."""
    if cfg.data.source == "seqio":
        # seqio Tasks/Mixtures (data/seqio_pipeline.py); imported only here, so the default
        # NumPy path neither builds tf.data graphs nor registers Tasks.
        from scalestudy.data.seqio_pipeline import SeqioBatchIterator

        return SeqioBatchIterator(
            cfg, split, process_index=process_index, process_count=process_count
        )
    return NumpyBatchIterator(cfg, split, process_index=process_index, process_count=process_count)


# ----------------------------------------------------------------------------- scoring


def scoring_batch(
    cfg: ExperimentConfig, inputs: list[list[int]], targets: list[list[int]]
) -> tuple[dict[str, np.ndarray], int]:
    """One unpacked row per (inputs, targets) pair for scoring; (batch, rows truncated).

    Loss weights are 1 exactly on the target tokens. Inputs are cut from the left to fit
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
            write_decoder(f, r, 0, cut_inp[:0], tgt_a, 1, prefix=False)
        else:
            write_decoder(f, r, 0, cut_inp, tgt_a, 1, prefix=cfg.model.arch == "noncausal_decoder")
    return f, truncated
