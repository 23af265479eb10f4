"""Matching modes: equal documents, loss-bearing tokens and inference cost; seeds vary data
order; the registry records what each run consumed."""

import sqlite3

import pytest

from scalestudy.study import matching, sweep
from scalestudy.study.registry import Registry, load_runs

from .conftest import write_spec

pytest.importorskip("scalestudy.models.counting")

PLM_CELLS = [["causal_decoder", "plm"], ["noncausal_decoder", "plm"], ["encoder_decoder", "plm"]]


def _expand(tmp_path, *overrides, **spec):
    path = write_spec(tmp_path / "s.yaml", **{"cells": PLM_CELLS, **spec})
    return sweep.expand(sweep.load_study(path, list(overrides)), path.parent)


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
