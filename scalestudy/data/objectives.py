"""Pretraining objectives: raw token pieces -> (inputs, targets) examples.

An objective never knows the architecture: it turns a piece of text into an (inputs, targets)
pair, and `pipeline.py` converts pairs into each architecture's features.

Pieces (as T5's preprocessors cut them, `objective.pieces`): with `concatenated` (default),
every 128 consecutive documents are concatenated (T5's `reduce_concat_tokens`, batch 128) and
the concatenation is cut into consecutive pieces of the objective's length, the last of each
group shorter (`split_tokens`); with `per_document`, each document is cut on its own (T5's
`merge_examples_to_reduce_padding=False`). With I = inputs_length, T = targets_length and
L = I + T:
- flm: documents each followed by EOS, in pieces of L tokens; inputs are empty and the whole
  piece is the target (T5's `full_lm`).
- plm: the same pieces of L tokens (T5's `targets_for_prefix_lm_objective`), split at s.
  `plm_split='uniform'` is Wang et al.'s setting (T5's `pack_prefix_lm_decoder_only` and
  `pack_prefix_lm_encoder_decoder`): s uniform in 1..L-1, inputs = piece[:s], targets =
  piece[s:]; example 2j+1 is split at L - s of example 2j, as T5 pairs the two examples of an
  encoder-decoder row, so a pair fills one encoder row and one decoder row of L positions
  exactly. Every architecture sees every token of the piece: decoder-only rows have L
  positions, the encoder-decoder's encoder and decoder L each (`feature_lengths`).
  `plm_split='fit'` draws s only from max(1, n-T)..min(n-1, I), so (I, T) always fits.
- mlm: documents without EOS in pieces of R tokens, R the largest length whose corrupted inputs
  fit in I (T5's `random_spans_helper`: I=512 -> R=568 and targets 114); noise spans are
  replaced by sentinels (T5's `random_spans_noise_mask`); inputs and targets end with EOS.
- bmlm (BERT-style masked LM; the non-causal decoder only): the flm pieces of L tokens; a
  random `noise_density` of the positions is selected (exactly round(n * density), at least
  one), and of them 80% are replaced by the mask id (the first sentinel, vocab_size - 1), 10%
  by a random ordinary token and 10% kept (Devlin et al. 2019). The example is in place
  (`Objective.masked_example`): the corrupted piece is read at the same positions as the
  original it must predict, the whole row is bidirectional and the loss falls on the selected
  positions only.
Pieces shorter than the objective's minimum (1 token for flm and bmlm, 2 otherwise) are
dropped.

Randomness for example k is a pure function of (seed, k) (`uniforms`), so any example can be
rebuilt on its own: this is what makes the batch stream resumable and process-independent.
"""

from __future__ import annotations

import functools

import numpy as np

from scalestudy.config.experiment import ObjectiveConfig
from scalestudy.data import DataError
from scalestudy.data.bert_masking import FIRST_ORDINARY_ID, bert_mask

EOS_ID = 1  # seqio convention for both vocabularies (0 = padding)
CONCAT_DOCUMENTS = 128  # documents concatenated before cutting pieces (T5's reduce_concat_tokens)

# ----------------------------------------------------------------------------- randomness

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser: a bijective, well-mixing map on uint64."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


_M64 = (1 << 64) - 1


