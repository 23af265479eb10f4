"""Figures from a tiny table of runs: every figure written as PNG and SVG, styles consistent."""

import itertools

import numpy as np
import pytest

from scalestudy.cli.main import main
from scalestudy.config.experiment import VALID_CELLS
from scalestudy.scaling.fit_plots import cell_style


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
    from scalestudy.scaling.fit_plots import make_all_plots
    from scalestudy.scaling.laws import FitSettings, fit_cells
    from scalestudy.scaling.table import DataSettings
    from scalestudy.scaling.table_input import build_table

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
    done = [r for r in rows if r["status"] == "done"]
    table = build_table(done, DataSettings(n_col="params_non_embedding", d_col="positions"), "rows")
    fits = fit_cells(table, FitSettings(bootstrap=5))
    cell = fits["cells"]["causal_decoder/flm"]
    assert "skipped" in cell["fits"]["chinchilla3"]
    paths = make_all_plots(table, fits, tmp_path / "figs")
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
    t = build_table(only_n, DataSettings(), "jsonl")
    fits = fit_cells(t, FitSettings(bootstrap=0))
    names = {p.stem for p in make_all_plots(t, fits, tmp_path / "n_only")}
    assert "loss_vs_n_d" in names and "loss_vs_compute" not in names


def test_zero_shot_accuracy_averages_tasks_not_their_breakdowns():
    from scalestudy.scaling.fit_plots import task_accuracy

    extra = {
        "eval/probes/acc": np.array([0.4, 0.6]),
        "eval/probes/pronoun/acc": np.array([1.0, 1.0]),  # a part of probes: not a task
        "eval/copa/acc": np.array([0.6, 0.8]),
        "eval/copa/n": np.array([100.0, 100.0]),
    }
    acc, n_tasks = task_accuracy(extra)
    assert n_tasks == 2 and np.allclose(acc, [0.5, 0.7])
    assert task_accuracy({"eval/copa/n": np.array([1.0])}) is None


def test_zero_shot_figure_has_binomial_intervals_and_chance():
    import matplotlib.pyplot as plt

    from scalestudy.scaling.fit_plots import fig_zero_shot, task_chance, task_interval
    from scalestudy.scaling.table import RunTable

    extra = {
        "eval/copa/acc": np.array([0.5, 0.6]),
        "eval/copa/n": np.array([100.0, 400.0]),
        "eval/copa/chance": np.array([0.5, 0.5]),
        "eval/piqa/acc": np.array([0.5, 0.7]),
        "eval/piqa/n": np.array([100.0, 400.0]),
        "eval/piqa/chance": np.array([0.25, 0.25]),
    }
    half = task_interval(extra)
    # Mean of two tasks: variance (p1 q1 / n1 + p2 q2 / n2) / 4.
    expect = 1.96 * np.sqrt([(0.25 / 100 + 0.25 / 100) / 4, (0.24 / 400 + 0.21 / 400) / 4])
    assert np.allclose(half, expect) and task_chance(extra) == 0.375
    assert task_interval({k: v for k, v in extra.items() if k != "eval/piqa/n"}) is None
    N = np.array([1e4, 2e4])
    t = RunTable(["a", "b"], ["all"] * 2, N, N * 10, 6 * N * N * 10, np.array([2.0, 1.8]))
    t.extra = extra
    fig = fig_zero_shot(t, {})
    ax = fig.axes[0]
    assert "interval:all" in {c.get_gid() for c in ax.get_children()}
    assert "chance (0.375)" in [x.get_text() for x in ax.get_legend().get_texts()]
    plt.close(fig)


# ----------------------------------------------------------------------------- artists


def _fits_and_table(tmp_path, make_isoflop, laws, bootstrap=30):
    from scalestudy.scaling.laws import FitSettings, fit_cells
    from scalestudy.scaling.table import DataSettings
    from scalestudy.scaling.table_input import load_table

    runs = tmp_path / "runs.csv"
    _write_runs(runs, make_isoflop)
    t = load_table(runs, DataSettings(run_col="run"))
    return t, fit_cells(t, settings=FitSettings(laws=laws, bootstrap=bootstrap))


