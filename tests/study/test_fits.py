"""The input side of `scalestudy fit`: a study registry (file or directory) read as a table."""

from types import SimpleNamespace

import numpy as np
import pytest

from scalestudy.scaling.laws import FitSettings, fit_cells
from scalestudy.scaling.table import DataSettings, ScalingDataError
from scalestudy.study.plan.spec import FitConfig
from scalestudy.study.record.rows import RunRow
from scalestudy.study.report.fits import load_table, registry_table


def _registry(path, runs):
    from scalestudy.study.record.registry import Registry

    with Registry(path) as reg:
        reg.add_runs([{k: v for k, v in r.items() if k != "summary"} for r in runs])
        for r in runs:
            if "summary" in r:
                s = r["summary"]
                curve = [
                    {
                        "step": st,
                        "train/loss": s["final_val_loss"] + 1.0 / st,
                        "flops": s["flops"] * st / 4,
                        "tokens": s["tokens"] * st / 4,
                    }
                    for st in (1, 2, 3, 4)
                ]
                reg.finish(r["run_id"], s, curves=curve)


def _isoflop(budgets=(1e18, 1e19, 1e20), sizes=5):
    """Runs on IsoFLOP budgets (C = 6ND) whose loss follows a Chinchilla law exactly."""
    N = np.concatenate([np.geomspace(c**0.5 / 40, c**0.5 / 2, sizes) for c in budgets])
    C = np.repeat(budgets, sizes)
    D = C / (6 * N)
    return SimpleNamespace(N=N, D=D, C=C, loss=1.69 + 406.4 / N**0.34 + 410.7 / D**0.28)


def test_study_registry_runs_and_curves(tmp_path):
    iso = _isoflop()
    runs = []
    for i in range(len(iso.N)):
        n, d = float(iso.N[i]), float(iso.D[i])
        runs.append(
            {
                "run_id": f"r{i}",
                "arch": "causal_decoder",
                "objective": "flm",
                "params_total": int(n * 1.1),
                "params_non_embedding": int(n),
                "budget": f"C{iso.C[i]:.0e}",
                "summary": {
                    "tokens": d / 2,
                    "positions": d,
                    "flops": 6.3 * n * d,
                    "flops_6nd": 6 * n * d,
                    "final_val_loss": float(iso.loss[i]),
                    "eval": {"copa/acc": 0.5 + 0.01 * i},
                },
            }
        )
    runs.append({"run_id": "unfinished", "arch": "causal_decoder", "objective": "flm"})
    _registry(tmp_path / "registry.sqlite", runs)
    t = load_table(tmp_path)  # a study directory
    assert len(t.run_id) == len(iso.N) and t.choices["unfinished_runs_left_out"] == 1
    np.testing.assert_allclose(t.N, np.floor(iso.N))  # non-embedding by default
    np.testing.assert_allclose(t.D, iso.D)  # positions by default
    assert t.cells() == ["causal_decoder/flm"]
    assert "eval/copa/acc" in t.extra and len(t.curves) == len(iso.N)
    # A curve point at a quarter of training has a quarter of the run's C and D.
    c = t.curves["r0"]
    np.testing.assert_allclose(c["C"], t.C[0] * np.array([0.25, 0.5, 0.75, 1.0]))
    t6 = load_table(tmp_path / "registry.sqlite", DataSettings(c_kind="6nd", n_kind="total"))
    np.testing.assert_allclose(t6.C, 6 * t6.N * t6.D)
    res = fit_cells(t, settings=FitSettings(laws=("chinchilla2",), bootstrap=20))
    fit = res["cells"]["causal_decoder/flm"]["fits"]["chinchilla2"]
    assert fit["n_budgets"] == 3  # grouped by the registry's budget labels


