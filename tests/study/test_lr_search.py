"""Learning rates chosen on held-out text: the search never scores a task, its choice is the
lowest validation loss, the study's runs train at it, and the first seed's run is the
search's own."""

import json
import math
from pathlib import Path

import pytest

from scalestudy import cli
from scalestudy.errors import ConfigError
from scalestudy.study import lr_search, pipeline, sweep
from scalestudy.study.registry import load_runs
from scalestudy.train import rundir
from tests.study.conftest import write_spec

RATES = [1e-3, 3e-2]


def _spec(tmp_path: Path, **changes) -> Path:
    spec = {
        "cells": [["causal_decoder", "flm"]],
        "seeds": [0, 1],
        "lr_search": {"rates": RATES, "sizes": ["xs"]},
        "fit": {"laws": [], "bootstrap": 0},
    }
    return write_spec(tmp_path / "lr.yaml", **{**spec, **changes})


def _final_val_loss(workdir: Path) -> float:
    return [r["val/loss"] for r in rundir.read_metrics(workdir) if "val/loss" in r][-1]


@pytest.mark.slow
def test_the_search_reads_no_scored_example_and_the_study_trains_at_its_choice(
    tmp_path, monkeypatch
):
    from scalestudy.evaluate import rank

    spec, out = _spec(tmp_path), tmp_path / "out"
    study = sweep.load_study(spec)
    make_eval_fn = rank.make_eval_fn

    def refuse(*args, **kwargs):
        raise AssertionError("the learning-rate search scored a task")

    monkeypatch.setattr(rank, "make_eval_fn", refuse)
    rate, search_runs = lr_search.run(study, spec.parent, out, sweep.expand, members=2)
    assert len(search_runs) == len(RATES) and {r.size for r in search_runs} == {"xs"}
    # The choice is the lowest final validation loss, read from each run's own metrics.
    losses = {r.cfg.optim.learning_rate: _final_val_loss(r_dir(out, r)) for r in search_runs}
    best = min(losses, key=losses.get)
    assert rate(("causal_decoder", "flm", "", "xs", "")) == best
    assert rate(("causal_decoder", "flm", "", "s", "")) == best  # the nearest searched size
    for r in search_runs:
        assert rundir.read_summary(r_dir(out, r)).get("eval") in (None, {})
    (record,) = json.loads((out / "lr_search" / "choice.json").read_text())
    assert record["loss"] == pytest.approx([losses[x] for x in RATES])

    monkeypatch.setattr(rank, "make_eval_fn", make_eval_fn)
    assert cli.main(["study", "--spec", str(spec), "--out", str(out)]) == 0
    runs = {r["name"].rsplit(".", 2)[-2:][0] + r["name"][-2:]: r for r in load_runs(out)}
    assert len(runs) == 4 and all(r["status"] == "done" for r in runs.values())
    assert {r["recipe"]["optim.learning_rate"] for r in runs.values()} == {best}
    # The first seed's run at the chosen rate is the search's (same id), now evaluated.
    chosen = next(r for r in search_runs if r.cfg.optim.learning_rate == best)
    adopted = runs["xss0"]
    assert adopted["run_id"] == chosen.run_id and adopted["loss"] == losses[best]
    assert adopted["eval/synthetic_probes/acc"] is not None
    report = (out / "report.md").read_text()
    assert report.index("## Learning rates") < report.index("## How to read the comparisons")
    assert f"**{losses[best]:.3f}**" in report and (out / "figures" / "lr_search.png").exists()


def r_dir(out: Path, run) -> Path:
    return out / "lr_search" / "runs" / run.dirname


class _Run:
    def __init__(self, size, index, rate, run_id):
        self.arch, self.objective, self.variant, self.budget = "causal_decoder", "flm", "", ""
        self.size, self.size_index, self.run_id = size, index, run_id

        class _Cfg:
            class optim:
                learning_rate = rate

            class model:
                vocab_size = 100

        self.cfg = _Cfg


