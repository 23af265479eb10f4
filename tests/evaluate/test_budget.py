"""Context budgets: no continuation is ever cut, contexts are cut only from the left and
always counted, one rule for every architecture, the training input form, clear refusals."""

from __future__ import annotations

import numpy as np
import pytest

from scalestudy.config.experiment import ExperimentConfig
from scalestudy.data.objectives import EOS_ID
from scalestudy.data.pipeline import scoring_batch, size_scoring_rows
from scalestudy.evaluate.budget import fit_pairs, scoring_lengths
from scalestudy.evaluate.formats import TaskDataError

CELLS = [
    ("causal_decoder", "flm"),
    ("noncausal_decoder", "plm"),
    ("encoder_decoder", "plm"),
    ("encoder_decoder", "mlm"),
    ("noncausal_decoder", "mlm"),
]


def cfg_for(arch: str, objective: str, **eval_cfg) -> ExperimentConfig:
    return ExperimentConfig.model_validate(
        {
            "model": {"arch": arch},
            "objective": {"name": objective, "inputs_length": 24, "targets_length": 8},
            "eval": eval_cfg,
        }
    )


def random_pairs(rng: np.random.Generator, n: int) -> tuple[list[list[int]], list[list[int]]]:
    inputs = [rng.integers(3, 250, rng.integers(0, 90)).tolist() for _ in range(n)]
    targets = [rng.integers(3, 250, rng.integers(1, 40)).tolist() for _ in range(n)]
    return inputs, targets


def test_no_continuation_is_ever_cut_and_every_context_cut_is_counted() -> None:
    """Property over random lengths and settings: each row holds its continuation whole,
    with loss on exactly those tokens, after the kept context (the original's last tokens)."""
    rng = np.random.default_rng(0)
    for trial in range(60):
        arch, objective = CELLS[trial % len(CELLS)]
        settings = {
            "context_rule": ["same", "wang2022"][int(rng.integers(2))],
            "inputs_length": [None, int(rng.integers(1, 64))][int(rng.integers(2))],
            "targets_length": [None, int(rng.integers(1, 16))][int(rng.integers(2))],
        }
        cfg = cfg_for(arch, objective, **settings)
        inputs, targets = random_pairs(rng, 12)
        fitted = fit_pairs(cfg, inputs, targets)
        batch, n_cut = scoring_batch(
            scoring_lengths(cfg, fitted.lengths), *_io(fitted), fitted.unscored
        )
        assert n_cut == 0, (trial, settings)
        weights = batch["decoder_loss_weights"]
        for r, (ctx, tgt) in enumerate(zip(inputs, targets, strict=True)):
            assert weights[r].sum() == len(tgt)
            np.testing.assert_array_equal(batch["decoder_target_tokens"][r][weights[r] > 0], tgt)
            # Span corruption's sentinel (the form's prefix) is read just before, unscored.
            first = int(np.argmax(weights[r] > 0))
            prefix = fitted.targets[r][: fitted.unscored]
            got = batch["decoder_target_tokens"][r][first - len(prefix) : first].tolist()
            assert got == prefix and (objective == "mlm") == bool(prefix)
            kept = int(fitted.context_kept[r])
            body = fitted.inputs[r][:kept]
            assert body == (ctx[len(ctx) - kept :] if kept else [])
            assert fitted.cut[r] == (kept < len(ctx))
        if settings["inputs_length"] is None and settings["context_rule"] == "same":
            assert not fitted.cut.any()  # rows sized from the task: nothing cut


def _io(fitted):
    return fitted.inputs, fitted.targets


def test_same_rule_keeps_the_same_context_for_every_architecture() -> None:
    rng = np.random.default_rng(1)
    inputs, targets = random_pairs(rng, 40)
    kept = {
        arch: fit_pairs(cfg_for(arch, "plm", inputs_length=20), inputs, targets).context_kept
        for arch in ("causal_decoder", "noncausal_decoder", "encoder_decoder")
    }
    expected = np.minimum([len(x) for x in inputs], 20)
    for arch, k in kept.items():
        np.testing.assert_array_equal(k, expected, err_msg=arch)


