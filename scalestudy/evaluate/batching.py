"""Which pairs share a scoring call, and at what row shape.

A task's fitted lengths (`budget.fit_pairs`) hold its longest pair; most pairs are far shorter
(BLiMP's, for one: docs/evaluation.md). Each pair is therefore scored in the
shortest row of a short ladder of lengths that holds it whole (`bucket_length`), and shorter
rows are scored more to a call: a call's rows times its row length stays within the positions
of `rows` full-length rows, so memory never exceeds that of the one-shape layout, while the
cost of each call (dispatch, argument handling) is paid over more pairs. Row counts are
power-of-two multiples of the fewest rows per call, and the pairs left over from a length's
whole calls ride in the next, longer rows, so a task compiles a handful of shapes.

An encoder-decoder pair's shape is (encoder, decoder) length; the choices of one context (a
run of pairs with the same input) share the shape of their longest choice, so that they land
in the same call and their context is encoded once (`Scorer._distinct_contexts`).

One evaluation's tasks are planned together (`plan_calls` over several fitted parts): a
task's few calls at a length of its own (an in-context task at one number of
demonstrations fills ten) ride in the rows of a longer length that other tasks fill, so a run's
evaluation compiles a handful of shapes in all rather than a handful per task.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scalestudy.evaluate.budget import Fitted

SHORTEST_ROW = 8  # scoring row lengths are multiples of 8 (data.pipeline.SCORING_ROUND)
# A row length gets a compiled program of its own only for this many whole calls; fewer pairs
# ride in longer rows: on a CPU one compile costs far more than a small scoring call, and a
# step of the ladder saves only part of a call
# (docs/evaluation.md#scoring-cost-rows-bucketed-by-length).
MIN_CALLS = 32


def bucket_length(n: int, cap: int) -> int:
    """The shortest length of the ladder 8, 16, 24, 32, 48, 64, 96, 128, ... (2^k and
    1.5 x 2^k: above 16, under a third of a row is padding) that holds `n` positions, or
    `cap` (the task's full row, which holds every pair) when that is shorter."""
    length = SHORTEST_ROW
    while length < n:
        power_of_two = length & (length - 1) == 0
        length = length * 3 // 2 if power_of_two and length >= 16 else 1 << length.bit_length()
    return min(length, cap)


@dataclass(frozen=True)
class Call:
    """One scoring call: the pairs it scores (indices into the fitted pairs), the row
    lengths (inputs, targets) it lays them out by, and its row count (at least the pairs; the
    rest repeat a pair)."""

    pairs: np.ndarray
    lengths: tuple[int, int]
    rows: int


def _shapes(fitted: Fitted, encdec: bool) -> list[tuple[int, int]]:
    """Per pair: the bucketed row lengths (inputs, targets) that hold it whole."""
    n_in = np.array([len(x) for x in fitted.inputs], dtype=np.int64)
    n_tgt = np.array([len(t) for t in fitted.targets], dtype=np.int64)
    full_in, full_tgt = fitted.lengths
    if not encdec:
        # Decoder-only rows hold context and continuation in one stack of their sum.
        rows = [bucket_length(int(n), full_in + full_tgt) for n in n_in + n_tgt]
        return [(r - r // 2, r // 2) for r in rows]
    # Runs of pairs with one context share the shape of their longest continuation.
    starts = np.flatnonzero(
        [i == 0 or fitted.inputs[i] != fitted.inputs[i - 1] for i in range(len(n_in))]
    )
    if not len(starts):
        return []
    longest = np.repeat(np.maximum.reduceat(n_tgt, starts), np.diff([*starts, len(n_tgt)]))
    # An empty context is read as a lone EOS (scoring_batch): one encoder position at least.
    return [
        (bucket_length(max(int(a), 1), full_in), bucket_length(int(b), full_tgt))
        for a, b in zip(n_in, longest, strict=True)
    ]


def plan_calls(
    fitted: Fitted | Sequence[Fitted],
    *,
    encdec: bool,
    rows: int,
    bucketed: bool = True,
    min_calls: int = MIN_CALLS,
) -> list[Call]:
    """The calls that score every pair of `fitted` once, `rows` rows (a multiple of the batch
    shards) being the fewest per call; a shorter row length is used only where it fills
    `min_calls` whole calls. Several fitted parts (one evaluation's tasks) are planned
    together, their pairs indexed as if concatenated in order, and a call's rows never hold
    more positions than `rows` rows of the longest part's full lengths. Unbucketed (the
    reference layout): every call has its part's full lengths and `rows` rows, pairs in
    order, part by part."""
    parts = [fitted] if isinstance(fitted, Fitted) else list(fitted)
    n = sum(len(p.inputs) for p in parts)
    if not bucketed or not n:
        calls, start = [], 0
        for p in parts:
            end = start + len(p.inputs)
            calls += [
                Call(np.arange(s, min(s + rows, end)), p.lengths, rows)
                for s in range(start, end, rows)
            ]
            start = end
        return calls
    shapes = [shape for p in parts for shape in _shapes(p, encdec)]
    budget = rows * max(sum(p.lengths) for p in parts)
    order = sorted(set(shapes))
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, shape in enumerate(shapes):
        by_shape.setdefault(shape, []).append(i)
    carried: dict[tuple[int, int], np.ndarray] = {}
    calls = []
    for k, shape in enumerate(order):
        members = np.concatenate([carried.pop(shape, np.zeros(0, np.int64)), by_shape[shape]])
        members = members.astype(np.int64)
        most = rows
        while 2 * most * sum(shape) <= budget:
            most *= 2
        # The next length of the ladder that holds these pairs: the first later shape at
        # least as long in both parts of the row.
        longer = next((o for o in order[k + 1 :] if o[0] >= shape[0] and o[1] >= shape[1]), None)
        whole = len(members) // most
        if longer is not None and whole < min_calls:
            whole = 0  # too few to pay for a compile: all of them ride in longer rows
        calls += [Call(members[c * most : (c + 1) * most], shape, most) for c in range(whole)]
        left = members[whole * most :]
        if not len(left):
            continue
        if longer is not None:  # too few for a call of their own: they ride in longer rows
            carried[longer] = np.concatenate([carried.get(longer, np.zeros(0, np.int64)), left])
            continue
        size = rows
        while size < len(left):  # the fewest rows that hold them
            size *= 2
        calls.append(Call(left, shape, size))
    return calls