def _mix64_int(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def uniform(seed: int, index: int) -> float:
    """`uniforms(seed, index, 1)[0]` without NumPy overhead (one draw per example is common)."""
    key = _mix64_int((_mix64_int(seed & _M64) + (index & _M64)) & _M64)
    return (_mix64_int((key + 0x9E3779B97F4A7C15) & _M64) >> 11) * (1.0 / (1 << 53))


_STRIDES = _GOLDEN * np.arange(1, 1 << 16, dtype=np.uint64)  # wraps mod 2**64, as meant


def uniforms(seed: int, index: int, n: int) -> np.ndarray:
    """n floats in [0, 1), a pure function of (seed, index); a prefix of a longer draw."""
    return uniforms_many(seed, [index], n)[0]


def uniforms_many(seed: int, indices: list[int], n: int) -> np.ndarray:
    """`uniforms(seed, k, n)` for every k in `indices`, as one [len(indices), n] array."""
    s = _mix64_int(seed & _M64)
    keys = np.array([_mix64_int((s + (k & _M64)) & _M64) for k in indices], dtype=np.uint64)
    strides = _STRIDES[:n] if n < _STRIDES.size else _GOLDEN * np.arange(1, n + 1, dtype=np.uint64)
    z = _mix64(keys[:, None] + strides[None, :])
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


# ----------------------------------------------------------------------------- span corruption


def span_counts(n: int, noise_density: float, mean_span: float) -> tuple[int, int]:
    """(noise tokens, noise spans) for a piece of n tokens, as T5's random_spans_noise_mask."""
    num_noise = min(max(round(n * noise_density), 1), n - 1)
    num_spans = max(round(num_noise / mean_span), 1)
    # Every noise and non-noise span holds at least one token.
    num_spans = min(num_spans, num_noise, n - num_noise)
    return num_noise, num_spans


def span_lengths(n: int, noise_density: float, mean_span: float) -> tuple[int, int]:
    """(inputs, targets) lengths after corrupting n tokens, EOS included."""
    noise, spans = span_counts(n, noise_density, mean_span)
    return n - noise + spans + 1, noise + spans + 1


@functools.lru_cache(maxsize=64)
def mlm_piece_length(inputs_length: int, noise_density: float, mean_span: float) -> int:
    """The largest raw piece R whose corrupted inputs (of any piece <= R) fit inputs_length."""
    best = 0
    for n in range(2, 4 * inputs_length + 8):
        if span_lengths(n, noise_density, mean_span)[0] > inputs_length:
            break
        best = n
    if best == 0:
        raise DataError(
            f"objective.inputs_length={inputs_length} is too short for span corruption: even "
            "2 raw tokens need 3 input positions (token, sentinel, EOS); use inputs_length >= 3"
        )
    return best


def span_layout(
    n: int, noise_density: float, mean_span: float, u: np.ndarray
) -> tuple[list[int], list[int]]:
    """(non-noise run lengths, noise span lengths), alternating, starting with non-noise.

    Both are uniform random compositions (every split equally likely) of the non-noise and
    noise token counts into the same number of non-empty runs, as in T5; `u` holds at least
    n - 2 uniforms.
    """
    num_noise, num_spans = span_counts(n, noise_density, mean_span)
    split = max(num_noise - 1, 0)
    noise = _composition(num_noise, num_spans, u[:split])
    keep = _composition(n - num_noise, num_spans, u[split:])
    return keep, noise


def _composition(total: int, parts: int, u: np.ndarray) -> list[int]:
    """Lengths of a uniformly random split of `total` items into `parts` non-empty runs."""
    if parts == 1:
        return [total]
    cuts = np.sort(np.argpartition(u[: total - 1], parts - 2)[: parts - 1]) + 1
    ends = [*cuts.tolist(), total]
    return [e - b for b, e in zip([0, *ends[:-1]], ends)]


def noise_mask(n: int, noise_density: float, mean_span: float, u: np.ndarray) -> np.ndarray:
    """Boolean mask of the noise tokens of `span_layout`."""
    keep, noise = span_layout(n, noise_density, mean_span, u)
    flags = np.tile(np.array([False, True]), len(keep))
    return np.repeat(flags, np.stack([keep, noise], axis=1).reshape(-1))


def corrupt(
    piece: np.ndarray, keep: list[int], noise: list[int], vocab_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """T5 span corruption given the run layout; sentinel i is id vocab_size - 1 - i.

    inputs: the non-noise runs with each noise span replaced by its sentinel, then EOS;
    targets: each noise span preceded by the same sentinel, then EOS.
    """
    k, num_noise = len(noise), sum(noise)
    inputs = np.empty(piece.size - num_noise + k + 1, np.int32)
    targets = np.empty(num_noise + k + 1, np.int32)
    src = pi = pt = 0
    for i in range(k):
        kl, nl = keep[i], noise[i]
        inputs[pi : pi + kl] = piece[src : src + kl]
        inputs[pi + kl] = targets[pt] = vocab_size - 1 - i
        targets[pt + 1 : pt + 1 + nl] = piece[src + kl : src + kl + nl]
        src, pi, pt = src + kl + nl, pi + kl + 1, pt + nl + 1
    inputs[-1] = targets[-1] = EOS_ID
    return inputs, targets


def span_corrupt(
    piece: np.ndarray, mask: np.ndarray, vocab_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """T5 span corruption of `piece` given a noise mask that starts with non-noise."""
    if mask[0]:
        raise ValueError("the noise mask must start with a non-noise token (T5 layout)")
    edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    runs = np.diff(np.concatenate([[0], edges, [mask.size]])).tolist()
    if len(runs) % 2:
        runs.append(0)  # ends with non-noise: a trailing run with no noise after it
    keep, noise = runs[0::2], runs[1::2]
    if noise[-1] == 0:
        inputs, targets = corrupt(piece[: -keep[-1]], keep[:-1], noise[:-1], vocab_size)
        tail = piece[-keep[-1] :]
        return np.concatenate([inputs[:-1], tail, inputs[-1:]]), targets
    return corrupt(piece, keep, noise, vocab_size)


# ----------------------------------------------------------------------------- pieces


def piece_spans(
    offsets: np.ndarray, piece_length: int, min_piece: int, group: int
) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the pieces of a token stream whose documents start at
    `offsets[:-1]` (`offsets[-1]` is its end): every `group` consecutive documents are joined
    (1: each on its own) and cut into consecutive pieces of `piece_length` tokens, the last of
    each group shorter; pieces shorter than `min_piece` are dropped."""
    offsets = np.asarray(offsets, np.int64)
    bounds = offsets[::group]
    if bounds[-1] != offsets[-1]:
        bounds = np.append(bounds, offsets[-1])
    span = np.diff(bounds)
    n_chunks = -(-span // piece_length)
    part = np.repeat(np.arange(span.size), n_chunks)
    first = np.cumsum(n_chunks) - n_chunks
    k = np.arange(part.size) - np.repeat(first, n_chunks)
    starts = bounds[part] + k * piece_length
    lengths = np.minimum(piece_length, bounds[part + 1] - starts)
    keep = lengths >= min_piece
    return starts[keep], lengths[keep]


def scores_zero_shot(cfg: ObjectiveConfig) -> str | None:
    """None when a run trained on `cfg` can be scored by rank classification, else why not.

    Rank classification scores a continuation left to right after its context; a BERT-style
    masked LM never learned that (it predicts masked tokens in place), so it is judged on
    validation loss only.
    """
    if cfg.name == "bmlm":
        return (
            "objective.name='bmlm' (BERT-style masked LM) predicts masked tokens in place, not "
            "continuations left to right, so rank classification (eval.tasks) cannot score it; "
            "a bmlm run is evaluated on validation loss only"
        )
    return None


def scoring_inputs_suffix(cfg: ObjectiveConfig) -> tuple[int, ...]:
    """Tokens that ended every training input of this objective, appended to scored contexts
    so that evaluation reads inputs in the form training showed (mlm: EOS; flm/plm: none)."""
    return (EOS_ID,) if cfg.name == "mlm" else ()


def scoring_targets_prefix(cfg: ObjectiveConfig) -> tuple[int, ...]:
    """Sentinels (i of <extra_id_i>) that began every training target of this objective, put
    before each scored continuation, read but not scored, so that evaluation continues in the
    form training showed (mlm: <extra_id_0>; flm/plm: none)."""
    return (0,) if cfg.name == "mlm" else ()


def feature_lengths(cfg: ObjectiveConfig, encoder_decoder: bool) -> tuple[int, int]:
    """(encoder, decoder) positions of a row for the objective `cfg` (encoder 0: decoder-only).

    Decoder-only rows hold L = I + T. The encoder-decoder has I and T, except for prefix LM
    with the uniform split, where, as in Wang et al. (T5's `pack_prefix_lm_encoder_decoder`),
    encoder and decoder both have L positions, so that no input or target token is cut.
    """
    L = cfg.decoder_length
    if not encoder_decoder:
        return 0, L
    if cfg.name == "plm" and cfg.plm_split == "uniform":
        return L, L
    return cfg.inputs_length, cfg.targets_length


# ----------------------------------------------------------------------------- examples


class Objective:
    """One objective bound to its config: piece lengths, example sizes and examples."""

    def __init__(self, cfg: ObjectiveConfig, vocab_size: int, extra_ids: int, seed: int) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.seed = seed
        self.vocab_size = vocab_size
        self.extra_ids = extra_ids
        L = cfg.decoder_length
        if cfg.name == "mlm":
            self.piece_length = mlm_piece_length(
                cfg.inputs_length, cfg.noise_density, cfg.mean_noise_span_length
            )
            worst = [
                span_lengths(n, cfg.noise_density, cfg.mean_noise_span_length)
                for n in range(2, self.piece_length + 1)
            ]
            need_targets = max(t for _, t in worst)
            if need_targets > cfg.targets_length:
                raise DataError(
                    f"objective.targets_length={cfg.targets_length} is too short for span "
                    f"corruption with inputs_length={cfg.inputs_length}, noise_density="
                    f"{cfg.noise_density}, mean_noise_span_length={cfg.mean_noise_span_length}:"
                    f" targets need up to {need_targets} tokens; set targets_length >= "
                    f"{need_targets}"
                )
            max_spans = max(
                span_counts(n, cfg.noise_density, cfg.mean_noise_span_length)[1]
                for n in range(2, self.piece_length + 1)
            )
            if extra_ids < max_spans:
                raise DataError(
                    f"data.extra_ids={extra_ids} is too few sentinels for span corruption: "
                    f"pieces of {self.piece_length} tokens have up to {max_spans} noise spans; "
                    f"set data.extra_ids >= {max_spans} (T5 uses 100)"
                )
            self.min_piece = 2
        else:
            if cfg.name == "bmlm" and vocab_size - extra_ids <= FIRST_ORDINARY_ID:
                raise DataError(
                    f"objective.name='bmlm' needs ordinary tokens to draw random replacements "
                    f"from: vocab_size={vocab_size} with data.extra_ids={extra_ids} leaves none"
                )
            if cfg.name == "bmlm" and extra_ids < 1:
                raise DataError(
                    "objective.name='bmlm' needs a sentinel for its mask id: data.extra_ids "
                    f"must be >= 1 (got {extra_ids})"
                )
            self.piece_length = L
            self.min_piece = 1 if cfg.name in ("flm", "bmlm") else 2
        self.append_eos = cfg.name != "mlm"
        # Documents joined before cutting pieces (`piece_spans`).
        self.group = CONCAT_DOCUMENTS if cfg.pieces == "concatenated" else 1
        # In place (bmlm): inputs and targets share positions (`masked_example`).
        self.in_place = cfg.name == "bmlm"

    def sizes(self, n: int, index: int) -> tuple[int, int]:
        """(len(inputs), len(targets)) of example `index` made from an n-token piece; an
        in-place example (bmlm) counts its n shared positions once, as targets."""
        if self.name in ("flm", "bmlm"):
            return 0, n
        if self.name == "plm":
            s = self._split(n, index)
            return s, n - s
        return span_lengths(n, self.cfg.noise_density, self.cfg.mean_noise_span_length)

    def _split(self, n: int, index: int) -> int:
        """Inputs length of example `index`, a piece of n tokens (see the module docstring)."""
        if self.cfg.plm_split == "uniform":
            L = self.cfg.decoder_length
            pair = index - index % 2
            s = 1 + min(int(uniform(self.seed, pair) * (L - 1)), L - 2)
            if index % 2:
                s = L - s  # the mirrored split of the pair's second example
            return min(max(s, 1), n - 1)
        lo = max(1, n - self.cfg.targets_length)
        hi = min(n - 1, self.cfg.inputs_length)
        u = uniform(self.seed, index)
        return lo + min(int(u * (hi - lo + 1)), hi - lo)

    def draws(self, indices: list[int]) -> np.ndarray | None:
        """The random draws of several examples at once (for `example(..., u=row)`)."""
        if self.name not in ("mlm", "bmlm") or not indices:
            return None
        return uniforms_many(self.seed, indices, self._draw_count(self.piece_length))

    def _draw_count(self, n: int) -> int:
        """Uniforms example of an n-token piece uses (a prefix of a longer draw is the same)."""
        return 3 * n if self.in_place else max(n - 2, 1)

    def masked_example(
        self, piece: np.ndarray, index: int, u: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(corrupted, original, selected) of the in-place example `index` (bmlm): int32
        tokens read, int32 tokens to predict at the same positions, bool loss positions."""
        if not self.in_place:
            raise DataError(f"objective {self.name!r} has no in-place examples; use `example`")
        if u is None:
            u = uniforms(self.seed, index, self._draw_count(piece.size))
        corrupted, selected = bert_mask(
            piece, self.cfg.noise_density, self.vocab_size, self.extra_ids, u
        )
        return corrupted, piece.astype(np.int32, copy=False), selected

    def example(
        self, piece: np.ndarray, index: int, u: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) int32 arrays of example `index` made from `piece`.

        `u`: this example's row of `draws` when precomputed (a speed-up; same result).
        """
        n = piece.size
        if self.in_place:
            raise DataError(
                "objective 'bmlm' examples are in place (inputs and targets share positions); "
                "use `masked_example`"
            )
        if self.name == "flm":
            return piece[:0], piece
        if self.name == "plm":
            s = self._split(n, index)
            return piece[:s], piece[s:]
        if u is None:
            u = uniforms(self.seed, index, max(n - 2, 1))
        keep, noise = span_layout(n, self.cfg.noise_density, self.cfg.mean_noise_span_length, u)
        return corrupt(piece, keep, noise, self.vocab_size)
