"""The batch contract: what every batch iterator gives training, and how rows are laid out.

One Protocol (`BatchIterator`) for every source of training batches: the NumPy pipeline
(`numpy_pipeline.py`, sources synthetic/text/tfds) and the seqio streaming pipeline
(`seqio_pipeline.py`, `data.source: seqio`). `pipeline.make_iterator` picks one; training only
speaks this contract:

- `next(it)`: this process's rows of the next global batch, a dict of int32 NumPy arrays with
  the feature names below ([rows, L] decoder features, [rows, S] encoder features);
- `it.state()`: a JSON-able dict, this process's position in the stream; every process saves
  its own (`train/rundir/checkpoint.py` writes one file per process);
- `it.restore(state)`: continue exactly where `state` was taken, without replaying the
  consumed stream; a state that does not fit (other config, other process layout where that
  matters) is a `DataError` naming why;
- `it.close()`: stop background work (a no-op for the NumPy path).

The row writers and the argument checks shared by the iterators and `pipeline.scoring_batch`
live here too, so that neither iterator imports the other and `pipeline.py` imports both.
"""

from __future__ import annotations

import hashlib
import json
from typing import Protocol, runtime_checkable

import numpy as np

from scalestudy.config.experiment import ExperimentConfig, check_cell
from scalestudy.data import DataError
from scalestudy.data.sources import SPLITS

Batch = dict[str, np.ndarray]

DECODER_FEATURES = (
    "decoder_input_tokens",
    "decoder_target_tokens",
    "decoder_loss_weights",
    "decoder_segment_ids",
    "decoder_positions",
    "decoder_causal_attention",
)
ENCODER_FEATURES = ("encoder_input_tokens", "encoder_segment_ids", "encoder_positions")


@runtime_checkable
class BatchIterator(Protocol):
    """This process's rows of each global batch, forever, resumable from `state()`."""

    split: str

    def __iter__(self) -> BatchIterator: ...

    def __next__(self) -> Batch: ...

    def state(self) -> dict:
        """JSON-able position of this process's stream."""
        ...

    def restore(self, state: dict) -> None:
        """Continue from `state` (this process's, from `state()`), without replaying."""
        ...

    def close(self) -> None:
        """Stop any background work; the iterator gives no more batches."""
        ...


def empty_features(rows: int, decoder_length: int, encoder_length: int) -> Batch:
    """Zeroed int32 arrays of every batch feature (encoder ones when `encoder_length` > 0)."""
    f = {name: np.zeros((rows, decoder_length), np.int32) for name in DECODER_FEATURES}
    if encoder_length:
        f.update({name: np.zeros((rows, encoder_length), np.int32) for name in ENCODER_FEATURES})
    return f


_ARANGE = np.arange(1 << 16, dtype=np.int32)


def write_encoder(f: Batch, r: int, p: int, inputs: np.ndarray, seg: int) -> None:
    """Place one example's inputs at encoder row r, offset p, as segment `seg`."""
    m = inputs.size
    f["encoder_input_tokens"][r, p : p + m] = inputs
    f["encoder_segment_ids"][r, p : p + m] = seg
    f["encoder_positions"][r, p : p + m] = _ARANGE[:m]


def write_decoder(
    f: Batch, r: int, p: int, inputs: np.ndarray, targets: np.ndarray, seg: int, *, prefix: bool
) -> None:
    """Place [inputs; targets] at decoder row r, offset p: loss on targets, shifted inputs."""
    a, m = inputs.size, inputs.size + targets.size
    tgt = f["decoder_target_tokens"][r]
    tgt[p : p + a] = inputs
    tgt[p + a : p + m] = targets
    # Teacher forcing: each position reads the previous token of its own segment (0 first).
    f["decoder_input_tokens"][r, p + 1 : p + m] = tgt[p : p + m - 1]
    f["decoder_loss_weights"][r, p + a : p + m] = 1
    f["decoder_segment_ids"][r, p : p + m] = seg
    f["decoder_positions"][r, p : p + m] = _ARANGE[:m]
    if prefix and a:
        f["decoder_causal_attention"][r, p : p + a + 1] = 1


def write_in_place(
    f: Batch,
    r: int,
    p: int,
    corrupted: np.ndarray,
    original: np.ndarray,
    selected: np.ndarray,
    seg: int,
) -> None:
    """Place an in-place example (bmlm) at decoder row r, offset p: the corrupted tokens are
    read at the positions of the originals they stand for (no shift), the loss falls on the
    `selected` positions, and the whole segment is bidirectional."""
    m = original.size
    f["decoder_input_tokens"][r, p : p + m] = corrupted
    f["decoder_target_tokens"][r, p : p + m] = original
    f["decoder_loss_weights"][r, p : p + m] = selected
    f["decoder_segment_ids"][r, p : p + m] = seg
    f["decoder_positions"][r, p : p + m] = _ARANGE[:m]
    f["decoder_causal_attention"][r, p : p + m] = 1


def check_iterator_args(
    cfg: ExperimentConfig, split: str, process_index: int, process_count: int
) -> None:
    """Validate what every batch iterator is given: the cell, the split, the process shard."""
    check_cell(cfg.model.arch, cfg.objective.name)
    if split not in SPLITS:
        raise DataError(f"split {split!r} is not known; accepted: {', '.join(SPLITS)}")
    if process_count < 1 or not 0 <= process_index < process_count:
        raise DataError(
            f"process_index={process_index} must lie in [0, process_count={process_count})"
        )
    if cfg.train.batch_size % process_count:
        raise DataError(
            f"train.batch_size={cfg.train.batch_size} must be divisible by the number of "
            f"processes ({process_count}): each process reads an equal share of rows"
        )


def stream_fingerprint(cfg: ExperimentConfig, split: str, *extra: object) -> str:
    """Id of what decides a batch stream (split, data, objective, arch, batch size, `extra`):
    a saved iterator state only restores into an iterator with the same fingerprint."""
    key = [
        split,
        cfg.data.model_dump(mode="json"),
        cfg.objective.model_dump(mode="json"),
        cfg.model.arch,
        cfg.train.batch_size,
        *extra,
    ]
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