def _budget_table(make_isoflop, budgets, cells=("all",)):
    from scalestudy.scaling.table import RunTable

    parts = [make_isoflop(budgets=budgets, sizes=5, cell=c, seed=i) for i, c in enumerate(cells)]
    t = RunTable(
        list(itertools.chain.from_iterable(p.run_id for p in parts)),
        list(itertools.chain.from_iterable(p.cell for p in parts)),
        *(np.concatenate([getattr(p, a) for p in parts]) for a in ("N", "D", "C", "loss")),
    )
    t.budget = [f"{c:.3g}" for c in np.round(t.C, -12)]
    t.choices = {"c_kind": "6nd", "groups": []}
    return t


def test_isoflop_colours_follow_compute_and_points_sit_under_their_own_parabola(make_isoflop):
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm, to_rgba

    from scalestudy.scaling.fit_plots import fig_isoflops
    from scalestudy.scaling.laws import FitSettings, fit_cells

    # Labels sorted as text put 1e+19 before 3e+18; budgets 0.12 dex apart are closer than
    # the old 0.15 dex drawing window.
    budgets = (1e18, 1.32e18, 3e18, 1e19, 1.32e19, 3e19, 1e20, 3e20)
    t = _budget_table(make_isoflop, budgets)
    fits = fit_cells(t, settings=FitSettings(laws=("chinchilla2",), bootstrap=0))
    fig = fig_isoflops(t, fits)
    ax = fig.axes[0]
    lines = [ln for ln in ax.get_lines() if str(ln.get_label()).startswith("C=")]
    profiles = fits["cells"]["all"]["fits"]["chinchilla2"]["isoflop"]
    cs = sorted(p["C"] for p in profiles)
    assert [float(ln.get_label()[2:]) for ln in lines] == pytest.approx(cs, rel=0.05)
    assert len(lines) == len(budgets)
    norm, cmap = LogNorm(min(budgets), max(budgets)), plt.get_cmap("viridis")
    for c, ln in zip(cs, lines):
        np.testing.assert_allclose(to_rgba(ln.get_color()), cmap(norm(c)), atol=0.02)
    # Every run drawn once, in its own budget's colour; >7 budgets never share a style.
    points = [col for col in ax.collections if len(col.get_offsets())]
    assert sum(len(col.get_offsets()) for col in points) == len(t.run_id)
    styles = {(ln.get_color(), ln.get_marker()) for ln in lines}
    assert len(styles) == len(budgets)
    for col in points:
        (colour,) = {tuple(np.round(fc, 3)) for fc in col.get_facecolors()}
        same = [
            c for c, ln in zip(cs, lines) if np.allclose(to_rgba(ln.get_color()), colour, atol=2e-3)
        ]
        assert len(same) == 1
        expected = np.sort(t.N[np.isclose(np.round(t.C, -12), same[0], rtol=1e-3)])
        np.testing.assert_allclose(np.sort(col.get_offsets()[:, 0]), expected)
    plt.close(fig)


def test_many_cells_never_share_a_style_and_panels_wrap_into_a_grid(make_isoflop):
    import matplotlib.pyplot as plt

    from scalestudy.scaling.fit_plots import cell_styles, fig_isoflops
    from scalestudy.scaling.laws import FitSettings, fit_cells

    names = [f"group{i}" for i in range(50)]  # more cells than 7 colours x 7 markers
    styles = cell_styles(names)
    assert len({(s["color"], s["marker"]) for s in styles.values()}) == 50
    mixed = cell_styles(["causal_decoder/flm", "x", "y", "encoder_decoder/mlm"])
    assert mixed["causal_decoder/flm"] == cell_style("causal_decoder/flm")
    assert len({tuple(s.values()) for s in mixed.values()}) == 4

    cells = ("a", "b", "c", "d", "e")
    t = _budget_table(make_isoflop, (1e18, 1e19, 1e20), cells)
    t.cell = [r.split("-")[0] for r in t.run_id]
    fits = fit_cells(t, settings=FitSettings(laws=("chinchilla2",), bootstrap=0))
    fig = fig_isoflops(t, fits)
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.get_title()]
    assert len(panels) == 5
    rows = {round(ax.get_position().y0, 3) for ax in panels}
    assert len(rows) == 2  # three panels, then two: not one row of five
    plt.close(fig)


