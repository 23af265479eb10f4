"""The loss floor of the order task (`data/order_task.py`): what a predictor that knows the
task exactly scores on the validation batches a run is evaluated on.

Given the tokens before it, the ideal probability of a document's next token is: a letter
before the bar, uniform over the alphabet, unless the string may end here (lengths are uniform
in `LENGTHS`, so after j letters the bar comes with probability 1 / (number of lengths >= j));
after the bar every token (the reversed letters, then EOS) is certain. A run's validation loss
minus this floor is what it has yet to learn; a model that cannot read order in its prefix
stays well above it.

The bag floor bounds such a model from below. A non-causal decoder without position encoding
is permutation-equivariant over its bidirectional prefix: every prefix position's state is
the same function of its own token and the prefix's multiset of tokens, and every later query
sees the prefix only as that multiset. So the most it can know when it predicts a target is
the prefix's multiset (with counts), its own input token when the query is the last prefix
position, and the targets before it in order. The Bayes loss given exactly that, under the
same prior as the floor (uniform length, uniform letters), is a loss no such model can beat
however long it trains: the bag floor minus the floor is a final-loss gap, not a speed one.
"""

from __future__ import annotations

import math
from collections import Counter
from functools import cache

import numpy as np

from scalestudy.config.experiment import ExperimentConfig
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


BAR, EOS = "|", "eos"


@cache
def _arrangements(rest: tuple[int, ...], singles: int, doubles: int) -> int:
    """Ways to give `doubles` ordered letters that fill two prefix slots each and `singles`
    that fill one so that the prefix's letter counts are `rest`."""
    if sum(rest) != singles + 2 * doubles:
        return 0
    if doubles == 0:
        return math.factorial(singles) // math.prod(math.factorial(c) for c in rest)
    total = 0
    for c, count in enumerate(rest):  # the first double letter is c
        if count >= 2:
            left = (*rest[:c], count - 2, *rest[c + 1 :])
            total += _arrangements(left, singles, doubles - 1)
    return total


def _template(n: int, i: int) -> int | str:
    """What position `i` of a document with `n` letters holds: a letter's index, BAR or EOS."""
    if i < n:
        return i
    if i == n:
        return BAR
    return 2 * n - i if i <= 2 * n else EOS


def _weight(n: int, prefix: int, bag: Counter, seen: dict[int, str], alphabet: str) -> float:
    """Prior mass of the documents with `n` letters whose first `prefix` tokens have multiset
    `bag` and whose tokens at the positions of `seen` are those."""
    if prefix > 2 * n + 1 or any(p > 2 * n + 1 for p in seen):
        return 0.0
    slots = Counter(_template(n, i) for i in range(prefix))
    if slots[BAR] != bag[BAR] or slots[EOS]:
        return 0.0
    fixed: dict[int, str] = {}
    for p, token in seen.items():
        what = _template(n, p)
        if isinstance(what, str):
            if what != token:
                return 0.0
        elif fixed.setdefault(what, token) != token or token not in alphabet:
            return 0.0
    rest = Counter({c: bag[c] for c in alphabet})
    for i, token in fixed.items():
        rest[token] -= slots[i]
    if min(rest.values()) < 0:
        return 0.0
    free = [i for i in range(n) if i not in fixed]
    singles = sum(slots[i] == 1 for i in free)
    doubles = sum(slots[i] == 2 for i in free)
    unseen = sum(slots[i] == 0 for i in free)
    ways = _arrangements(tuple(rest[c] for c in alphabet), singles, doubles)
    k = len(alphabet)
    return ways * float(k) ** (unseen - n)


def bag_document_loss(
    doc: list[str], prefix: int, alphabet: str = order_task.LETTERS, lengths=order_task.LENGTHS
) -> float:
    """Summed bag-floor loss (nats) of the targets of one document (`doc`: its tokens, letters,
    BAR and EOS) whose first `prefix` tokens are the bidirectional prefix."""
    bag = Counter(doc[:prefix])
    total = 0.0
    for j in range(prefix, len(doc)):
        # the last prefix position predicts the first target knowing its own input token
        seen = {j - 1: doc[j - 1]} if j == prefix and prefix else {}
        seen.update({p: doc[p] for p in range(prefix, j)})
        ns = range(lengths[0], lengths[1] + 1)
        den = sum(_weight(n, prefix, bag, seen, alphabet) for n in ns)
        num = sum(_weight(n, prefix, bag, {**seen, j: doc[j]}, alphabet) for n in ns)
        total -= math.log(num / den)
    return total


def validation_bag_floor(cfg: ExperimentConfig) -> float:
    """The bag floor per loss-bearing token on the validation batches of the non-causal
    decoder run `cfg` (`data.source: order`): the least loss a model that reads its
    bidirectional prefix as a multiset can reach."""
    vocab = get_vocabulary(cfg.data)
    ids = encode_documents(vocab, [order_task.LETTERS + BAR])[0]
    symbol = dict(zip((int(i) for i in ids), (*order_task.LETTERS, BAR)))
    iterator = make_iterator(cfg, "validation")
    total, count = 0.0, 0
    for _ in range(cfg.train.eval_batches):
        batch = next(iterator)
        targets, weights = batch["decoder_target_tokens"], batch["decoder_loss_weights"]
        segments, bidi = batch["decoder_segment_ids"], batch["decoder_causal_attention"]
        for row in range(targets.shape[0]):
            for segment in set(segments[row].tolist()) - {0}:
                at = np.flatnonzero(segments[row] == segment)
                doc = [symbol.get(int(t), EOS) for t in targets[row, at]]
                prefix = int(bidi[row, at].sum()) - 1  # the region also holds the start token
                assert np.all(weights[row, at][prefix:] > 0), "targets follow the prefix"
                total += bag_document_loss(doc, prefix)
                count += len(doc) - prefix
    return total / count
