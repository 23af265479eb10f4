"""Learning rates chosen on held-out text: the search never scores a task, trains a seed of its
own, its choice is the lowest validation loss (the rates extended past an end the choice lies
at), the study's runs, every scored seed, train at it, and no search run enters the study."""

import json
import math
import re
from pathlib import Path

import pytest

from scalestudy.cli import main as cli
from scalestudy.config.errors import ConfigError
from scalestudy.study.record.registry import Registry, load_runs
from scalestudy.study.record.rows import RunRow
from scalestudy.study.report import lr_report
from scalestudy.study.report.lr_report import CHOICE
from scalestudy.study.run import after_pretraining, lr_search, main_job
from scalestudy.train.rundir import layout as rundir
from tests.study.conftest import write_spec

RATES = [1e-3, 3e-2]


def _spec(tmp_path: Path, **changes) -> Path:
    spec = {
        "cells": [["causal_decoder", "flm"]],
        "seeds": [0, 1],
        "lr_search": {"rates": RATES, "sizes": ["xs"], "extensions": 0},
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
    study = main_job.load_study(spec)
    make_eval_fn = rank.make_eval_fn

    def refuse(*args, **kwargs):
        raise AssertionError("the learning-rate search scored a task")

    monkeypatch.setattr(rank, "make_eval_fn", refuse)
    rate, search_runs = lr_search.train_search(study, spec.parent, out, main_job.expand, members=2)
    assert not (out / "runs").exists()  # the search writes only under OUT/lr_search
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
    # The first seed trained in the study, on its own: not a search run (its own seed).
    first = runs["xss0"]
    assert first["run_id"] not in {r.run_id for r in search_runs}
    assert first["eval/synthetic_probes/acc"] is not None and first["seed"] == 0
    assert {r.seed for r in search_runs} == {study.lr_search.seed} != 0
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
    grid = (*RATES, 1.0)
    tried = [(grid[i % 3], r) for i, r in enumerate(runs)]
    chosen = lr_search.choose(tried, losses, grid)
    a, c = (
        chosen[("causal_decoder", "flm", "", "a", "")],
        chosen[("causal_decoder", "flm", "", "c", "")],
    )
    assert a["chosen_index"] == 1 and not a["edge"] and c["chosen_index"] == 0 and c["edge"]
    assert a["extended"] == c["extended"] == 0 and a["rates"] == list(grid)
    start = math.log(100)
    assert a["sensitivity"] == pytest.approx((3.0 + 2.0 + start) / 3 - 2.0)
    assert c["sensitivity"] == pytest.approx((2.5 + 2.6 + start) / 3 - 2.5)  # 9.0 capped
    rate = lr_search.rate_for(chosen, {"a": 0, "b": 1, "c": 2, "d": 3})
    point = ("causal_decoder", "flm", "", "{}", "")
    assert [rate(tuple(p.format(s) for p in point)) for s in "abcd"] == [3e-2, 3e-2, 1e-3, 1e-3]
    with pytest.raises(Exception, match="every rate diverged"):
        lr_search.choose(tried[:3], {"a0": None, "a1": math.nan}, grid)


def test_the_report_says_which_cells_swap_at_their_runner_up_rates():
    """Cells of one objective and size ordered by held-out loss at their chosen and at their
    runner-up rates; a cell alone, or with one finite loss, says nothing."""
    from scalestudy.study.report import lr_report

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
            main_job.load_study(_spec(tmp_path, lr_search=bad))
    study = main_job.load_study(_spec(tmp_path, lr_search={"rates": RATES, "sizes": ["xl"]}))
    with pytest.raises(ConfigError, match=r"lr_search.sizes: \['xl'\] are not sizes"):
        lr_search.plan_search(study, tmp_path, main_job.expand)
    spec = _spec(tmp_path)
    with pytest.raises(ConfigError, match="chooses its learning rates first"):
        after_pretraining.launch(spec, "slurm", tmp_path / "out", submit=False)
    with pytest.raises(ConfigError, match="--collect: this study chooses"):
        main_job.run_study(spec, tmp_path / "out", collect=True)
    assert not (tmp_path / "out" / "runs").exists()


def test_the_dry_run_counts_the_search(tmp_path, capsys):
    argv = ["study", "--spec", str(_spec(tmp_path)), "--dry-run", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    assert "lr_search first: 2 runs" in capsys.readouterr().out


# Where each fake cell's held-out loss is lowest: inside the grid, just past its top (found by
# extending), and far past it (still at the end after the extensions).
OPTIMUM = {"causal_decoder": 2e-2, "noncausal_decoder": 1e-1, "encoder_decoder": 1.0}
GRID = [1e-2, 2e-2, 4e-2]


def _fake_train(cfg, workdir):
    """A search run's loss is a bowl in log rate around its cell's optimum, offset by 77 so
    that a search run read anywhere in the study shows; a scored run's loss is near 1."""
    rate, optimum = cfg.optim.learning_rate, OPTIMUM[cfg.model.arch]
    if "lr_search" in str(workdir):
        loss = 77.0 + math.log10(rate / optimum) ** 2
    else:
        loss = 1.0 + 0.01 * cfg.train.seed
    summary = {"steps": cfg.train.steps, "tokens": 1.0, "flops": 1.0, "final_val_loss": loss}
    summary["eval"] = {"synthetic_probes/acc": 0.5}
    (workdir / "summary.json").write_text(json.dumps(summary))
    return summary


def _fake_study(tmp_path: Path, **search) -> tuple[Path, Path]:
    cells = [["causal_decoder", "flm"], ["noncausal_decoder", "plm"], ["encoder_decoder", "mlm"]]
    spec = _spec(
        tmp_path,
        cells=cells,
        seeds=[0, 1],
        lr_search={"rates": GRID, "sizes": ["xs"], **search},
    )
    return spec, tmp_path / "out"


def test_a_choice_at_an_end_of_the_grid_is_extended_at_most_twice_and_named(tmp_path):
    spec, out = _fake_study(tmp_path)
    main_job.run_study(spec, out, train_fn=_fake_train)
    got = {rec["point"][0]: rec for rec in json.loads((out / "lr_search" / CHOICE).read_text())}
    inside, past, far = (got[a] for a in ("causal_decoder", "noncausal_decoder", "encoder_decoder"))
    assert inside["rates"] == GRID and inside["extended"] == 0 and not inside["edge"]
    # 4e-2 won at the top, so 8e-2 was tried; it won and was at the top, so 1.6e-1 was
    # tried, which lost: 8e-2 is interior now.
    assert past["rates"] == [*GRID, 8e-2, 1.6e-1] and past["extended"] == 2
    assert past["rates"][past["chosen_index"]] == 8e-2 and not past["edge"]
    assert far["rates"] == [*GRID, 8e-2, 1.6e-1] and far["extended"] == 2 and far["edge"]
    rates = {(r["arch"], r["seed"]): r["recipe"]["optim.learning_rate"] for r in load_runs(out)}
    assert rates[("noncausal_decoder", 0)] == rates[("noncausal_decoder", 1)] == 8e-2
    assert rates[("encoder_decoder", 0)] == 1.6e-1 and rates[("causal_decoder", 1)] == 2e-2
    report = (out / "report.md").read_text()
    cannot = report[report.index("## What this study cannot tell") :]
    cannot = cannot[: cannot.index("\n## ", 1)]
    assert "still at an end of the rates tried, after up to 2 added beyond it: " in cannot
    assert "encoder_decoder/mlm at xs." in cannot and "noncausal_decoder/plm at xs" not in cannot
    with Registry(out / "lr_search" / "registry.sqlite") as reg:
        assert len(reg.runs()) == 3 + 5 + 5  # two cells extended twice, none further
    # A lower end extends downwards in the grid's ratio, and an extension can be switched off.
    assert lr_search.beyond({"rates": [4e-2, 8e-2, 1.6e-1], "chosen_index": 0}) == 2e-2
    (tmp_path / "none").mkdir()
    spec, out = _fake_study(tmp_path / "none", extensions=0)
    main_job.run_study(spec, out, train_fn=_fake_train)
    assert all(rec["rates"] == GRID for rec in json.loads((out / "lr_search" / CHOICE).read_text()))


def test_no_search_run_enters_the_study_registry_its_verdicts_fits_or_tables(tmp_path):
    spec, out = _fake_study(tmp_path, extensions=0)
    _, runs = main_job.run_study(spec, out, train_fn=_fake_train)
    with Registry(out / "lr_search" / "registry.sqlite") as reg:
        searched = {r["run_id"]: r for r in reg.runs()}
    scored = load_runs(out)
    assert searched and {r["seed"] for r in searched.values()} == {1000}
    assert not set(searched) & {r["run_id"] for r in scored}
    # Every scored seed trained in the study itself, and only those.
    assert sorted((r["arch"], r["size"], r["seed"]) for r in scored) == sorted(
        (a, z, s) for a in OPTIMUM for z in ("xs", "s") for s in (0, 1)
    )
    assert len(runs) == len(scored) and all(r["loss"] < 2 for r in scored)
    report = (out / "report.md").read_text()
    rates = report[report.index("## Learning rates") :]
    rates = rates[: rates.index("\n## ", 1)]
    outside = report.replace(rates, "")
    assert re.findall(r"\b77\.\d{3}", rates) and not re.findall(r"\b77\.\d", outside)
    assert "seed 1000, none of the scored seeds" in rates


def test_the_search_seed_may_not_be_a_scored_seed(tmp_path):
    for seed, match in ((0, r"seeds \[0, 1\]"), (3, r"repeat_seeds \[3\]")):
        search = {"rates": RATES, "sizes": ["xs"], "seed": seed}
        spec = _spec(tmp_path, lr_search=search, repeat_seeds={"seeds": [3], "sizes": ["xs"]})
        with pytest.raises(ConfigError, match=rf"lr_search.seed: {seed} is one of .*{match}"):
            main_job.load_study(spec)
    study = main_job.load_study(_spec(tmp_path))
    assert study.lr_search.seed not in study.seeds


def _record(arch, objective, size, rates, losses, peak=None, edge=False):
    i = losses.index(min(v for v in losses if v is not None))
    return {
        "point": [arch, objective, "", size, ""],
        "rates": rates,
        "peak": peak or rates,
        "loss": losses,
        "chosen_index": i,
        "edge": edge,
        "most": 2,
    }


def _scored(arch, objective, size, index, losses, layers, peak):
    return [
        RunRow(
            name=f"t.{arch}.{objective}.{size}.s{s}",
            arch=arch,
            objective=objective,
            size=size,
            size_index=index,
            status="done",
            loss=v,
            n_layers=layers,
            n_encoder_layers=layers if arch == "encoder_decoder" else None,
            recipe={"optim.learning_rate": peak},
        )
        for s, v in enumerate(losses)
    ]


def test_what_the_search_cannot_tell_names_close_choices_ends_depth_and_unsearched_rates():
    """A choice within one seed sd of its runner-up is named, one beyond it is not; a choice
    at an end is named; a rung at another depth or past the rates tried is named."""
    records = [  # margins 0.01 (sd 0.02: close) and 0.1 (sd 0.02: clear)
        _record("causal_decoder", "flm", "20K", [1e-2, 2e-2, 4e-2], [2.0, 1.5, 1.51]),
        _record("encoder_decoder", "plm", "20K", [1e-2, 2e-2, 4e-2], [2.0, 1.4, 1.5]),
        _record("noncausal_decoder", "mlm", "20K", [1e-2, 2e-2], [1.0, 1.2], edge=True),
    ]
    runs = [
        *_scored("causal_decoder", "flm", "20K", 1, [1.50, 1.52, 1.54], 2, 2e-2),
        *_scored("encoder_decoder", "plm", "20K", 1, [1.40, 1.42, 1.44], 2, 2e-2),
        *_scored("causal_decoder", "flm", "40K", 2, [1.2, 1.3], 3, 2e-2),
        *_scored("encoder_decoder", "plm", "14K", 0, [1.9, 2.0], 2, 5.3e-2),
        *_scored("noncausal_decoder", "mlm", "20K", 1, [1.0, 1.1], 2, 1e-2),
    ]
    lines = lr_report.cannot_tell(records, runs)
    text = "\n".join(lines)
    assert all(line.startswith("- ") for line in lines)
    assert "causal_decoder/flm at 20K (0.02 over 0.04 by 0.010, 0.5 sd)" in text
    assert "encoder_decoder/plm at 20K (" not in text  # 5 sd: a clear choice
    assert "after up to 2 added beyond it: noncausal_decoder/mlm at 20K." in text
    assert "40K (3 layers) from 20K (2 layers): causal_decoder/flm" in text
    assert "14K (" not in text  # the same depth as the searched size
    # The 14K rung's peak lies above every rate tried; the 40K rung's inside them.
    assert "tried for the cell (the ladder's rate rule carried them there): " in text
    assert "encoder_decoder/plm 14K at 0.053." in text and "40K at" not in text
    assert lr_report.cannot_tell([], runs) == []


def test_the_main_jobs_deeper_rungs_and_rates_past_the_search_are_named():
    """The shipped smoke ladder goes from 2 layers at 20K (searched) to 3 at 40K and 70K at the
    same width; the width rule cannot see that, so the report names those rungs, per stack
    shape, and a 14K rung the rule carries above every searched rate."""
    spec = Path(__file__).parents[2] / "configs" / "studies" / "smoke.yaml"
    study = main_job.load_study(spec)
    grid = list(study.lr_search.rates)
    top = ("noncausal_decoder", "plm")  # chose the grid's top rate: 14K trains above it

    def chosen(p):
        return grid[-1] if p[:2] == top else grid[1]

    runs = [
        RunRow(
            name=r.cfg.name,
            arch=r.arch,
            objective=r.objective,
            size=r.size,
            size_index=r.size_index,
            status="done",
            loss=1.0 + 0.01 * r.seed,
            n_layers=r.cfg.model.n_layers,
            n_encoder_layers=r.cfg.model.encoder_layers if r.cfg.model.is_encoder_decoder else None,
            recipe={"optim.learning_rate": r.cfg.optim.learning_rate},
        )
        for r in main_job.expand(study, spec.parent, rates=chosen)
    ]
    cells = sorted({(r.arch, r.objective) for r in runs})
    records = [
        _record(a, o, "20K", grid, [2.0, 1.0, 1.5, 1.7] if (a, o) != top else [2, 1.8, 1.5, 1.0])
        for a, o in cells
    ]
    text = "\n".join(lr_report.cannot_tell(records, runs))
    decoders = "causal_decoder/flm, causal_decoder/plm, noncausal_decoder/plm"
    for size in ("40K", "70K"):
        assert f"{size} (3 layers) from 20K (2 layers): {decoders}" in text
        assert f"{size} (3+3 layers) from 20K (2+2 layers): encoder_decoder/plm" in text
    assert "mlm" not in text.split("Depth")[1].split("\n")[0]  # MLM cells train at 20K only
    assert "noncausal_decoder/plm 14K at 0.213." in text
