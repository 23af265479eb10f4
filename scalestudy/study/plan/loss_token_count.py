"""Loss-bearing tokens counted on a config's first training batches: per training row (what
`equal_loss_tokens` matching sets a cell's steps from, `study/plan/matching.py`) and per
example (what the report states for every cell, `study/report/loss_tokens.py`).
"""

from __future__ import annotations

from scalestudy.config.experiment import ExperimentConfig


def _count(cfg: ExperimentConfig, batches: int) -> tuple[int, int, int]:
    """(rows, examples, loss-bearing tokens) in the first `batches` training batches."""
    from scalestudy.data.pipeline import make_iterator

    it = make_iterator(cfg, "train")
    rows = examples = loss = 0
    try:
        for _ in range(batches):
            b = next(it)
            rows += int(b["decoder_segment_ids"].shape[0])
            examples += int(b["decoder_segment_ids"].max(axis=1).sum())
            loss += int(b["decoder_loss_weights"].sum())
    finally:
        getattr(it, "close", lambda: None)()
    return rows, examples, loss


def measure_loss_tokens(cfg: ExperimentConfig, batches: int = 2) -> float:
    """Mean loss-bearing tokens per example over the first `batches` training batches of
    `cfg` (an example is one segment of a row)."""
    _, examples, loss = _count(cfg, batches)
    return loss / max(examples, 1)


def loss_tokens_per_row(cfg: ExperimentConfig, batches: int = 2) -> float:
    """Mean loss-bearing tokens per training row over the first `batches` batches of `cfg`."""
    rows, _, loss = _count(cfg, batches)
    return loss / max(rows, 1)