def test_fitted_curves_have_bands_and_the_extrapolated_region_is_marked(tmp_path, make_isoflop):
    import matplotlib.pyplot as plt

    from scalestudy.scaling.fit_plots import fig_allocation, fig_isoflops, fig_loss_vs_compute

    laws = ("chinchilla1", "chinchilla2", "chinchilla3", "kaplan_c")
    t, fits = _fits_and_table(tmp_path, make_isoflop, laws)
    c_max = float(np.max(t.C))
    fig = fig_loss_vs_compute(t, fits)
    gids = {a.get_gid() for a in fig.axes[0].get_children() if a.get_gid()}
    assert {"band:causal_decoder/flm:chinchilla3", "band:causal_decoder/flm:kaplan_c"} <= gids
    (span,) = [a for a in fig.axes[0].patches if a.get_gid() == "extrapolation"]
    assert span.get_x() == pytest.approx(c_max)
    plt.close(fig)

    fig = fig_isoflops(t, fits)  # each budget's parabola with its band
    gids = {a.get_gid() for ax in fig.axes for a in ax.get_children() if a.get_gid()}
    assert {f"band:causal_decoder/flm:C={c:.3g}" for c in (1e18, 1e19, 1e20)} <= gids
    plt.close(fig)

    fig = fig_allocation(t, fits)
    ax_n = fig.axes[0]
    gids = {a.get_gid() for a in ax_n.get_children() if a.get_gid()}
    for law in laws[:3]:
        assert f"band:encoder_decoder/mlm:{law}" in gids
    assert "extrapolation" in gids
    labels = [txt.get_text() for ax in fig.axes for txt in ax.get_legend().get_texts()]
    assert any(x.startswith("causal_decoder/flm approach 1") for x in labels)
    assert "approach 1" in labels  # the line style's own entry
    assert "dotted: approach 1" in fig._suptitle.get_text()
    plt.close(fig)


def test_laws_without_E_are_drawn_with_their_bands(tmp_path, make_isoflop):
    # The main study fits kaplan_n_noE and kaplan_c_noE: its figures must show those fits.
    import matplotlib.pyplot as plt

    from scalestudy.scaling.fit_plots import fig_loss_vs_compute, fig_loss_vs_size, fig_residuals

    t, fits = _fits_and_table(tmp_path, make_isoflop, ("kaplan_n_noE", "kaplan_c_noE"))
    fig = fig_loss_vs_compute(t, fits)
    gids = {a.get_gid() for a in fig.axes[0].get_children() if a.get_gid()}
    assert {f"band:{c}:kaplan_c_noE" for c in t.cells()} <= gids
    assert "L(C) frontier fit (Kaplan)" in [x.get_text() for x in fig.axes[0].get_legend().texts]
    # Bands cover the range of the cell's own runs only; the curve alone goes on beyond it.
    for c in t.cells():
        (poly,) = [a for a in fig.axes[0].get_children() if a.get_gid() == f"band:{c}:kaplan_c_noE"]
        xs = poly.get_paths()[0].vertices[:, 0]
        sub = t.subset(c).C
        assert xs.min() >= sub.min() * (1 - 1e-9) and xs.max() <= sub.max() * (1 + 1e-9)
    plt.close(fig)
    fig = fig_loss_vs_size(t, fits)
    gids = {a.get_gid() for a in fig.axes[0].get_children() if a.get_gid()}
    assert {f"band:{c}:kaplan_n_noE" for c in t.cells()} <= gids
    # IsoFLOP runs: each size trains its own token count, so the law is L(N, D(N)).
    assert fig.axes[0].get_title() == "L(N, D(N)) with fitted kaplan_n_noE"
    plt.close(fig)
    fig = fig_residuals(t, fits)
    assert fig is not None and len([ax for ax in fig.axes if ax.has_data()]) == 2
    plt.close(fig)


def test_flagged_fits_say_so_in_the_legend(make_isoflop):
    import matplotlib.pyplot as plt

    from scalestudy.scaling.fit_plots import fig_loss_vs_size
    from scalestudy.scaling.laws import FitSettings, fit_cells
    from scalestudy.scaling.table import RunTable

    N = np.array([2.5e4, 5.5e4, 1.1e5, 1.9e5])  # four sizes, as in the smoke study
    t = RunTable(
        [f"r{i}" for i in range(4)], ["all"] * 4, N, N * np.nan, N * np.nan, 3.2 * (N / 1e4) ** -0.1
    )
    t.choices = {"groups": []}
    fits = fit_cells(t, settings=FitSettings(laws=("kaplan_n",), bootstrap=20))
    fig = fig_loss_vs_size(t, fits)
    texts = [x.get_text() for x in fig.axes[0].get_legend().get_texts()]
    assert any("kaplan_n FLAGGED" in x and "points" in x for x in texts)
    plt.close(fig)


