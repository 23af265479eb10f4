"""The NumPy batch iterator (every source but seqio): packed, exactly resumable batches.

The stream: each split's documents are tokenised once and cut into pieces (objectives.py says
how long per objective). Epoch e visits the pieces in a permutation seeded by (seed, split, e);
example k of the stream is the objective applied to piece k with randomness from (seed, k).
A global batch is packed greedily from consecutive examples: each example goes to the first
row with room for it (both encoder and decoder rows for the encoder-decoder), and the batch
closes at the first example that fits nowhere, which then opens the next batch. The iterator
state is therefore one integer, the index of the next example, plus a fingerprint of the
config; restoring it continues with exactly the batch the uninterrupted iterator gives next,
in O(1): nothing consumed is recomputed.
The plan of a batch needs only example sizes, so each process materialises only its own rows,
and the global batch does not depend on the number of processes or on the mesh.

Feature conversion (Wang et al. 2022): decoder-only rows hold [inputs; targets] with loss on
the targets (on everything for flm); bmlm rows hold the corrupted piece in place of the
original, loss on the selected positions, the whole segment bidirectional
(`batches.write_in_place`); the non-causal decoder marks the prefix in
`decoder_causal_attention` as seqio's PrefixLMFeatureConverter does (the input positions
including the one holding the last input token). The encoder-decoder sends inputs to the
encoder and targets to the decoder, of `objectives.feature_lengths` positions (inputs
left-truncated, targets cut at the right, where an example does not fit).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from scalestudy.config.experiment import ExperimentConfig
from scalestudy.data import DataError, sources, vocab
from scalestudy.data.batches import (
    Batch,
    check_iterator_args,
    empty_features,
    stream_fingerprint,
    write_decoder,
    write_encoder,
    write_in_place,
)
from scalestudy.data.objectives import EOS_ID, Objective, feature_lengths, piece_spans

_SPLIT_SALT = {"train": 11, "validation": 23}
_STATE_VERSION = 1


@dataclass(frozen=True)
class _Pieces:
    tokens: np.ndarray  # int32, all documents back to back
    starts: np.ndarray  # int64 offset of each piece in `tokens`
    lengths: np.ndarray  # int64


@functools.lru_cache(maxsize=8)
def _vocabulary(data_json: str):
    from scalestudy.config.experiment import DataConfig

    return vocab.get_vocabulary(DataConfig.model_validate_json(data_json))


@functools.lru_cache(maxsize=16)
def _encoded(data_json: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    from scalestudy.config.experiment import DataConfig

    data_cfg = DataConfig.model_validate_json(data_json)
    docs = sources.documents(data_cfg, split)
    return vocab.encode_documents(_vocabulary(data_json), docs)


@functools.lru_cache(maxsize=16)
def _pieces(
    data_json: str, split: str, piece_length: int, min_piece: int, append_eos: bool, group: int
) -> _Pieces:
    ids, offsets = _encoded(data_json, split)
    if append_eos:
        ids = np.insert(ids, offsets[1:], EOS_ID)
        offsets = offsets + np.arange(offsets.size)
    starts, lengths = piece_spans(offsets, piece_length, min_piece, group)
    if not starts.size:
        raise DataError(
            f"the {split} split has no piece of >= {min_piece} tokens; the documents are empty "
            "or too short for the objective"
        )
    return _Pieces(ids.astype(np.int32), starts, lengths)


class NumpyBatchIterator:
    """This process's rows of each global batch, forever; `state()`/`restore()` resume exactly."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        split: str = "train",
        *,
        process_index: int = 0,
        process_count: int = 1,
    ) -> None:
        check_iterator_args(cfg, split, process_index, process_count)
        B = cfg.train.batch_size
        self.cfg = cfg
        self.split = split
        data_json = cfg.data.model_dump_json()
        self.vocabulary = _vocabulary(data_json)
        vocab.check_fits(self.vocabulary, cfg.model.vocab_size)
        self._objective = Objective(
            cfg.objective,
            vocab_size=self.vocabulary.vocab_size,
            extra_ids=cfg.data.extra_ids,
            seed=cfg.data.seed * 2 + (split == "validation"),
        )
        self._pieces = _pieces(
            data_json,
            split,
            self._objective.piece_length,
            self._objective.min_piece,
            self._objective.append_eos,
            self._objective.group,
        )
        self._encdec = cfg.model.is_encoder_decoder
        self._prefix = cfg.model.arch == "noncausal_decoder"
        obj = cfg.objective
        self._enc_len, self._dec_len = feature_lengths(obj, self._encdec)
        self._rows = slice(
            process_index * B // process_count, (process_index + 1) * B // process_count
        )
        self._perm_epoch = -1
        self._perm = np.zeros(0, dtype=np.int64)
        self._cursor = 0
        self._step = 0
        # Grain's files may be rewritten between a run and its resume under the same paths:
        # its state restores only into the same corpus (piece count, tokens), not just config.
        corpus = (
            (self.n_pieces, int(self._pieces.tokens.size)) if cfg.data.source == "grain" else ()
        )
        self._fingerprint = stream_fingerprint(cfg, split, *corpus)
        # Corpus tokens of the pieces behind this process's rows of the last batch.
        self.last_document_tokens = 0

    # ------------------------------------------------------------------ state

    def state(self) -> dict:
        """JSON-able position of the stream: the next example index and a config fingerprint."""
        return {
            "version": _STATE_VERSION,
            "split": self.split,
            "cursor": self._cursor,
            "step": self._step,
            "fingerprint": self._fingerprint,
        }

    def restore(self, state: dict) -> None:
        """Continue from `state` (from `state()`, possibly of another process count)."""
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise DataError(f"not a data iterator state (version {_STATE_VERSION}): {state!r}")
        if state.get("fingerprint") != self._fingerprint:
            raise DataError(
                "data iterator state was saved for a different data/objective/arch/batch config "
                f"(fingerprint {state.get('fingerprint')} != {self._fingerprint}); resume with "
                "the run's own config.yaml (and, for data.source=grain, the same files)"
            )
        self._cursor = int(state["cursor"])
        self._step = int(state["step"])

    @property
    def n_pieces(self) -> int:
        """Examples per epoch of this split."""
        return int(self._pieces.lengths.size)

    # ------------------------------------------------------------------ batches

    def __iter__(self) -> NumpyBatchIterator:
        return self

    def close(self) -> None:
        """Nothing runs in the background here."""

    def __next__(self) -> Batch:
        plan, self._cursor = self._plan(self._cursor)
        self._step += 1
        mine = plan[self._rows]
        self.last_document_tokens = int(
            sum(self._pieces.lengths[p] for row in mine for _, p in row)
        )
        return self._materialise(mine)

    def _piece(self, k: int) -> int:
        epoch, j = divmod(k, self.n_pieces)
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.cfg.data.seed, _SPLIT_SALT[self.split], epoch])
            self._perm = rng.permutation(self.n_pieces)
            self._perm_epoch = epoch
        return int(self._perm[j])

    def _sizes(self, k: int, n: int) -> tuple[int, int]:
        """(encoder, decoder) positions example k takes after the architecture's conversion."""
        a, b = self._objective.sizes(n, k)
        if self._encdec:
            return min(a, self._enc_len), min(b, self._dec_len)
        return 0, a + b

    def _plan(self, cursor: int) -> tuple[list[list[tuple[int, int]]], int]:
        """Rows of (example index, piece id) of the batch starting at `cursor`; next cursor."""
        B = self.cfg.train.batch_size
        free_enc = [self._enc_len] * B
        free_dec = [self._dec_len] * B
        rows: list[list[tuple[int, int]]] = [[] for _ in range(B)]
        lengths = self._pieces.lengths
        pack = self.cfg.objective.pack
        first_open = 0  # rows before it are full: no example fits there any more
        k = cursor
        while True:
            p = self._piece(k)
            e, d = self._sizes(k, int(lengths[p]))
            if pack:
                while first_open < B and free_dec[first_open] == 0:
                    first_open += 1
                r = first_open
                while r < B and (free_dec[r] < d or free_enc[r] < e):
                    r += 1
            else:
                r = k - cursor
            if r == B:
                break
            rows[r].append((k, p))
            free_enc[r] -= e
            free_dec[r] -= d
            k += 1
        return rows, k

    def _materialise(self, rows: list[list[tuple[int, int]]]) -> Batch:
        n_rows, L, S = len(rows), self._dec_len, self._enc_len
        f = empty_features(n_rows, L, S if self._encdec else 0)
        tokens, starts, lengths = self._pieces.tokens, self._pieces.starts, self._pieces.lengths
        draws = self._objective.draws([k for row in rows for k, _ in row])
        i = 0
        for r, row in enumerate(rows):
            pe = pd = 0
            for seg, (k, p) in enumerate(row, start=1):
                piece = tokens[starts[p] : starts[p] + lengths[p]]
                u = None if draws is None else draws[i]
                i += 1
                if self._objective.in_place:
                    write_in_place(f, r, pd, *self._objective.masked_example(piece, k, u), seg)
                    pd += piece.size
                    continue
                inputs, targets = self._objective.example(piece, k, u)
                if self._encdec:
                    inputs, targets = inputs[max(inputs.size - S, 0) :], targets[:L]
                    write_encoder(f, r, pe, inputs, seg)
                    write_decoder(f, r, pd, inputs[:0], targets, seg, prefix=False)
                    pe += inputs.size
                    pd += targets.size
                else:
                    write_decoder(f, r, pd, inputs, targets, seg, prefix=self._prefix)
                    pd += inputs.size + targets.size
        return f