def test_runs_the_studys_spec_no_longer_plans_are_left_out_and_named(tmp_path, capsys):
    """`scalestudy fit` of a study directory fits what the study's report fits: the runs its
    spec planned when it last ran; the registry keeps the others, named in the output."""
    from scalestudy.cli import main as cli
    from scalestudy.study.record.registry import Registry

    iso = _isoflop(budgets=(1e18, 1e19), sizes=4)
    runs = [
        {
            "run_id": f"r{i}",
            "name": f"run{i}",
            "arch": "causal_decoder",
            "objective": "flm",
            "params_total": int(iso.N[i] * 1.1),
            "params_non_embedding": int(iso.N[i]),
            "summary": {
                "tokens": float(iso.D[i]) / 2,
                "positions": float(iso.D[i]),
                "flops": 6.0 * iso.N[i] * iso.D[i],
                # The last run's loss is far off the law: fitted, it would move every number.
                "final_val_loss": float(iso.loss[i]) * (3.0 if i == len(iso.N) - 1 else 1.0),
            },
        }
        for i in range(len(iso.N))
    ]
    _registry(tmp_path / "registry.sqlite", runs)
    everything = load_table(tmp_path)  # a registry from before plans were recorded: all runs
    assert len(everything.run_id) == len(runs)
    assert "unplanned_runs_left_out" not in everything.choices
    gone = runs[-1]
    with Registry(tmp_path / "registry.sqlite") as reg:
        reg.set_plan(r["run_id"] for r in runs[:-1])
    table = load_table(tmp_path)
    assert table.run_id == [r["run_id"] for r in runs[:-1]]
    assert gone["run_id"] not in table.curves
    assert table.choices["unplanned_runs_left_out"] == [gone["name"]]
    argv = ["fit", str(tmp_path), "--law", "kaplan_n", "--bootstrap", "0"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "left out: 1 run(s) of the registry that the study's spec no longer plans (run7)" in (
        printed
    )
    assert f"{len(runs) - 1} runs" in printed
    assert cli.main([*argv, "--all-runs"]) == 0  # asked for, every run of the registry
    printed = capsys.readouterr().out
    assert "left out" not in printed and f"{len(runs)} runs" in printed
    (tmp_path / "runs.csv").write_text("N,loss\n1e6,3.0\n")
    with pytest.raises(ScalingDataError, match="--all-runs selects a study registry's runs"):
        load_table(tmp_path / "runs.csv", DataSettings(all_runs=True))
    with Registry(tmp_path / "registry.sqlite") as reg:
        reg.set_plan([])
    with pytest.raises(ScalingDataError, match="none of its 8 runs is planned"):
        load_table(tmp_path)


def test_registry_directories_that_cannot_be_read_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ScalingDataError, match="no study registry"):
        load_table(tmp_path / "empty")
    for name in ("a.sqlite", "b.db"):
        _registry(tmp_path / name, [])
    with pytest.raises(ScalingDataError, match="several registries"):
        load_table(tmp_path)
    with pytest.raises(ScalingDataError, match="no runs to fit"):
        load_table(tmp_path / "a.sqlite", DataSettings())
    # A registry's curves are training losses logged mid-schedule: never ends of schedules.
    with pytest.raises(ScalingDataError, match="mid-schedule"):
        registry_table([RunRow("r", loss=1.0)], [], DataSettings(curve_points="finished"))


def _task_rows(cell: str, sizes: int, groups: tuple[str, ...] = ()) -> list[RunRow]:
    """Runs of one cell at `sizes` sizes whose task loss and accuracy follow known laws: task
    `mc` and its groups `mc/<g>` (each group a little harder)."""
    arch, objective = cell.split("/")
    rows = []
    for i, n in enumerate(np.geomspace(1e5, 1e7, 6)[:sizes]):
        row = {
            "run_id": f"{cell}-{i}",
            "arch": arch,
            "objective": objective,
            "params_total": n * 1.1,
            "params_non_embedding": n,
            "positions": 1e7,
            "tokens": 1e7,
            "flops": 6 * n * 1e7,
            "loss": 2.0 + 10.0 / n**0.2,
        }
        for j, name in enumerate(("mc", *(f"mc/{g}" for g in groups))):
            task_loss = 0.5 + 0.1 * j + 30.0 / n**0.3
            row[f"eval/{name}/task_loss"] = task_loss
            row[f"eval/{name}/acc"] = 0.25 + 0.7 / (1.0 + np.exp(6.0 * (task_loss - 1.2)))
            row[f"eval/{name}/chance"] = 0.25
            row[f"eval/{name}/n"] = 500
        rows.append(RunRow.from_row(row))
    return rows


def _settings(bootstrap: int = 4):
    from scalestudy.scaling.laws import FitSettings

    return FitSettings(data=DataSettings(n_kind="non_embedding"), bootstrap=bootstrap)


