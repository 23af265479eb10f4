"""BERT-style masking (Devlin et al. 2019) of one piece, given its uniforms: the corruption of
the `bmlm` objective (`objectives.Objective.masked_example` draws the uniforms)."""

from __future__ import annotations

import numpy as np

MASK_FRACTION, RANDOM_FRACTION = 0.8, 0.1  # of the selected positions; the rest are kept
FIRST_ORDINARY_ID = 3  # 0 padding, 1 EOS, 2 unknown: never drawn as a random replacement


def bert_mask(
    piece: np.ndarray, noise_density: float, vocab_size: int, extra_ids: int, u: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(corrupted piece, selected positions as a bool mask) of BERT-style masking.

    Exactly max(1, round(n * noise_density)) positions are selected (those with the smallest
    of the first n uniforms); each selected position becomes the mask id vocab_size - 1 with
    probability 0.8, a random ordinary token (ids 3 .. vocab_size - extra_ids - 1, not
    padding, EOS, unknown or a sentinel) with probability 0.1, and stays itself otherwise.
    `u` holds at least 3n uniforms in [0, 1).
    """
    n = piece.size
    count = min(max(round(n * noise_density), 1), n)
    selected = np.zeros(n, bool)
    selected[np.argpartition(u[:n], count - 1)[:count]] = True
    kind, pick = u[n : 2 * n], u[2 * n : 3 * n]
    n_ordinary = vocab_size - extra_ids - FIRST_ORDINARY_ID
    random_ids = FIRST_ORDINARY_ID + np.minimum(
        (pick * n_ordinary).astype(np.int64), n_ordinary - 1
    )
    corrupted = piece.astype(np.int32, copy=True)
    masked = selected & (kind < MASK_FRACTION)
    replaced = selected & (kind >= MASK_FRACTION) & (kind < MASK_FRACTION + RANDOM_FRACTION)
    corrupted[masked] = vocab_size - 1
    corrupted[replaced] = random_ids[replaced]
    return corrupted, selected
