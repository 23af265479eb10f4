"""A task's examples as token pairs: (context, continuation) per choice, text windows."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from scalestudy.evaluate.examples import Example, Task


def limit_examples(task: Task, max_examples: int | None) -> list[Example]:
    """The first `max_examples` examples of each group (all of them when None)."""
    if max_examples is None:
        return list(task.examples)
    taken: dict[str, int] = {}
    out = []
    for ex in task.examples:
        if taken.get(ex.group, 0) < max_examples:
            taken[ex.group] = taken.get(ex.group, 0) + 1
            out.append(ex)
    return out


def tokenize_pairs(
    encode_pair: Callable[[str, str], tuple[list[int], list[int]]],
    task: Task,
    examples: list[Example],
):
    """Token pairs of a choice/last-word task and, per pair, the example index. `encode_pair`
    tokenises (context, delimiter + choice) as the model reads them
    (`data.pipeline.encode_scoring_pair`)."""
    inputs, targets, owner = [], [], []
    for i, ex in enumerate(examples):
        for context, choice in ex.pairs():
            context_ids, choice_ids = encode_pair(context, task.delimiter + choice)
            inputs.append(context_ids)
            targets.append(choice_ids)
            owner.append(i)
    return inputs, targets, np.asarray(owner)


def text_windows(encode, task: Task, length: int, context: int, max_examples: int | None):
    """Non-overlapping target windows over each document, each after up to `context` tokens.

    A document's first token is only context (an encoder must see at least one token).
    """
    inputs, targets = [], []
    for ex in task.examples:
        tokens = list(encode(ex.choices[0]))
        for start in range(1, len(tokens), length):
            inputs.append(tokens[max(0, start - context) : start])
            targets.append(tokens[start : start + length])
    return inputs[:max_examples], targets[:max_examples]