def test_a_study_with_task_losses_gets_task_laws_and_their_backtest_in_the_report(tmp_path):
    from scalestudy.scaling.task_law_plots import task_law_figures
    from scalestudy.study.report.task_law_report import (
        MIN_SIZES_BACKTEST,
        MIN_SIZES_FIT,
        section,
        study_task_laws,
    )

    rows = _task_rows("causal_decoder/flm", 6, groups=("a",))
    rows += _task_rows("noncausal_decoder/plm", MIN_SIZES_FIT)
    rows += _task_rows("encoder_decoder/mlm", MIN_SIZES_FIT - 1)
    s = _settings()
    table = registry_table(rows, [], s.data)
    fits = {"cells": {"any": {}}, "settings": {"bootstrap": 4}}
    fits["task_laws"] = study_task_laws(table, s)
    cells = fits["task_laws"]["cells"]
    assert sorted(cells["causal_decoder/flm"]) == ["mc", "mc/a"]  # groups fitted too
    law = cells["causal_decoder/flm"]["mc/a"]
    assert law["task_loss"]["form"] == "kaplan_n"  # one D for every size: a law in N
    bt = law["backtest"]
    assert bt["N"] == pytest.approx(1e7) and abs(bt["error"]) < 0.05
    # Four sizes fit a law but leave too few for the backtest; three fit nothing.
    assert "skipped" in cells["noncausal_decoder/plm"]["mc"]["backtest"]
    assert "skipped" not in cells["noncausal_decoder/plm"]["mc"]
    assert "at least 4 runs" in cells["encoder_decoder/mlm"]["mc"]["skipped"]
    names = {p.name for p in task_law_figures(table, fits, tmp_path)}
    assert names == {
        f"task_law_{c}.{ext}"
        for c in ("causal_decoder_flm", "noncausal_decoder_plm")
        for ext in ("png", "svg")
    }
    text = "\n".join(section(fits))
    assert "## Zero-shot task laws" in text and "nats per UTF-8 byte" in text
    assert f"a law needs {MIN_SIZES_FIT} sizes and its backtest {MIN_SIZES_BACKTEST}" in text
    assert f"| causal_decoder/flm | mc/a | 1e+07 | {bt['observed']:.3f}" in text
    assert f"{bt['error']:+.3f}" in text and "over 2 backtest(s)" in text
    assert "- noncausal_decoder/plm, backtest of mc: too few sizes" in text
    assert "- encoder_decoder/mlm, task law of mc: 3 run(s)" in text


def test_task_laws_take_their_own_number_of_resamples(tmp_path):
    """`fit.task_bootstrap` sets the task laws' resamples (each refits both steps) apart from
    the loss laws' `bootstrap`; unset, both take `bootstrap`."""
    from scalestudy.study.report import fits
    from scalestudy.study.report.task_law_report import section

    rows = _task_rows("causal_decoder/flm", 6)
    for task_bootstrap, want in ((None, 7), (3, 3)):
        fit = FitConfig(laws=["kaplan_n_noE"], bootstrap=7, task_bootstrap=task_bootstrap)
        got, _ = fits.fit_study(SimpleNamespace(fit=fit), tmp_path, rows, [])
        assert got["settings"]["bootstrap"] == 7
        assert got["task_laws"]["bootstrap"] == want
        assert f"come from {want} bootstrap resamples" in "\n".join(section(got))


def test_a_study_without_task_losses_says_why_it_has_no_task_laws():
    from scalestudy.study.report.task_law_report import section, study_task_laws

    rows = _task_rows("causal_decoder/flm", 5)
    rows = [
        r.replace(evals={k: v for k, v in r.evals.items() if k != "eval/mc/task_loss"})
        for r in rows
    ]
    s = _settings(0)
    fits = {"cells": {"any": {}}, "task_laws": study_task_laws(registry_table(rows, [], s.data), s)}
    text = "\n".join(section(fits))
    assert "Task laws were not fitted: no run has a task loss" in text