def test_wang2022_rule_shares_the_decoder_row_and_gives_the_encoder_its_length() -> None:
    rng = np.random.default_rng(2)
    inputs, targets = random_pairs(rng, 40)
    n_ctx = np.array([len(x) for x in inputs])
    n_tgt = np.array([len(t) for t in targets])
    wang = cfg_for("causal_decoder", "flm", context_rule="wang2022")
    dec = fit_pairs(wang, inputs, targets)
    kept = np.minimum(n_ctx, np.maximum(24 + 8 - n_tgt, 0))  # L minus this continuation
    np.testing.assert_array_equal(dec.context_kept, kept)
    # Per example: scoring any subset keeps each example's context exactly as the whole
    # task does, even beside a continuation longer than L (whose row grows to hold it).
    more_inputs = [*inputs, list(range(3, 50))]
    more_targets = [*targets, list(range(3, 43))]  # 40 tokens > L = 32
    whole = fit_pairs(wang, more_inputs, more_targets)
    for i in (0, 5, len(more_inputs) - 1):
        alone = fit_pairs(wang, [more_inputs[i]], [more_targets[i]])
        assert alone.context_kept[0] == whole.context_kept[i]
        assert alone.inputs[0] == whole.inputs[i]
    encdec = cfg_for("encoder_decoder", "plm", context_rule="wang2022")
    np.testing.assert_array_equal(
        fit_pairs(encdec, inputs, targets).context_kept, n_ctx.clip(0, 24)
    )


def test_span_corruption_models_read_contexts_ending_in_eos() -> None:
    for arch in ("encoder_decoder", "noncausal_decoder"):
        fitted = fit_pairs(cfg_for(arch, "mlm"), [[5, 6, 7], []], [[9], [9]])
        assert fitted.inputs == [[5, 6, 7, EOS_ID], [EOS_ID]]
        assert fitted.context_kept.tolist() == [3, 0]
    fitted = fit_pairs(cfg_for("encoder_decoder", "plm"), [[5, 6, 7], []], [[9], [9]])
    assert fitted.inputs == [[5, 6, 7], []]


def test_rows_too_long_are_refused_with_what_to_set() -> None:
    cfg = cfg_for("causal_decoder", "flm", max_length=64)
    with pytest.raises(TaskDataError, match=r"task 'arc'.*set eval.inputs_length=56 \(or less"):
        fit_pairs(cfg, [list(range(3, 100))], [[5, 6]], "arc")
    fitted = fit_pairs(
        cfg.replace(eval=cfg.eval.replace(inputs_length=56)), [list(range(99))], [[5]]
    )
    assert sum(fitted.lengths) <= 64  # the suggested budget fits
    with pytest.raises(TaskDataError, match="continuations are never cut"):
        fit_pairs(cfg, [[5]], [list(range(3, 100))], "arc")
    cut = fit_pairs(cfg.replace(eval=cfg.eval.replace(inputs_length=32)), [list(range(99))], [[5]])
    assert cut.cut.tolist() == [True]


def test_rows_are_sized_as_scoring_batch_lays_them_out() -> None:
    """The row length checked against eval.max_length is the widest stack scoring_batch
    builds, for every architecture and rule: a budget at exactly that length is accepted, one
    position less is refused."""
    rng = np.random.default_rng(3)
    for trial in range(30):
        arch, objective = CELLS[trial % len(CELLS)]
        rule = ["same", "wang2022"][trial % 2]
        cfg = cfg_for(arch, objective, context_rule=rule)
        inputs, targets = random_pairs(rng, 8)
        fitted = fit_pairs(cfg, inputs, targets)
        batch, _ = scoring_batch(
            scoring_lengths(cfg, fitted.lengths), *_io(fitted), fitted.unscored
        )
        widest = max(v.shape[1] for v in batch.values())
        n_ctx = np.array([len(x) for x in inputs])
        n_tgt = np.array([len(t) for t in fitted.targets])  # with the form's prefix, if any
        n_suffix = len(fitted.inputs[0]) - int(fitted.context_kept[0])
        assert size_scoring_rows(cfg, n_ctx, n_tgt, n_suffix).positions == widest, (arch, rule)
        fit_pairs(cfg.replace(eval=cfg.eval.replace(max_length=widest)), inputs, targets)
        with pytest.raises(TaskDataError, match=f"rows of {widest} tokens"):
            fit_pairs(cfg.replace(eval=cfg.eval.replace(max_length=widest - 1)), inputs, targets)
