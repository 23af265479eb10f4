"""Metrics of scored pairs: rank classification, last-word prediction, held-out text.

- multiple choice: `acc` (argmax of the sum), `acc_norm` (argmax of the sum divided by the
  choice's length in characters), as the public harnesses define them;
- multiple choice and last word: `task_loss`, the correct continuation's negative
  log-likelihood in nats per UTF-8 byte, averaged over examples (the quantity a task law's
  first step fits; per byte, so that it compares across vocabularies);
- last word (LAMBADA): `acc` (greedy exact match of all target tokens) and `ppl`
  (exp of minus the mean per-example log-likelihood) from the same pass;
- text: `loss` (nats per token), `ppl`, `bpb` (bits per UTF-8 byte, comparable across
  vocabularies).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from scalestudy.evaluate.examples import Example, Task


@dataclass
class Scored:
    """Per-pair results of one task, in pair order, and the examples they came from."""

    logprob: np.ndarray
    n_tokens: np.ndarray
    all_correct: np.ndarray
    example_of_pair: np.ndarray
    n_truncated: int


def choice_metrics(
    task: Task, examples: list[Example], scored: Scored, prefix: str
) -> dict[str, float]:
    """acc and acc_norm of rank classification (overall, and per group when groups differ)."""
    hits, hits_norm, groups = [], [], []
    pair = 0
    for ex in examples:
        k = len(ex.choices)
        lp = scored.logprob[pair : pair + k]
        chars = np.array([max(len(c), 1) for c in ex.choices], dtype=np.float64)
        hits.append(int(np.argmax(lp)) == ex.gold)
        hits_norm.append(int(np.argmax(lp / chars)) == ex.gold)
        groups.append(ex.group)
        pair += k
    out = {}
    names = sorted(set(groups))
    per_group, sizes = {}, {}
    for g in names:
        idx = [i for i, x in enumerate(groups) if x == g]
        per_group[g] = (np.mean([hits[i] for i in idx]), np.mean([hits_norm[i] for i in idx]))
        sizes[g] = len(idx)
        if len(names) > 1:
            out[f"{prefix}/{g}/acc"] = float(per_group[g][0])
            out[f"{prefix}/{g}/acc_norm"] = float(per_group[g][1])
            out[f"{prefix}/{g}/n"] = len(idx)
            out[f"{prefix}/{g}/chance"] = float(
                np.mean([1 / len(examples[i].choices) for i in idx])
            )
    out |= tag_metrics(task, {g: (float(a), sizes[g]) for g, (a, _) in per_group.items()}, prefix)
    if task.aggregate == "median":
        out[f"{prefix}/acc"] = float(np.median([a for a, _ in per_group.values()]))
        out[f"{prefix}/acc_norm"] = float(np.median([b for _, b in per_group.values()]))
    else:
        out[f"{prefix}/acc"] = float(np.mean(hits))
        out[f"{prefix}/acc_norm"] = float(np.mean(hits_norm))
    out[f"{prefix}/n"] = len(examples)
    # Expected accuracy of a uniform random guess, so that every table can show chance.
    out[f"{prefix}/chance"] = float(np.mean([1.0 / len(ex.choices) for ex in examples]))
    return out


def continuation_bytes(task: Task, choice: str) -> int:
    """UTF-8 bytes of a scored continuation: the task's delimiter and the choice, as scored."""
    return len((task.delimiter + choice).encode("utf-8"))


def task_loss_metrics(
    task: Task, examples: list[Example], scored: Scored, prefix: str
) -> dict[str, float]:
    """`<prefix>/task_loss`: the mean over examples of the gold continuation's negative
    log-likelihood per UTF-8 byte (nats); per group too (`<prefix>/<group>/task_loss`) when
    groups differ. Every example counts once, whatever the task's accuracy aggregate."""
    nll, groups = [], []
    pair = 0
    for ex in examples:
        gold = pair + ex.gold
        nll.append(-float(scored.logprob[gold]) / continuation_bytes(task, ex.choices[ex.gold]))
        groups.append(ex.group)
        pair += len(ex.choices)
    nll_E, groups_E = np.asarray(nll, dtype=np.float64), np.asarray(groups)
    out = {f"{prefix}/task_loss": float(nll_E.mean())}
    names = sorted(set(groups))
    if len(names) > 1:
        for g in names:
            out[f"{prefix}/{g}/task_loss"] = float(nll_E[groups_E == g].mean())
    return out


def tag_metrics(task: Task, group_acc: dict[str, tuple[float, int]], prefix: str) -> dict:
    """Accuracy per tag value (e.g. linguistics term, field) over the groups carrying it,
    weighted by each group's examples: "<prefix>/<tag>/<value>/acc"."""
    out: dict[str, float] = {}
    for tag, of_group in task.info.get("group_tags", {}).items():
        values: dict[str, list[tuple[float, int]]] = {}
        for group, (acc, n) in group_acc.items():
            values.setdefault(of_group.get(group, "unknown"), []).append((acc, n))
        for value, accs in sorted(values.items()):
            n = sum(k for _, k in accs)
            out[f"{prefix}/{tag}/{value}/acc"] = sum(a * k for a, k in accs) / n
    return out


def last_word_metrics(scored: Scored, prefix: str) -> dict[str, float]:
    """Greedy exact match and perplexity (per example, as the harness; and per token)."""
    lp, n = scored.logprob.astype(np.float64), scored.n_tokens.astype(np.float64)
    return {
        f"{prefix}/acc": float(np.mean(scored.all_correct)),
        f"{prefix}/ppl": float(math.exp(-np.mean(lp))),
        f"{prefix}/ppl_token": float(math.exp(-lp.sum() / n.sum())),
        f"{prefix}/n": len(lp),
    }


def text_metrics(scored: Scored, n_bytes: int, prefix: str) -> dict[str, float]:
    """Held-out loss per token, perplexity and bits per byte."""
    nll, tokens = -float(scored.logprob.astype(np.float64).sum()), float(scored.n_tokens.sum())
    return {
        f"{prefix}/loss": nll / tokens,
        f"{prefix}/ppl": math.exp(nll / tokens),
        f"{prefix}/bpb": nll / math.log(2) / n_bytes,
        f"{prefix}/tokens": int(tokens),
        f"{prefix}/n": len(scored.logprob),
    }
