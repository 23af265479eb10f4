"""The bag floor of the order task (`decoder_only/order_floor.py`): the least loss of a model
that reads its bidirectional prefix as a multiset, checked against brute-force enumeration."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest

from scalestudy.decoder_only import order_floor
from scalestudy.decoder_only.order_floor import BAR, EOS

SMALL, SMALL_LENGTHS = "abc", (2, 3)  # small enough to enumerate every document


def _doc(letters: str) -> list[str]:
    return [*letters, BAR, *letters[::-1], EOS]


def _brute_force(doc: list[str], prefix: int, alphabet: str, lengths) -> float:
    """The same loss by enumerating every document and conditioning on what a model that
    reads the prefix as a multiset can know at each target."""
    docs = [
        (_doc("".join(s)), len(alphabet) ** -n)
        for n in range(lengths[0], lengths[1] + 1)
        for s in itertools.product(alphabet, repeat=n)
    ]
    bag = Counter(doc[:prefix])
    total = 0.0
    for j in range(prefix, len(doc)):

        def known(d, j=j):
            if len(d) <= j or Counter(d[:prefix]) != bag or d[prefix:j] != doc[prefix:j]:
                return False
            return j != prefix or prefix == 0 or d[j - 1] == doc[j - 1]

        den = sum(w for d, w in docs if known(d))
        num = sum(w for d, w in docs if known(d) and d[j] == doc[j])
        total -= math.log(num / den)
    return total


@pytest.mark.parametrize("letters", ["ab", "abc", "cab", "aab", "bb", "cba"])
def test_the_bag_floor_equals_brute_force_enumeration(letters):
    doc = _doc(letters)
    for prefix in range(0, len(doc)):
        got = order_floor.bag_document_loss(doc, prefix, SMALL, SMALL_LENGTHS)
        want = _brute_force(doc, prefix, SMALL, SMALL_LENGTHS)
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), (letters, prefix)


def test_the_bag_floor_is_the_floor_where_the_prefix_holds_no_order_and_above_it_elsewhere():
    rng = random.Random(0)
    lo, hi = order_floor.order_task.LENGTHS
    above = 0
    for _ in range(12):
        letters = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(lo, hi)))
        doc = _doc(letters)
        for prefix in range(0, len(doc)):
            floor = sum(order_floor.token_loss(j, len(letters)) for j in range(prefix, len(doc)))
            bag = order_floor.bag_document_loss(doc, prefix)
            if prefix <= 1:  # one letter or none: nothing to order
                assert bag == pytest.approx(floor, abs=1e-9)
            assert bag >= floor - 1e-9
            above += bag > floor + 1e-6
    assert above > 0