def test_a_registry_of_moe_runs_fits_the_moe_laws_on_active_parameters(tmp_path):
    """A study plans each run's MoE shape into the registry (active parameters, experts,
    granularity); `n_kind: active` and the `experts` column give Clark et al.'s law."""
    from scalestudy.study.run.main_job import expand, load_study
    from tests.study.conftest import write_spec

    moe = {"enabled": True, "routed_experts": 8, "top_k": 2, "d_expert": 16}
    spec = write_spec(tmp_path / "moe.yaml", base={"model": {"moe": moe}})
    (run, *_) = expand(load_study(spec), tmp_path)
    row = run.row("moe", tmp_path / "r")
    assert row["experts"] == 8 and row["granularity"] == run.cfg.model.d_ff / 16
    assert row["params_active"] < row["params_non_embedding"]
    a, b, c, d = -0.08, -0.1, 0.01, 1.1
    runs = []
    for i, (n, e) in enumerate((n, e) for n in (1e6, 3e6, 1e7, 3e7) for e in (1, 4, 16)):
        loss = 10 ** (a * np.log10(n) + b * np.log10(e) + c * np.log10(n) * np.log10(e) + d)
        runs.append(
            {
                "run_id": f"r{i}",
                "arch": "causal_decoder",
                "objective": "flm",
                "params_total": int(n * e),
                "params_non_embedding": int(n * e),
                "params_active": int(n),
                "experts": e,
                "granularity": 1.0,
                "summary": {"tokens": 20 * n, "positions": 20 * n, "flops": 120 * n * n,
                            "final_val_loss": float(loss)},
            }
        )  # fmt: skip
    _registry(tmp_path / "registry.sqlite", runs)
    table = load_table(tmp_path, DataSettings(n_kind="active"))
    np.testing.assert_allclose(table.N, [int(r["params_active"]) for r in runs])
    np.testing.assert_allclose(table.extra["E"], [r["experts"] for r in runs])
    res = fit_cells(table, settings=FitSettings(laws=("clark_ne",), bootstrap=0))
    params = res["cells"]["causal_decoder/flm"]["fits"]["clark_ne"]["params"]
    got = [params[k]["value"] for k in "abcd"]
    np.testing.assert_allclose(got, [a, b, c, d], atol=1e-4)  # active N, rounded to integers


def test_a_studys_variants_are_fitted_alone_unless_the_law_takes_their_experts(tmp_path):
    """Two variants of one cell on different power laws: a dense law fits each alone (one
    fit over both would blend their exponents); an MoE law, whose inputs hold what the
    variants differ in, fits them together."""
    from scalestudy.study.report import fits

    assert fits.pools_variants(["clark_ne"]) and fits.pools_variants(["kaplan_n", "krajewski_ndg"])
    assert not fits.pools_variants(["kaplan_n", "chinchilla3", "auto"])
    runs = []
    for variant, alpha in (("rope", 0.3), ("nope", 0.15)):
        for i, n in enumerate((1e5, 3e5, 1e6, 3e6, 1e7)):
            runs.append(RunRow(**
                {"run_id": f"{variant}{i}", "name": f"t.causal_decoder.flm.{variant}.s{i}.s0",
                 "size": f"s{i}", "arch": "causal_decoder", "objective": "flm",
                 "params_total": n, "params_non_embedding": n, "positions": 20 * n,
                 "tokens": 20 * n, "flops": 120 * n * n, "loss": (8e4 / n) ** alpha})
            )  # fmt: skip
    fit = FitConfig(laws=["kaplan_n_noE"], n_kind="non_embedding", c_kind="counted", bootstrap=0)
    got, _ = fits.fit_study(SimpleNamespace(fit=fit), tmp_path, runs, [])
    assert set(got["cells"]) == {"causal_decoder/flm/rope", "causal_decoder/flm/nope"}
    for variant, alpha in (("rope", 0.3), ("nope", 0.15)):
        params = got["cells"][f"causal_decoder/flm/{variant}"]["fits"]["kaplan_n_noE"]["params"]
        assert params["alpha_N"]["value"] == pytest.approx(alpha, rel=1e-3)


def test_the_reports_fits_label_a_law_over_rungs_of_their_own_steps_l_of_n_and_d_of_n():
    from scalestudy.scaling.table import RunTable
    from scalestudy.study.report.fits import fits_lines

    N = np.repeat([14e3, 25e3, 38e3, 84e3], 3)
    D = N * 10 * (1 + 1e-3 * np.arange(N.size))  # each rung its own steps; seeds' jitter
    loss = (0.37 + (7600.0 / N) ** 1.46) * np.exp(np.random.default_rng(0).normal(0, 0.02, 12))
    t = RunTable([f"r{i}" for i in range(12)], ["a"] * 12, N, D, 6 * N * D, loss)
    t.choices = {"groups": []}
    lines = fits_lines(fit_cells(t, FitSettings(laws=("kaplan_n",), bootstrap=20)))
    (row,) = [line for line in lines if line.startswith("| a | kaplan_n |")]
    assert "L(N, D(N)) = (N_c/N)^alpha_N + E" in row
    assert any(line.startswith("L(N, D(N)): each rung trains its own step count") for line in lines)
