"""Figures from a tiny table of runs: every figure written as PNG and SVG, styles consistent."""

import numpy as np

from scalestudy.cli import main
from scalestudy.config import VALID_CELLS
from scalestudy.scaling.plots import cell_style


def _write_runs(path, make_isoflop):
    lines = ["run,arch,objective,N,D,C,loss,eval/copa/acc"]
    for cell, scale in (("causal_decoder/flm", 1.0), ("encoder_decoder/mlm", 1.04)):
        t = make_isoflop(budgets=(1e18, 1e19, 1e20), sizes=5, noise=0.002)
        arch, obj = cell.split("/")
        for i in range(len(t.N)):
            for frac in (0.25, 0.5, 1.0):  # three points of each run's training curve
                n, d = t.N[i], t.D[i] * frac
                loss = scale * (1.69 + 406.4 / n**0.34 + 410.7 / d**0.28)
                acc = 0.25 + 0.02 * np.log10(t.C[i])
                lines.append(f"{cell}{i},{arch},{obj},{n},{d},{6 * n * d},{loss},{acc}")
    path.write_text("\n".join(lines))


def test_plot_command_writes_every_figure(tmp_path, make_isoflop, capsys):
    runs = tmp_path / "runs.csv"
    _write_runs(runs, make_isoflop)
    out = tmp_path / "figs"
    assert main(["plot", str(runs), "--run-col", "run", "--out", str(out)]) == 0
    written = capsys.readouterr().out.split()
    names = {p.rsplit("/", 1)[-1] for p in written}
    for fig in (
        "loss_vs_compute",
        "isoflops",
        "loss_vs_n_d",
        "optimal_allocation",
        "zero_shot_vs_compute",
        "residuals",
    ):
        assert {f"{fig}.png", f"{fig}.svg"} <= names
    png = (out / "isoflops.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert "<svg" in (out / "loss_vs_compute.svg").read_text()[:2000]


def test_every_cell_has_its_own_colour_and_marker_pair():
    cells = [f"{a}/{o}" for a, objs in VALID_CELLS.items() for o in objs]
    styles = [tuple(cell_style(c).values()) for c in cells]
    assert len(set(styles)) == len(cells)
    assert cell_style("causal_decoder/plm")["color"] == cell_style("causal_decoder/mlm")["color"]
    assert cell_style("causal_decoder/plm")["marker"] == cell_style("encoder_decoder/plm")["marker"]


def test_tiny_study_fits_what_it_can_and_still_plots(tmp_path):
    from scalestudy.scaling.laws import FitSettings, fit_cells
    from scalestudy.scaling.plots import make_all_plots

    # Registry rows of a smoke study: three sizes per cell, one budget, nothing to fit L(N, D).
    rows = []
    for arch, obj in (("causal_decoder", "flm"), ("noncausal_decoder", "plm")):
        for i, n in enumerate((1e5, 2e5, 4e5)):
            rows.append(
                {
                    "run_id": f"{arch}{i}",
                    "arch": arch,
                    "objective": obj,
                    "status": "done",
                    "params_total": n * 1.2,
                    "params_non_embedding": n,
                    "tokens": 1e6,
                    "positions": 2e6,
                    "flops": 6.5 * n * 2e6,
                    "loss": 4.0 - 0.2 * i,
                    "eval/copa/acc": 0.5 + 0.01 * i,
                }
            )
    rows.append(
        {
            "run_id": "failed",
            "arch": "causal_decoder",
            "objective": "flm",
            "status": "failed",
            "loss": None,
        }
    )
    fits = fit_cells(rows, [], FitSettings(bootstrap=5))
    cell = fits["cells"]["causal_decoder/flm"]
    assert "skipped" in cell["fits"]["chinchilla3"]
    paths = make_all_plots(rows, [], fits, tmp_path / "figs")
    assert paths and all(p.stat().st_size > 0 for p in paths)
    # Only N and loss: no compute figures, the others still drawn.
    only_n = [
        {
            "arch": r["arch"],
            "objective": r["objective"],
            "N": r["params_non_embedding"],
            "loss": r["loss"],
        }
        for r in rows[:-1]
    ]
    from scalestudy.scaling.io import DataSettings, build_table

    t = build_table(only_n, None, DataSettings(), "jsonl")
    names = {p.stem for p in make_all_plots(t, None, None, tmp_path / "n_only")}
    assert "loss_vs_n_d" in names and "loss_vs_compute" not in names


def test_zero_shot_accuracy_averages_tasks_not_their_breakdowns():
    from scalestudy.scaling.plots import task_accuracy

    extra = {
        "eval/probes/acc": np.array([0.4, 0.6]),
        "eval/probes/pronoun/acc": np.array([1.0, 1.0]),  # a part of probes: not a task
        "eval/copa/acc": np.array([0.6, 0.8]),
        "eval/copa/n": np.array([100.0, 100.0]),
    }
    acc, n_tasks = task_accuracy(extra)
    assert n_tasks == 2 and np.allclose(acc, [0.5, 0.7])
    assert task_accuracy({"eval/copa/n": np.array([1.0])}) is None
