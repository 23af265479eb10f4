"""The decoder-only experiments: spec variants, their statistics, and the whole suite end to end
at tiny scale."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from scalestudy.cli import main as cli
from scalestudy.config.errors import ConfigError
from scalestudy.decoder_only import experiments as decoder_only_run
from scalestudy.study.plan.spec import ComparisonConfig
from scalestudy.study.record.registry import load_runs
from scalestudy.study.record.rows import RunRow
from scalestudy.study.run.main_job import expand, load_study

from .conftest import write_spec

CELLS = [
    ["causal_decoder", "plm"],
    ["noncausal_decoder", "plm"],
    ["encoder_decoder", "plm"],
    ["noncausal_decoder", "mlm"],
]
VARIANTS = [
    {"name": "base", "cells": CELLS[:2]},
    {"name": "eqparams", "matching": "equal_total_params", "cells": [CELLS[2]]},
    {"name": "nope", "model": {"position": "none"}, "cells": [CELLS[0]]},
    {"name": "bidir", "cells": [CELLS[3]]},
    {"name": "mixlayers", "model": {"attention": "mixed_layers"}, "cells": [CELLS[3]]},
]
CD, NCM = "causal_decoder/plm/base", "noncausal_decoder/mlm"
LADDER = {"sizes": [{"name": "xs", "d_model": 16, "n_layers": 2, "d_ff": 32}]}


def _spec(tmp_path, **changes):
    return write_spec(
        tmp_path / "tiny.yaml",
        **{"cells": CELLS, "variants": VARIANTS, "ladder": LADDER, **changes},
    )


def test_variants_expand_with_their_matching_and_model_keys(tmp_path):
    spec = _spec(tmp_path, matching="equal_flops")
    runs = expand(load_study(spec), spec.parent)
    names = [r.cfg.name.split(".", 1)[1] for r in runs]
    assert names == [
        "causal_decoder.plm.base.xs.s0",
        "causal_decoder.plm.nope.xs.s0",
        "noncausal_decoder.plm.base.xs.s0",
        "encoder_decoder.plm.eqparams.xs.s0",
        "noncausal_decoder.mlm.bidir.xs.s0",
        "noncausal_decoder.mlm.mixlayers.xs.s0",
    ]
    by = {r.variant: r for r in runs}
    assert by["nope"].cfg.model.position == "none"
    assert by["mixlayers"].cfg.model.attention == "mixed_layers"
    # The variant's matching replaces the study's: equal parameters, one layer per stack, and
    # the budget's steps (not the equal-FLOPs steps the study would give).
    ed = by["eqparams"]
    assert ed.matching == "equal_total_params" and ed.cfg.model.n_layers == 1
    assert ed.cfg.train.steps == 4
    target = by["base"].params["total"]
    assert abs(ed.params["total"] - target) <= 0.03 * target


def test_variant_errors_name_the_key(tmp_path):
    bad = [{"name": "x", "model": {"postion": "rope"}}]
    with pytest.raises(ConfigError, match=r"postion.*accepted keys"):
        load_study(_spec(tmp_path, variants=bad))
    outside = [{"name": "x", "cells": [["encoder_decoder", "mlm"]]}]
    with pytest.raises(ConfigError, match=r"variants\[x\].cells.*not among"):
        expand(load_study(_spec(tmp_path, variants=outside)), tmp_path)
    with pytest.raises(ConfigError, match="unique"):
        load_study(_spec(tmp_path, variants=[{"name": "a"}, {"name": "a"}]))


def test_missing_group_is_reported_not_fatal():
    spec = ComparisonConfig(title="t", groups=["causal_decoder/plm/base", "absent/x"])
    got = decoder_only_run.compare_groups(spec, {"causal_decoder/plm/base": [RunRow(loss=1.0)]})
    assert got["missing"] == ["absent/x"] and got["tests"] == []


@pytest.mark.slow
def test_decoder_only_suite_end_to_end(tmp_path):
    spec = _spec(
        tmp_path,
        experiments={
            "inference": {
                "turns": 2,
                "user_tokens": 3,
                "reply_tokens": 2,
                "repeats": 1,
                "model": {"d_model": 16, "n_heads": 2},
            },
            "comparisons": [
                {"title": "mask", "groups": [CD, "noncausal_decoder/plm/base"]},
                {"title": "mlm", "groups": [f"{NCM}/bidir", f"{NCM}/mixlayers"]},
                {"title": "encdec", "groups": [CD, "encoder_decoder/plm/eqparams"]},
                {"title": "position", "groups": [CD, "causal_decoder/plm/nope"]},
            ],
            "rank": {"groups": [CD, "noncausal_decoder/plm/base"], "examples": 2},
        },
    )
    out = tmp_path / "study"
    assert cli.main(["study", "--spec", str(spec), "--out", str(out)]) == 0
    assert all(r["status"] == "done" for r in load_runs(out))
    text = (out / "decoder_only.md").read_text()
    assert text.count("**Verdict.**") == 5
    # One head width (8 < n 16): the rank section gives no verdict, and says why.
    assert "**No verdict.** The low-rank argument predicts an interaction" in text
    assert "| entropy |" in text  # beside every rank figure
    for title in ("Multi-turn inference cost", "mask", "mlm", "encdec", "position", "rank"):
        assert title in text
    results = json.loads((out / "decoder_only.json").read_text())
    by = {(r["series"], r["turn"]): r for r in results["inference"]}
    reuse, nc = "causal_decoder (cache reused)", "noncausal_decoder (recomputed)"
    # Turn 1 costs the same to both decoders; from turn 2 reuse needs fewer FLOPs.
    assert by[reuse, 1]["flops_first"] == by[nc, 1]["flops_first"]
    assert by[reuse, 2]["flops_first"] < by[nc, 2]["flops_first"]
    # What runs: the reused cache is a buffer of the whole dialogue, attended in full from
    # turn 1, so at turn 1 it runs more than it needs; recomputation runs at least what it needs.
    assert by[reuse, 1]["flops_first_run"] > by[reuse, 1]["flops_first"]
    assert all(r["flops_first_run"] >= r["flops_first"] for r in results["inference"])
    assert all(r["ttft_s"] <= r["ttft_median_s"] <= r["ttft_max_s"] for r in results["inference"])
    assert all(r["ttft_s"] > 0 and math.isfinite(r["total_s"]) for r in results["inference"])
    rank = results["rank"]["causal_decoder/plm/base"]
    assert sorted({r["step"] for r in rank}) == [2, 4]  # every kept checkpoint
    assert {r["region"] for r in rank} == {"prefix"} and {r["layer"] for r in rank} == {0, 1}
    figures = list((out / "figures" / "decoder_only").glob("*.png"))
    assert len(figures) == 6
    registry = {r["name"].split(".", 1)[1]: r for r in load_runs(out)}
    run_dir = Path(registry["causal_decoder.plm.nope.xs.s0"]["workdir"])
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["model"]["position"] == "none"
