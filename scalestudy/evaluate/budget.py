"""How much context each scored pair keeps, and the row lengths that hold every pair whole.

A continuation (the text being scored) is never cut: rows are sized from the task's own
pairs, and a task whose rows would exceed `eval.max_length` is refused with a message saying
what to set. Only contexts are cut, from the left, and every cut is counted per pair.

Two rules (`eval.context_rule`), the same for every architecture at the same settings:

- `same` (default): every context keeps its last C tokens, C = `eval.inputs_length`, or the
  task's longest context when unset (nothing is cut). Decoder-only rows hold C context
  positions plus the longest continuation; the encoder-decoder's encoder C, its decoder the
  longest continuation.
- `wang2022`: the convention of the harness Wang et al. evaluated with: a decoder-only row of
  L = I + T positions (I, T: `eval.inputs_length`/`targets_length`, else the training lengths)
  is shared by context and continuation, so a context keeps L minus its continuation; the
  encoder-decoder's context keeps I. Rows still grow to hold a longer continuation whole.

The row arithmetic of each architecture (decoder-only rows share one stack between context
and continuation; the encoder-decoder's encoder holds the context) is
`data.pipeline.size_scoring_rows`, beside `scoring_batch`, which lays the rows out.

The input form follows training: an objective whose inputs ended in EOS in training (span
corruption) gets EOS after every context (`data.objectives.scoring_inputs_suffix`), and one
whose targets began with a sentinel (span corruption's <extra_id_0>) gets it before every
continuation, read but not scored (`data.objectives.scoring_targets_prefix`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scalestudy.config.experiment import ExperimentConfig
from scalestudy.data.objectives import scoring_inputs_suffix, scoring_targets_prefix
from scalestudy.data.pipeline import size_scoring_rows
from scalestudy.data.vocab import get_vocabulary, sentinel_id
from scalestudy.evaluate.formats import TaskDataError


@dataclass(frozen=True)
class Fitted:
    """Pairs ready to score: contexts cut to their budget (input form appended), targets
    after the form's first `unscored` tokens (read, not scored), and the row lengths
    (inputs, targets) that hold every pair whole."""

    inputs: list[list[int]]
    targets: list[list[int]]
    context_tokens: np.ndarray  # per pair: context tokens before any cut (input form excluded)
    context_kept: np.ndarray  # per pair: context tokens kept
    lengths: tuple[int, int]
    unscored: int = 0

    @property
    def cut(self) -> np.ndarray:
        """Per pair: whether its context was cut."""
        return self.context_kept < self.context_tokens


def fit_pairs(
    cfg: ExperimentConfig, inputs: list[list[int]], targets: list[list[int]], task: str = "task"
) -> Fitted:
    """Cut each context to the rule's budget and size rows so that no continuation is cut.

    Raises TaskDataError naming the task, the lengths needed and the settings to change when
    a row would exceed eval.max_length.
    """
    if len(inputs) != len(targets):
        raise ValueError(f"{len(inputs)} contexts but {len(targets)} continuations")
    suffix = list(scoring_inputs_suffix(cfg.objective))
    prefix = targets_prefix(cfg)
    n_ctx = np.array([len(x) for x in inputs], dtype=np.int64)
    n_tgt = np.array([len(t) for t in targets], dtype=np.int64)
    if n_tgt.size and n_tgt.min() == 0:
        raise TaskDataError(f"task {task!r}: a continuation encodes to no tokens; nothing to score")
    n_tgt = n_tgt + len(prefix)
    rows = size_scoring_rows(cfg, n_ctx, n_tgt, len(suffix))
    cut_inputs = [
        [*x[len(x) - k :], *suffix] if k else list(suffix)
        for x, k in zip(inputs, rows.kept.tolist(), strict=True)
    ]
    max_length = cfg.eval.max_length
    if rows.positions > max_length:
        if rows.context_room < 1:
            fix = "continuations are never cut: raise eval.max_length"
        else:
            fix = (
                f"set eval.inputs_length={rows.context_room} (or less) to cut contexts from the "
                "left (cuts are reported), or raise eval.max_length"
            )
        raise TaskDataError(
            f"task {task!r}: scoring needs rows of {rows.positions} tokens (longest context kept "
            f"{int(rows.kept.max(initial=0)) + len(suffix)}, longest continuation "
            f"{int(n_tgt.max(initial=0))}) but eval.max_length={max_length}; {fix}"
        )
    full = [[*prefix, *t] for t in targets]
    return Fitted(cut_inputs, full, n_ctx, rows.kept, rows.lengths, len(prefix))


def targets_prefix(cfg: ExperimentConfig) -> list[int]:
    """The token ids every scored continuation starts with (`scoring_targets_prefix`)."""
    sentinels = scoring_targets_prefix(cfg.objective)
    if not sentinels:  # no vocabulary to read for the objectives that have none
        return []
    vocab = get_vocabulary(cfg.data)
    return [sentinel_id(vocab, i) for i in sentinels]


def context_budget(cfg: ExperimentConfig, targets: list[list[int]]) -> np.ndarray:
    """Per pair: the context tokens it may keep whole under `cfg.eval`'s rule (the input
    form excluded); with no cut set (rule "same", eval.inputs_length unset), what rows of
    eval.max_length leave beside the task's longest continuation. Few-shot prompts
    (`fewshot.py`) drop demonstrations to stay within it."""
    suffix = len(scoring_inputs_suffix(cfg.objective))
    prefix = len(scoring_targets_prefix(cfg.objective))
    n_tgt = np.array([len(t) for t in targets], dtype=np.int64) + prefix
    unbounded = np.full_like(n_tgt, np.iinfo(np.int32).max)
    rows = size_scoring_rows(cfg, unbounded, n_tgt, suffix)
    return np.minimum(rows.kept, max(rows.context_room, 0))


def scoring_lengths(cfg: ExperimentConfig, lengths: tuple[int, int]) -> ExperimentConfig:
    """`cfg` with the objective lengths set to the fitted row lengths (what scoring_batch
    lays rows out by)."""
    inputs_length, targets_length = lengths
    return cfg.replace(
        objective=cfg.objective.replace(inputs_length=inputs_length, targets_length=targets_length)
    )


def text_lengths(cfg: ExperimentConfig) -> tuple[int, int]:
    """(context, window) tokens of held-out text scoring: eval's lengths, else training's."""
    return (
        cfg.eval.inputs_length or cfg.objective.inputs_length,
        cfg.eval.targets_length or cfg.objective.targets_length,
    )
