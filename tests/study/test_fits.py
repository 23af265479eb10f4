"""The input side of `scalestudy fit`: a study registry (file or directory) read as a table."""

from types import SimpleNamespace

import numpy as np
import pytest

from scalestudy.scaling.laws import FitSettings, fit_cells
from scalestudy.scaling.table import DataSettings, ScalingDataError
from scalestudy.study.fits import load_table, registry_table


def _registry(path, runs):
    from scalestudy.study.registry import Registry

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
        registry_table([{"run_id": "r", "loss": 1.0}], [], DataSettings(curve_points="finished"))


def test_a_study_with_task_losses_gets_task_laws_and_their_backtest_in_the_report(tmp_path):
    from scalestudy.study.fits import fit_study, fits_lines

    rows = []
    for i, n in enumerate(np.geomspace(1e5, 1e7, 6)):
        task_loss = 0.5 + 30.0 / n**0.3
        acc = 0.25 + 0.7 / (1.0 + np.exp(6.0 * (task_loss - 1.2)))
        rows.append(
            {
                "run_id": f"r{i}",
                "arch": "causal_decoder",
                "objective": "flm",
                "params_total": n * 1.1,
                "params_non_embedding": n,
                "positions": 1e7,
                "tokens": 1e7,
                "flops": 6 * n * 1e7,
                "loss": 2.0 + 10.0 / n**0.2,
                "eval/mc/task_loss": task_loss,
                "eval/mc/acc": acc,
                "eval/mc/chance": 0.25,
                "eval/mc/n": 500,
            }
        )
    fit = SimpleNamespace(laws=("kaplan_n",), n_kind="non_embedding", c_kind="counted")
    study = SimpleNamespace(fit=SimpleNamespace(**vars(fit), bootstrap=10, seed=0))
    fits, figures = fit_study(study, tmp_path, rows, [])
    law = fits["task_laws"]["cells"]["causal_decoder/flm"]["mc"]
    assert law["task_loss"]["form"] == "kaplan_n"  # one D for every size: a law in N
    bt = law["backtest"]
    assert bt["N"] == pytest.approx(1e7) and abs(bt["error"]) < 0.05
    assert any(p.name == "task_law.png" for p in figures)
    text = "\n".join(fits_lines(fits))
    assert "**Task laws**" in text and f"error {bt['error']:+.3f}" in text
    assert (tmp_path / "fits.json").exists()
