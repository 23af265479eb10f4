"""Per-example scores of one task, one JSON object per example (or text window).

Each record carries what the aggregates are computed from, so that any metric can be
recomputed and any prediction inspected: per choice its log-likelihood, token and byte counts
and whether greedy decoding produces it; the example's gold and predicted choices; and how
many context tokens the example had and kept (a cut is never silent).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from scalestudy.evaluate.budget import Fitted
from scalestudy.evaluate.examples import Example, Task
from scalestudy.evaluate.metrics import Scored, continuation_bytes


def _choice(task: Task, text: str, lp: float, n: int, greedy: bool) -> dict[str, Any]:
    return {
        "text": text,
        "logprob": float(lp),
        "tokens": int(n),
        "bytes": continuation_bytes(task, text),
        "chars": len(text),
        "greedy": bool(greedy),
    }


def example_records(
    task: Task, examples: list[Example], scored: Scored, fitted: Fitted
) -> list[dict[str, Any]]:
    """One record per example of a choice or last-word task, in example order."""
    out = []
    pair = 0
    for i, ex in enumerate(examples):
        k = len(ex.choices)
        sl = slice(pair, pair + k)
        choices = [
            _choice(task, c, lp, n, g)
            for c, lp, n, g in zip(
                ex.choices,
                scored.logprob[sl],
                scored.n_tokens[sl],
                scored.all_correct[sl],
                strict=True,
            )
        ]
        record: dict[str, Any] = {"example": i, "source": ex.source, "group": ex.group}
        # what the model read before each choice (one shared context, or one per choice)
        record["prompt"] = ex.contexts[0] if len(ex.contexts) == 1 else list(ex.contexts)
        record["gold"] = ex.gold
        if task.kind == "choice":
            lp = np.array([c["logprob"] for c in choices])
            chars = np.array([max(c["chars"], 1) for c in choices], dtype=np.float64)
            record["pred"] = int(np.argmax(lp))
            record["pred_norm"] = int(np.argmax(lp / chars))
        record["choices"] = choices
        record["context_tokens"] = fitted.context_tokens[sl].tolist()
        record["context_kept"] = fitted.context_kept[sl].tolist()
        record["truncated"] = bool(fitted.cut[sl].any())
        out.append(record)
        pair += k
    return out


def window_records(scored: Scored, fitted: Fitted, n_bytes: list[int]) -> list[dict[str, Any]]:
    """One record per scored window of a text task."""
    return [
        {
            "window": i,
            "logprob": float(scored.logprob[i]),
            "tokens": int(scored.n_tokens[i]),
            "bytes": int(n_bytes[i]),
            "context_tokens": int(fitted.context_tokens[i]),
            "context_kept": int(fitted.context_kept[i]),
            "truncated": bool(fitted.cut[i]),
        }
        for i in range(len(scored.logprob))
    ]