def test_residuals_ring_only_the_outlying_points_not_their_whole_run():
    import matplotlib.pyplot as plt

    from scalestudy.scaling.fit_plots import fig_residuals
    from scalestudy.scaling.laws import FitSettings, fit_cells
    from scalestudy.scaling.table import RunTable

    # Four runs' training curves on one power law in C; one point of the largest run, where
    # the curves overlap, is 40% low. The L(C) frontier holds many points of that run: only
    # the ones at that dip are outliers.
    ids, N, D, C, L, curves = [], [], [], [], [], {}
    for n in (2.5e4, 5.5e4, 1.1e5, 1.9e5):
        d = np.geomspace(2e4, 6e5, 30)
        loss = (6 * n * d / 1e8) ** -0.3
        rid = f"{n:.3g}"
        curves[rid] = {"C": 6 * n * d, "D": d, "loss": loss}
        ids.append(rid)
        N.append(n), D.append(d[-1]), C.append(6 * n * d[-1]), L.append(loss[-1])
    curves[ids[-1]]["loss"][15] *= 0.6
    t = RunTable(ids, ["all"] * 4, *(np.array(v) for v in (N, D, C, L)), curves=curves)
    t.choices = {"c_kind": "counted", "groups": [], "curve_points": "finished"}
    fits = fit_cells(t, settings=FitSettings(laws=("kaplan_c_noE",), bootstrap=0))
    pts = fits["cells"]["all"]["fits"]["kaplan_c_noE"]["residuals"]["points"]
    flagged = [p for p in pts if p["outlier"]]
    same_run = [p for p in pts if p["run"] == ids[-1]]
    assert 1 <= len(flagged) < len(same_run) and {p["run"] for p in flagged} == {ids[-1]}
    fig = fig_residuals(t, fits)
    (ax,) = [a for a in fig.axes if a.has_data()]
    rings = [c for c in ax.collections if c.get_label() == "outlier (flagged)"]
    assert len(rings) == 1 and len(rings[0].get_offsets()) == len(flagged)
    assert ax.get_xlabel() == "training compute C (FLOPs)"
    plt.close(fig)


def test_size_panels_name_only_laws_that_were_fitted():
    """A table fitted with chinchilla3 alone: the L(N) and L(D) panels say kaplan_n / kaplan_d
    were not fitted (and draw no curve), instead of a title naming them as fitted."""
    import matplotlib.pyplot as plt

    from scalestudy.scaling.fit_plots import fig_loss_vs_size
    from scalestudy.scaling.laws import FitSettings, fit_cells
    from scalestudy.scaling.table import RunTable

    N = np.repeat(np.geomspace(1e7, 1e9, 5), 4)
    D = np.tile(np.geomspace(2e9, 6e10, 4), 5)
    loss = 1.7 + 400 / N**0.34 + 410 / D**0.28
    t = RunTable([f"r{i}" for i in range(20)], ["all"] * 20, N, D, 6 * N * D, loss)
    t.choices = {"groups": []}
    fits = fit_cells(t, settings=FitSettings(laws=("chinchilla3",), bootstrap=0))
    fig = fig_loss_vs_size(t, fits)
    titles = [ax.get_title() for ax in fig.axes[:2]]
    assert titles == ["L(N) (kaplan_n not fitted)", "L(D) (kaplan_d not fitted)"]
    assert not any(ax.get_lines() for ax in fig.axes[:2])
    plt.close(fig)
    fits = fit_cells(t, settings=FitSettings(laws=("kaplan_n",), bootstrap=0))
    fig = fig_loss_vs_size(t, fits)
    assert [ax.get_title() for ax in fig.axes[:2]] == [
        "L(N) with fitted kaplan_n",
        "L(D) (kaplan_d not fitted)",
    ]
    plt.close(fig)