def test_the_choice_is_the_lowest_loss_and_a_diverged_rate_counts_as_the_start():
    runs = [_Run("a", 0, r, f"a{i}") for i, r in enumerate([*RATES, 1.0])]
    runs += [_Run("c", 2, r, f"c{i}") for i, r in enumerate([*RATES, 1.0])]
    losses = {"a0": 3.0, "a1": 2.0, "a2": None, "c0": 2.5, "c1": 2.6, "c2": 9.0}
    chosen = lr_search.choose(runs, losses, (*RATES, 1.0))
    a, c = (
        chosen[("causal_decoder", "flm", "", "a", "")],
        chosen[("causal_decoder", "flm", "", "c", "")],
    )
    assert a["chosen_index"] == 1 and not a["edge"] and c["chosen_index"] == 0 and c["edge"]
    start = math.log(100)
    assert a["sensitivity"] == pytest.approx((3.0 + 2.0 + start) / 3 - 2.0)
    assert c["sensitivity"] == pytest.approx((2.5 + 2.6 + start) / 3 - 2.5)  # 9.0 capped
    rate = lr_search.rate_for(chosen, {"a": 0, "b": 1, "c": 2, "d": 3})
    point = ("causal_decoder", "flm", "", "{}", "")
    assert [rate(tuple(p.format(s) for p in point)) for s in "abcd"] == [3e-2, 3e-2, 1e-3, 1e-3]
    with pytest.raises(Exception, match="every rate diverged"):
        lr_search.choose(runs[:3], {"a0": None, "a1": math.nan}, (*RATES, 1.0))


def test_the_report_says_which_cells_swap_at_their_runner_up_rates():
    """Cells of one objective and size ordered by held-out loss at their chosen and at their
    runner-up rates; a cell alone, or with one finite loss, says nothing."""
    from scalestudy.study import lr_report

    def rec(arch, objective, losses):
        finite = [v for v in losses if v is not None]
        point = (arch, objective, "", "20K", "")
        return {"point": point, "loss": losses, "chosen_index": losses.index(min(finite))}

    records = [
        rec("causal_decoder", "plm", [3.0, 2.0, 2.1]),
        rec("noncausal_decoder", "plm", [2.05, 2.5, 2.2]),
        rec("encoder_decoder", "plm", [2.3, 2.4, None]),
        rec("causal_decoder", "flm", [2.0, 2.1, 2.2]),
        rec("encoder_decoder", "mlm", [1.0, None, None]),
        rec("noncausal_decoder", "mlm", [1.1, 1.2, None]),
    ]
    (line,) = lr_report.flips(records)
    assert line == (
        "- PLM at 20K: causal_decoder < noncausal_decoder < encoder_decoder at the chosen "
        "rates; at each cell's runner-up rate causal_decoder < noncausal_decoder < "
        "encoder_decoder (the same order; the best cell stays best)."
    )
    records[1]["loss"][2] = 2.08  # the non-causal decoder's runner-up beats the causal's
    (line,) = lr_report.flips(records)
    assert line.endswith(
        "runner-up rate noncausal_decoder < causal_decoder < encoder_decoder (swapped: "
        "causal_decoder and noncausal_decoder; a new best cell)."
    )


def test_bad_searches_are_one_error_each(tmp_path):
    for bad, match in (
        ({"rates": [1e-3]}, "at least 2"),
        ({"rates": [1e-3, 1e-3]}, "more than once"),
        ({"rates": [1e-3, -1.0]}, "positive"),
    ):
        with pytest.raises(ConfigError, match=match):
            sweep.load_study(_spec(tmp_path, lr_search=bad))
    study = sweep.load_study(_spec(tmp_path, lr_search={"rates": RATES, "sizes": ["xl"]}))
    with pytest.raises(ConfigError, match=r"lr_search.sizes: \['xl'\] are not sizes"):
        lr_search.plan(study, tmp_path, sweep.expand)
    spec = _spec(tmp_path)
    with pytest.raises(ConfigError, match="chooses its learning rates first"):
        pipeline.launch(spec, "slurm", tmp_path / "out", submit=False)
    with pytest.raises(ConfigError, match="--collect: this study chooses"):
        sweep.run_study(spec, tmp_path / "out", collect=True)
    assert not (tmp_path / "out" / "runs").exists()


def test_the_dry_run_counts_the_search(tmp_path, capsys):
    argv = ["study", "--spec", str(_spec(tmp_path)), "--dry-run", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    assert "lr_search first: 2 runs" in capsys.readouterr().out
