"""Matching modes: equal documents, loss-bearing tokens and inference cost; seeds vary data
order; the registry records what each run consumed."""

import sqlite3

import pytest

from scalestudy.config.errors import ConfigError
from scalestudy.data.objectives import feature_lengths
from scalestudy.study.plan import matching
from scalestudy.study.record.registry import Registry, load_runs
from scalestudy.study.run import main_job

from .conftest import write_spec

pytest.importorskip("scalestudy.models.counting")

PLM_CELLS = [["causal_decoder", "plm"], ["noncausal_decoder", "plm"], ["encoder_decoder", "plm"]]


def _expand(tmp_path, *overrides, **spec):
    path = write_spec(tmp_path / "s.yaml", **{"cells": PLM_CELLS, **spec})
    return main_job.expand(main_job.load_study(path, list(overrides)), path.parent)


def _rows(runs, tmp_path):
    return {r.cfg.name.split(".")[1]: r.row("t", tmp_path) for r in runs if r.size == "xs"}


def test_equal_documents_halves_the_encoder_decoder_prefix_lm_steps(tmp_path):
    # Its uniform-split row holds two examples of L tokens: twice a decoder row's text.
    shape = _rows(_expand(tmp_path, "matching=equal_stack_shape", "budget.steps=8"), tmp_path)
    assert shape["encoder_decoder"]["planned_document_tokens"] == pytest.approx(
        2 * shape["causal_decoder"]["planned_document_tokens"]
    )
    docs = _rows(_expand(tmp_path, "matching=equal_documents", "budget.steps=8"), tmp_path)
    assert docs["encoder_decoder"]["steps"] == 4 and docs["causal_decoder"]["steps"] == 8
    assert len({r["planned_document_tokens"] for r in docs.values()}) == 1


def test_equal_documents_by_batch_keeps_the_steps_and_halves_the_prefix_lm_rows(tmp_path):
    runs = _expand(tmp_path, "matching=equal_documents", "match_by=batch", "budget.steps=8")
    docs = _rows(runs, tmp_path)
    assert {r["steps"] for r in docs.values()} == {8}
    xs = {r.cfg.name.split(".")[1]: r.cfg for r in runs if r.size == "xs"}
    base = xs["causal_decoder"].train.batch_size
    assert xs["encoder_decoder"].train.batch_size * 2 == base
    assert xs["noncausal_decoder"].train.batch_size == base
    assert len({r["planned_document_tokens"] for r in docs.values()}) == 1
    # Positions per step are equal too: each encoder-decoder row holds twice a decoder's.
    rows = {k: sum(feature_lengths(c.objective, c.model.is_encoder_decoder)) for k, c in xs.items()}
    positions = {k: c.train.batch_size * rows[k] for k, c in xs.items()}
    assert len(set(positions.values())) == 1


def test_match_by_batch_needs_a_data_matching_and_whole_rows(tmp_path):
    with pytest.raises(ConfigError, match=r"match_by: batch .* needs matching equal_documents"):
        _expand(tmp_path, "matching=equal_flops", "match_by=batch")
    with pytest.raises(ConfigError, match=r"does not divide train\.batch_size=3; give a batch"):
        _expand(tmp_path, "matching=equal_documents", "match_by=batch", "base.train.batch_size=3")


def test_by_batch_a_span_corruption_cell_is_matched_by_steps(tmp_path):
    """Its row's raw text is no whole number of decoder rows: it keeps the batch and reads
    the reference's documents in its own number of steps, as under match_by: steps."""
    cells = [["causal_decoder", "flm"], ["encoder_decoder", "mlm"]]
    by_batch = _expand(tmp_path, "matching=equal_documents", "match_by=batch", cells=cells)
    by_steps = _expand(tmp_path, "matching=equal_documents", cells=cells)
    assert [r.cfg for r in by_batch] == [r.cfg for r in by_steps]
    mlm = [r.cfg.train.steps for r in by_batch if r.objective == "mlm"]
    assert mlm and all(s != 4 for s in mlm)


def test_equal_inference_cost_matches_flops_per_generated_token(tmp_path):
    rows = _rows(
        _expand(tmp_path, "matching=equal_inference_cost", "match_tolerance=0.03"), tmp_path
    )
    ref = rows["causal_decoder"]["inference_flops_per_token"]
    for row in rows.values():
        assert row["inference_flops_per_token"] == pytest.approx(ref, rel=0.03)
        assert row["inference_context"] == 32  # the objective's decoder length by default
    assert rows["encoder_decoder"]["d_ff"] < rows["causal_decoder"]["d_ff"]
    unmatched = _rows(_expand(tmp_path), tmp_path)["encoder_decoder"]
    assert abs(unmatched["inference_flops_per_token"] / ref - 1) > 0.03
    longer = _rows(_expand(tmp_path, "inference_context=512"), tmp_path)["causal_decoder"]
    assert longer["inference_flops_per_token"] > ref and longer["inference_context"] == 512


def test_equal_loss_tokens_matches_the_full_lm_decoder(tmp_path):
    runs = _expand(tmp_path, "matching=equal_loss_tokens", "budget.steps=4")
    xs = {r.cfg.name.split(".")[1]: r for r in runs if r.size == "xs"}
    per_row = {k: matching.loss_tokens_per_row(r.cfg) for k, r in xs.items()}
    reference = 4 * matching.loss_tokens_per_row(
        xs["causal_decoder"].cfg.replace(
            objective=xs["causal_decoder"].cfg.objective.replace(name="flm")
        )
    )
    for k, r in xs.items():  # equal up to rounding to whole steps
        assert abs(r.cfg.train.steps * per_row[k] - reference) <= per_row[k] / 2 + 1e-9


def test_seeds_vary_data_order_and_seed_zero_keeps_the_base(tmp_path):
    runs = _expand(tmp_path, seeds=[0, 1, 2], base={"data": {"seed": 10}})
    seeds = {(r.seed, r.cfg.data.seed) for r in runs}
    assert seeds == {(0, 10), (1, 11), (2, 12)}
    assert {r.row("t", tmp_path)["data_seed"] for r in runs} == {10, 11, 12}


def test_registry_records_consumed_tokens_and_upgrades_an_old_file(tmp_path):
    path = tmp_path / "registry.sqlite"
    with sqlite3.connect(path) as c:  # a registry from before the consumed-token columns
        c.execute("CREATE TABLE runs (run_id TEXT PRIMARY KEY, name TEXT, status TEXT)")
        c.execute("INSERT INTO runs VALUES ('old', 'x', 'done')")
    with Registry(path) as reg:
        reg.add_runs([{"run_id": "a", "name": "a"}, {"run_id": "b", "name": "b"}])
        reg.finish("a", {"tokens": 5.0, "document_tokens": 7.0, "loss_tokens": 3.0})
        reg.finish("b", {"tokens": 5.0, "positions": 9.0})  # an older summary
    got = {r["run_id"]: r for r in load_runs(path)}
    assert (got["a"]["document_tokens"], got["a"]["loss_tokens"]) == (7.0, 3.0)
    assert (got["b"]["document_tokens"], got["b"]["loss_tokens"]) == (None, 5.0)
    assert got["b"]["positions"] == 9.0 and got["old"]["status"] == "done"
