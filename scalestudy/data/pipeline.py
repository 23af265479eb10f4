"""(architecture, objective) -> packed global batches with seqio feature names; resumable.

The stream: each split's documents are tokenised once and cut into pieces (objectives.py says
how long per objective). Epoch e visits the pieces in a permutation seeded by (seed, split, e);
example k of the stream is the objective applied to piece k with randomness from (seed, k).
A global batch is packed greedily from consecutive examples: each example goes to the first
row with room for it (both encoder and decoder rows for the encoder-decoder), and the batch
closes at the first example that fits nowhere, which then opens the next batch. The iterator
state is therefore one integer, the index of the next example, plus a fingerprint of the
config; restoring it continues with exactly the batch the uninterrupted iterator gives next.
The plan of a batch needs only example sizes, so each process materialises only its own rows,
and the global batch does not depend on the number of processes or on the mesh.

Feature conversion (Wang et al. 2022): decoder-only rows hold [inputs; targets] with loss on
the targets (on everything for flm); the non-causal decoder marks the prefix in
`decoder_causal_attention` as seqio's PrefixLMFeatureConverter does (the input positions
including the one holding the last input token). The encoder-decoder sends inputs to the
encoder and targets to the decoder, of `objectives.feature_lengths` positions (inputs
left-truncated, targets cut at the right, where an example does not fit).
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from scalestudy.config import ExperimentConfig, check_cell
from scalestudy.data import DataError, sources, vocab
from scalestudy.data.objectives import EOS_ID, Objective, feature_lengths, piece_spans

if TYPE_CHECKING:
    from scalestudy.data.seqio_pipeline import SeqioBatchIterator

_SPLIT_SALT = {"train": 11, "validation": 23}
_STATE_VERSION = 1


@dataclass(frozen=True)
class _Pieces:
    tokens: np.ndarray  # int32, all documents back to back
    starts: np.ndarray  # int64 offset of each piece in `tokens`
    lengths: np.ndarray  # int64


@functools.lru_cache(maxsize=8)
def _vocabulary(data_json: str):
    from scalestudy.config import DataConfig

    return vocab.get_vocabulary(DataConfig.model_validate_json(data_json))


@functools.lru_cache(maxsize=16)
def _encoded(data_json: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    from scalestudy.config import DataConfig

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


DECODER_FEATURES = (
    "decoder_input_tokens",
    "decoder_target_tokens",
    "decoder_loss_weights",
    "decoder_segment_ids",
    "decoder_positions",
    "decoder_causal_attention",
)
ENCODER_FEATURES = ("encoder_input_tokens", "encoder_segment_ids", "encoder_positions")


def empty_features(rows: int, decoder_length: int, encoder_length: int) -> dict[str, np.ndarray]:
    """Zeroed int32 arrays of every batch feature (encoder ones when `encoder_length` > 0)."""
    f = {name: np.zeros((rows, decoder_length), np.int32) for name in DECODER_FEATURES}
    if encoder_length:
        f.update({name: np.zeros((rows, encoder_length), np.int32) for name in ENCODER_FEATURES})
    return f


def check_iterator_args(
    cfg: ExperimentConfig, split: str, process_index: int, process_count: int
) -> None:
    """Validate what every batch iterator is given: the cell, the split, the process shard."""
    check_cell(cfg.model.arch, cfg.objective.name)
    if split not in _SPLIT_SALT:
        raise DataError(f"split {split!r} is not known; accepted: {', '.join(_SPLIT_SALT)}")
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


class BatchIterator:
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
        self._fingerprint = stream_fingerprint(cfg, split)

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
                "the run's own config.yaml"
            )
        self._cursor = int(state["cursor"])
        self._step = int(state["step"])

    @property
    def n_pieces(self) -> int:
        """Examples per epoch of this split."""
        return int(self._pieces.lengths.size)

    # ------------------------------------------------------------------ batches

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        plan, self._cursor = self._plan(self._cursor)
        self._step += 1
        return self._materialise(plan[self._rows])

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

    def _materialise(self, rows: list[list[tuple[int, int]]]) -> dict[str, np.ndarray]:
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


_ARANGE = np.arange(1 << 16, dtype=np.int32)


def write_encoder(f: dict, r: int, p: int, inputs: np.ndarray, seg: int) -> None:
    """Place one example's inputs at encoder row r, offset p, as segment `seg`."""
    m = inputs.size
    f["encoder_input_tokens"][r, p : p + m] = inputs
    f["encoder_segment_ids"][r, p : p + m] = seg
    f["encoder_positions"][r, p : p + m] = _ARANGE[:m]


def write_decoder(
    f: dict, r: int, p: int, inputs: np.ndarray, targets: np.ndarray, seg: int, *, prefix: bool
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


def make_iterator(
    cfg: ExperimentConfig, split: str = "train", *, process_index: int = 0, process_count: int = 1
) -> BatchIterator | SeqioBatchIterator:
    """This process's share (rows) of the global batches of `split` for the run `cfg`."""
    if cfg.data.source == "seqio":
        # seqio Tasks/Mixtures (data/seqio_pipeline.py); imported only here, so the default
        # NumPy path neither builds tf.data graphs nor registers Tasks.
        from scalestudy.data.seqio_pipeline import SeqioBatchIterator

        return SeqioBatchIterator(
            cfg, split, process_index=process_index, process_count=process_count
        )
    return BatchIterator(cfg, split, process_index=process_index, process_count=process_count)


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


# ----------------------------------------------------------------------------- benchmark


def bench(cfg: ExperimentConfig | None, steps: int) -> dict:
    """Batches/s, examples/s and tokens/s of every valid cell on the configured corpus.

    tokens = non-padding positions (decoder + encoder); loss_tokens = loss-bearing positions.
    Without a config: the synthetic corpus, batch 64 and the default lengths.
    """
    from scalestudy.config import VALID_CELLS

    if cfg is None:
        cfg = ExperimentConfig(train={"batch_size": 64})
    out: dict[str, float | int | str] = {
        "source": cfg.data.source,
        "batch_size": cfg.train.batch_size,
        "lengths": f"{cfg.objective.inputs_length}+{cfg.objective.targets_length}",
    }
    for arch, objectives in VALID_CELLS.items():
        for name in objectives:
            cell = cfg.replace(
                model={**cfg.model.model_dump(), "arch": arch},
                objective={**cfg.objective.model_dump(), "name": name},
            )
            it = make_iterator(cell)
            next(it)  # first batch builds the corpus caches; not timed
            examples = tokens = loss_tokens = 0
            t0 = time.perf_counter()
            for _ in range(steps):
                before = it.state()["cursor"]
                batch = next(it)
                examples += it.state()["cursor"] - before
                tokens += int((batch["decoder_segment_ids"] > 0).sum())
                if "encoder_segment_ids" in batch:
                    tokens += int((batch["encoder_segment_ids"] > 0).sum())
                loss_tokens += int(batch["decoder_loss_weights"].sum())
            dt = time.perf_counter() - t0
            key = f"{name}/{arch}"
            out[f"{key}/examples_per_s"] = round(examples / dt)
            out[f"{key}/tokens_per_s"] = round(tokens / dt)
            out[f"{key}/loss_tokens_per_s"] = round(loss_tokens / dt)
    return out
