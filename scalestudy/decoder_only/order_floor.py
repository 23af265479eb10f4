"""The loss floor of the order task (`data/order_task.py`): what a predictor that knows the
task exactly scores on the validation batches a run is evaluated on.

Given the tokens before it, the ideal probability of a document's next token is: a letter
before the bar, uniform over the alphabet, unless the string may end here (lengths are uniform
in `LENGTHS`, so after j letters the bar comes with probability 1 / (number of lengths >= j));
after the bar every token (the reversed letters, then EOS) is certain. A run's validation loss
minus this floor is what it has yet to learn; a model that cannot read order in its prefix
stays well above it.
"""

from __future__ import annotations

import math

import numpy as np

from scalestudy.config import ExperimentConfig
from scalestudy.data import order_task
from scalestudy.data.pipeline import make_iterator
from scalestudy.data.vocab import encode_documents, get_vocabulary


def token_loss(j: int, letters: int) -> float:
    """The ideal loss (nats) of token `j` of a document with `letters` letters before its bar."""
    lo, hi = order_task.LENGTHS
    if j > letters:
        return 0.0
    bar = 1.0 / (hi - j + 1) if lo <= j <= hi else 0.0  # P(the string ends after j letters)
    if j == letters:
        return -math.log(bar)
    return -math.log((1.0 - bar) / len(order_task.LETTERS))


def batch_floor(batch: dict[str, np.ndarray], bar_id: int) -> tuple[float, int]:
    """(summed ideal loss, loss-bearing tokens) over a decoder-only batch of order documents."""
    targets, weights = batch["decoder_target_tokens"], batch["decoder_loss_weights"]
    segments = batch["decoder_segment_ids"]
    total, count = 0.0, 0
    for row in range(targets.shape[0]):
        for segment in set(segments[row].tolist()) - {0}:
            at = np.flatnonzero(segments[row] == segment)
            tokens = targets[row, at]
            letters = int(np.flatnonzero(tokens == bar_id)[0])
            for j in np.flatnonzero(weights[row, at]):
                total += token_loss(int(j), letters)
                count += 1
    return total, count


def validation_floor(cfg: ExperimentConfig) -> float:
    """The ideal loss per loss-bearing token on the `train.eval_batches` validation batches
    of the decoder-only run `cfg` (`data.source: order`)."""
    bar_id = int(encode_documents(get_vocabulary(cfg.data), ["|"])[0][0])
    iterator = make_iterator(cfg, "validation")
    total, count = 0.0, 0
    for _ in range(cfg.train.eval_batches):
        t, c = batch_floor(next(iterator), bar_id)
        total, count = total + t, count + c
    return total / count
