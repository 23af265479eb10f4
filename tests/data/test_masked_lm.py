"""BERT-style masked LM (objective bmlm): in-place rows, 80/10/10 corruption, the whole segment
bidirectional (or mixed forward/backward over it), packing, resume, training, refusals."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import ExperimentConfig, check_cell
from scalestudy.data import DataError
from scalestudy.data.batches import empty_features, write_in_place
from scalestudy.data.bert_masking import FIRST_ORDINARY_ID, bert_mask
from scalestudy.data.objectives import Objective, uniforms
from scalestudy.data.pipeline import make_iterator, scoring_batch
from scalestudy.models import masks

SMALL_DATA = {"synthetic": {"n_train_documents": 300, "n_validation_documents": 30}}
V, EXTRA = 384, 100  # model vocabulary; byte vocabulary with 100 sentinels: 3 + 256 + 100 ids


def bmlm_cfg(*, batch_size=8, seed=0, model=None, obj=None):
    return ExperimentConfig(
        model={"arch": "noncausal_decoder", **(model or {})},
        objective={"name": "bmlm", "inputs_length": 24, "targets_length": 8, **(obj or {})},
        data={**SMALL_DATA, "seed": seed},
        train={"batch_size": batch_size},
    )


def _segments(seg_row):
    for s in range(1, int(seg_row.max()) + 1):
        yield s, np.flatnonzero(seg_row == s)


def _pieces_of(it, batch_plan):
    tok, starts, lengths = it._pieces.tokens, it._pieces.starts, it._pieces.lengths
    return [[tok[starts[p] : starts[p] + lengths[p]] for _, p in row] for row in batch_plan]


# ----------------------------------------------------------------------------- layout


def test_rows_hold_each_piece_in_place_with_loss_on_the_selected_positions():
    cfg = bmlm_cfg()
    it = make_iterator(cfg)
    mask_id = it.vocabulary.vocab_size - 1
    for _ in range(3):
        plan, _ = it._plan(it.state()["cursor"])
        b = next(it)
        seg_BL = b["decoder_segment_ids"]
        # Whole segments bidirectional, nothing else: decoder_causal_attention == real positions.
        assert np.array_equal(b["decoder_causal_attention"], (seg_BL > 0).astype(np.int32))
        for r, pieces in enumerate(_pieces_of(it, plan)):
            assert seg_BL[r].max() == len(pieces)
            for (_, idx), piece in zip(_segments(seg_BL[r]), pieces):
                assert np.array_equal(idx, np.arange(idx[0], idx[0] + piece.size))
                tgt = b["decoder_target_tokens"][r, idx]
                inp = b["decoder_input_tokens"][r, idx]
                w = b["decoder_loss_weights"][r, idx].astype(bool)
                # Targets are the original piece at the same positions: no shift.
                assert np.array_equal(tgt, piece)
                assert np.array_equal(b["decoder_positions"][r, idx], np.arange(piece.size))
                # Exactly round(15%) of the positions (at least one) carry the loss ...
                assert w.sum() == max(1, round(piece.size * 0.15))
                # ... and only they may differ from the original.
                assert np.array_equal(inp[~w], tgt[~w])
                assert set(inp[w].tolist()) - set(tgt[w].tolist()) <= set(range(3, mask_id + 1))
            n_real = int((seg_BL[r] > 0).sum())
            assert not b["decoder_loss_weights"][r, n_real:].any()
            assert not b["decoder_input_tokens"][r, n_real:].any()


def test_corruption_is_80_10_10_in_expectation():
    n, draws = 64, 2000
    piece = np.full(n, 100, np.int32)  # one token everywhere: "kept" is unambiguous
    masked = random = kept = 0
    for k in range(draws):
        corrupted, selected = bert_mask(piece, 0.15, V, EXTRA, uniforms(7, k, 3 * n))
        assert selected.sum() == round(n * 0.15)
        assert np.array_equal(corrupted[~selected], piece[~selected])
        got = corrupted[selected]
        masked += int((got == V - 1).sum())
        kept += int((got == 100).sum())
        other = got[(got != V - 1) & (got != 100)]
        assert ((other >= FIRST_ORDINARY_ID) & (other < V - EXTRA)).all()  # ordinary ids only
        random += other.size
    total = draws * round(n * 0.15)
    assert masked + random + kept == total
    # ~19,000 selected positions: a binomial proportion's sd is <= 0.004.
    assert abs(masked / total - 0.8) < 0.02
    assert abs(random / total - 0.1) < 0.02
    assert abs(kept / total - 0.1) < 0.02
    # The selected positions are spread over the piece, not stuck at some of them.
    assert kept > 0 and random > 0


def test_examples_are_a_pure_function_of_seed_and_index():
    cfg = bmlm_cfg()
    obj = Objective(cfg.objective, vocab_size=359, extra_ids=EXTRA, seed=3)
    piece = np.arange(5, 37, dtype=np.int32)
    a = obj.masked_example(piece, 11)
    row = obj.draws([10, 11])[1]  # a batch's precomputed draws: the same example
    b = obj.masked_example(piece, 11, row)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    short = obj.masked_example(piece[:9], 11, row)  # shorter pieces read a prefix of the row
    assert np.array_equal(short[0], obj.masked_example(piece[:9], 11)[0])
    other = obj.masked_example(piece, 12)
    assert not np.array_equal(a[2], other[2])
    with pytest.raises(DataError, match="in place"):
        obj.example(piece, 11)


def test_stream_is_deterministic_seeded_and_resumes_exactly():
    cfg = bmlm_cfg()
    straight = make_iterator(cfg)
    batches = [next(straight) for _ in range(5)]
    again = make_iterator(cfg)
    assert all(np.array_equal(batches[0][k], v) for k, v in next(again).items())
    first = make_iterator(cfg)
    for _ in range(2):
        next(first)
    state = json.loads(json.dumps(first.state()))
    resumed = make_iterator(cfg, process_index=1, process_count=2)  # other layout, same stream
    resumed.restore(state)
    for b in batches[2:]:
        got = next(resumed)
        assert all(np.array_equal(b[k][4:], got[k]) for k in b)
    other = next(make_iterator(bmlm_cfg(seed=1)))
    assert not np.array_equal(other["decoder_loss_weights"], batches[0]["decoder_loss_weights"])


# ----------------------------------------------------------------------------- through the model


def _tiny_model(attention="standard", n_heads=4):
    from scalestudy.models.api import build_model

    cfg = bmlm_cfg(
        model={
            "d_model": 32,
            "d_ff": 64,
            "n_heads": n_heads,
            "n_layers": 2,
            "dtype": "float32",
            "dropout": 0.0,
            "attention": attention,
        }
    )
    model = build_model(cfg.model)
    return cfg, model, model.init(jax.random.key(0))


def _packed_row(cfg, lengths=(11, 14)):
    """One row of 32 positions packing in-place examples of the given lengths, then padding."""
    it = make_iterator(cfg)
    f = empty_features(1, cfg.objective.decoder_length, 0)
    p = 0
    for seg, n in enumerate(lengths, start=1):
        piece = it._pieces.tokens[100 * seg : 100 * seg + n]
        write_in_place(f, 0, p, *it._objective.masked_example(piece, seg), seg)
        p += n
    return f


@pytest.mark.parametrize("attention", ["standard", "mixed", "mixed_layers"])
def test_packed_segments_never_see_each_other(attention):
    cfg, model, params = _tiny_model(attention)
    batch = _packed_row(cfg)
    seg = batch["decoder_segment_ids"][0]
    changed = {k: v.copy() for k, v in batch.items()}
    second = seg == 2
    changed["decoder_input_tokens"][0, second] = (
        changed["decoder_input_tokens"][0, second] + 7
    ) % V
    logits = model.apply(params, batch, rng=None, deterministic=True)
    logits2 = model.apply(params, changed, rng=None, deterministic=True)
    diff_L = np.abs(np.asarray(logits - logits2)).max(axis=-1)[0]
    assert diff_L[seg == 1].max() == 0.0  # the segment before it is unaffected
    assert diff_L[second].min() > 0.0  # the changed segment itself sees its new tokens


def test_bidirectional_rows_read_the_right_context():
    """Standard attention over the whole row: position 0 depends on later tokens."""
    cfg, model, params = _tiny_model()
    b = _packed_row(cfg)
    changed = {k: v.copy() for k, v in b.items()}
    last = int(np.flatnonzero(b["decoder_segment_ids"][0] == 1)[-1])
    changed["decoder_input_tokens"][0, last] = (changed["decoder_input_tokens"][0, last] + 7) % V
    before = model.apply(params, b, rng=None, deterministic=True)
    after = model.apply(params, changed, rng=None, deterministic=True)
    assert np.abs(np.asarray(before - after))[0, 0].max() > 0.0


def test_mixed_heads_look_forward_or_backward_over_the_whole_row():
    b = next(make_iterator(bmlm_cfg()))
    seg_BL = jnp.asarray(b["decoder_segment_ids"])
    prefix_BL = jnp.asarray(b["decoder_causal_attention"])
    H = 4
    got_BHQK = np.asarray(masks.decoder_self(seg_BL, prefix_BL, H, mixed=True))
    L = seg_BL.shape[1]
    q_QK, k_QK = np.meshgrid(np.arange(L), np.arange(L), indexing="ij")
    seg = np.asarray(seg_BL)
    same_BQK = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
    assert got_BHQK.shape == (seg.shape[0], H, L, L)
    for h in range(H):
        direction_QK = k_QK <= q_QK if h < H // 2 else k_QK >= q_QK
        assert np.array_equal(got_BHQK[:, h], same_BQK & direction_QK[None])
    # Mixed layers: layer 0 all heads forward, layer 1 all backward, over the whole segment.
    fwd, bwd = masks.per_layer(
        lambda d: masks.decoder_self(seg_BL, prefix_BL, H, False, d), "mixed_layers"
    )
    assert np.array_equal(np.asarray(fwd)[:, 0], same_BQK & (k_QK <= q_QK)[None])
    assert np.array_equal(np.asarray(bwd)[:, 0], same_BQK & (k_QK >= q_QK)[None])


def test_a_tiny_noncausal_decoder_learns_it():
    from scalestudy.train import program as train_program

    cfg = bmlm_cfg(
        batch_size=16,
        model={"d_model": 32, "d_ff": 64, "n_heads": 2, "n_layers": 2, "dtype": "float32"},
    ).replace(
        optim={"learning_rate": 0.01, "schedule": "constant", "warmup_steps": 2},
        train={"batch_size": 16, "steps": 20},
    )
    it = make_iterator(cfg)
    batches = [next(it) for _ in range(20)]
    program = train_program.build_program(cfg, batches[0])
    state = program.init(0)
    losses = []
    for b in batches:
        state, m = program.step(state, program.shard_batch(b))
        losses.append(m["train/loss"])
    losses = [float(x) for x in jax.device_get(losses)]
    assert all(np.isfinite(losses))
    # From ~ln(384) on fresh batches; the byte statistics alone take it well below.
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("arch", ["causal_decoder", "encoder_decoder"])
def test_only_the_noncausal_decoder_trains_it(arch):
    check_cell("noncausal_decoder", "bmlm")
    with pytest.raises(ConfigError, match="only the non-causal decoder"):
        check_cell(arch, "bmlm")


def test_rank_classification_refuses_it_and_studies_skip_it(capsys):
    from scalestudy.decoder_only import stats
    from scalestudy.evaluate import rank
    from scalestudy.study.record.rows import RunRow
    from scalestudy.study.run.executors import _needs_eval

    cfg = bmlm_cfg()
    with pytest.raises(DataError, match="validation loss only"):
        scoring_batch(cfg, [[5, 6]], [[7]])
    with pytest.raises(ConfigError, match="validation loss only"):
        rank.evaluate_params(cfg, None, None, tasks=["synthetic_probes"])
    assert rank.make_eval_fn(cfg) is None
    assert "zero-shot evaluation skipped" in capsys.readouterr().err
    assert not _needs_eval(cfg, {})
    assert _needs_eval(cfg.replace(objective={**cfg.objective.model_dump(), "name": "mlm"}), {})
    # The decoder-only comparison says "no accuracy" rather than a difference of nan.
    rows = [RunRow(seed=s, loss=1.0 + s) for s in range(3)]
    est = stats.paired_difference(rows, rows, "acc")
    line = stats.verdict("a", "b", est, "probe accuracy", False, None)
    assert "no accuracy" in line and "nan" not in line


def test_the_seqio_path_refuses_it():
    pytest.importorskip("seqio")
    from scalestudy.data.seqio_tasks import check_objective

    check_objective("mlm")
    with pytest.raises(DataError, match="NumPy pipeline only"):
        check_objective("bmlm")


# ----------------------------------------------------------------------------- a study


@pytest.mark.slow
def test_a_decoder_only_study_compares_bmlm_on_validation_loss(tmp_path):
    import yaml

    from scalestudy.cli import main as cli
    from scalestudy.study.record.registry import load_runs

    cell = ["noncausal_decoder", "bmlm"]
    spec = {
        "name": "tiny_bmlm",
        "base": {
            "objective": {"inputs_length": 24, "targets_length": 8},
            "model": {"vocab_size": 384, "dtype": "float32", "n_heads": 2},
            "train": {
                "batch_size": 8,
                "log_every": 2,
                "checkpoint_every": 4,
                "eval_batches": 1,
                "progress": False,
                "async_checkpoint": False,
            },
            "data": {"synthetic": {"n_train_documents": 200, "n_validation_documents": 20}},
            "eval": {"max_examples": 8},
        },
        "cells": [cell],
        "ladder": {"sizes": [{"name": "xs", "d_model": 16, "n_layers": 2, "d_ff": 32}]},
        "budget": {"kind": "steps", "steps": 4},
        "seeds": [0, 1],
        "variants": [
            {"name": "bidir", "cells": [cell]},
            {"name": "mixheads", "model": {"attention": "mixed"}, "cells": [cell]},
        ],
        "tasks": ["synthetic_probes"],
        "fit": {"laws": ["kaplan_n"], "bootstrap": 10},
        "experiments": {
            "comparisons": [
                {
                    "title": "bmlm",
                    "groups": ["noncausal_decoder/bmlm/bidir", "noncausal_decoder/bmlm/mixheads"],
                },
            ]
        },
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "study"
    assert cli.main(["study", "--spec", str(path), "--out", str(out)]) == 0
    runs = load_runs(out)
    assert len(runs) == 4 and all(r["status"] == "done" for r in runs)
    assert not any(k.startswith("eval/") for r in runs for k in r)  # never scored zero-shot
    text = (out / "decoder_only.md").read_text()
    assert "validation loss: " in text and "no accuracy" in text
