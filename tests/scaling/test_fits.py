"""Fits recover known parameters; the batched optimiser matches scipy; intervals cover."""

import numpy as np
import pytest
from scipy.optimize import minimize as scipy_minimize

from scalestudy.scaling import allocation, frontier
from scalestudy.scaling.forms import Chinchilla, get_form
from scalestudy.scaling.laws import FitSettings, fit_cells, fit_form
from scalestudy.scaling.optimize import minimize, objective
from scalestudy.scaling.resample import run_counts, stratified_counts
from scalestudy.scaling.table import RunTable, ScalingDataError


def _values(fit):
    return {k: v["value"] for k, v in fit["params"].items()}


def test_grid_fit_matches_scipy_lbfgs_from_the_same_grid(iso_table):
    form = Chinchilla()
    x = np.log(np.stack([iso_table.N, iso_table.D]))
    y = np.log(iso_table.loss)
    w = np.ones_like(y)
    fit = fit_form(form, iso_table, np.zeros((0, 35)), FitSettings(), 6.0)
    ours = objective(form, np.array(fit["theta"])[None], x, y, w, 1e-3)[0]

    def f(theta):
        return objective(form, theta[None], x, y, w, 1e-3)[0]

    grid = form.grid(x)
    starts = grid[np.argsort(objective(form, grid, x, y, w, 1e-3))[:10]]
    ref = min(scipy_minimize(f, s, method="L-BFGS-B").fun for s in starts)
    assert ours <= ref * (1 + 1e-6)
    # The batched minimiser run from every grid start agrees as well.
    assert minimize(form, starts, x, y, w).loss_K.min() <= ref * (1 + 1e-6)


def test_holdout_reports_extrapolation_error(iso_table):
    s = FitSettings(holdout=7)
    fit = fit_form(get_form("chinchilla3"), iso_table, np.zeros((0, 35)), s, 6.0)
    held = fit["holdout"]
    assert len(held["runs"]) == 7 and all("1e+20" in r for r in held["runs"])
    assert held["rmse_log"] < 0.02  # noise is 0.5%; the law extrapolates one budget


def test_chinchilla3_recovers_parameters_and_allocation(iso_table, true_params):
    fit = fit_form(get_form("chinchilla3"), iso_table, np.zeros((0, 35)), FitSettings(), 6.0)
    v = _values(fit)
    assert v["alpha"] == pytest.approx(true_params["alpha"], abs=0.03)
    assert v["beta"] == pytest.approx(true_params["beta"], abs=0.03)
    assert v["E"] == pytest.approx(true_params["E"], rel=0.05)
    a_true = true_params["beta"] / (true_params["alpha"] + true_params["beta"])
    assert v["a"] == pytest.approx(a_true, abs=0.02)
    assert v["a"] + v["b"] == pytest.approx(1.0)
    assert fit["residuals"]["rmse_log"] < 0.01
    assert [f for f in fit["flags"] if not f.startswith("seed:")] == []  # one run per (N, D)


@pytest.mark.parametrize("with_e", [True, False])
def test_kaplan_n_recovers_exponent(with_e):
    rng = np.random.default_rng(1)
    N = np.geomspace(1e6, 1e10, 20)
    E = 1.5 if with_e else 0.0
    loss = ((8.8e13 / N) ** 0.076 + E) * np.exp(rng.normal(0, 0.002, N.size))
    t = RunTable([str(i) for i in range(N.size)], ["all"] * N.size, N, N * np.nan, N * np.nan, loss)
    law = "kaplan_n" if with_e else "kaplan_n_noE"
    v = _values(fit_form(get_form(law), t, np.zeros((0, N.size)), FitSettings(), 6.0))
    assert v["alpha_N"] == pytest.approx(0.076, abs=0.01 if with_e else 0.002)
    if with_e:
        assert v["E"] == pytest.approx(1.5, rel=0.1)
    else:
        assert np.log(v["N_c"]) == pytest.approx(np.log(8.8e13), abs=1.0)


def test_kaplan_nd_recovers_exponents():
    rng = np.random.default_rng(2)
    N = np.exp(rng.uniform(np.log(1e6), np.log(1e9), 60))
    D = np.exp(rng.uniform(np.log(1e8), np.log(1e11), 60))
    loss = ((8.8e13 / N) ** (0.076 / 0.095) + 5.4e13 / D) ** 0.095
    loss *= np.exp(rng.normal(0, 0.002, N.size))
    t = RunTable([str(i) for i in range(60)], ["all"] * 60, N, D, 6 * N * D, loss)
    v = _values(fit_form(get_form("kaplan_nd"), t, np.zeros((0, 60)), FitSettings(), 6.0))
    assert v["alpha_N"] == pytest.approx(0.076, abs=0.01)
    assert v["alpha_D"] == pytest.approx(0.095, abs=0.01)


def test_approach2_recovers_allocation_exponent(iso_table, true_params):
    fit = allocation.approach2(iso_table, run_counts(35, 50, 0), FitSettings())
    a_true = true_params["beta"] / (true_params["alpha"] + true_params["beta"])
    assert fit["n_budgets"] == 5
    assert fit["params"]["a"]["value"] == pytest.approx(a_true, abs=0.04)
    assert fit["params"]["b"]["value"] == pytest.approx(1 - a_true, abs=0.04)
    lo, hi = fit["params"]["a"]["ci"]
    assert lo < fit["params"]["a"]["value"] < hi


def test_approach1_from_curves_finds_allocation(true_params):
    # Each run is trained to several D; its curve holds the loss at every point on the way.
    ids, N, D, C, L, curves = [], [], [], [], [], {}
    for n in np.geomspace(1e7, 3e9, 14):
        d = np.geomspace(1e8, 3e11, 40)
        loss = 1.69 + 406.4 / n**0.34 + 410.7 / d**0.28
        rid = f"{n:.3g}"
        curves[rid] = {"C": 6 * n * d, "D": d, "loss": loss}
        ids.append(rid)
        N.append(n)
        D.append(d[-1])
        C.append(6 * n * d[-1])
        L.append(loss[-1])
    t = RunTable(
        ids, ["all"] * len(ids), np.array(N), np.array(D), np.array(C), np.array(L), curves=curves
    )
    # Every curve point is the loss of a run trained to that D: the end of a finished schedule.
    t.choices = {"curve_points": "finished"}
    fit = frontier.approach1(t, run_counts(len(ids), 20, 0), FitSettings())
    a_true = true_params["beta"] / (true_params["alpha"] + true_params["beta"])
    assert fit["params"]["a"]["value"] == pytest.approx(a_true, abs=0.06)
    assert fit["n_budgets"] > 10


def test_bootstrap_interval_covers_truth_at_nominal_rate():
    draws, hits = 40, 0
    N = np.geomspace(1e6, 1e9, 24)
    for i in range(draws):
        rng = np.random.default_rng(100 + i)
        loss = (1e13 / N) ** 0.08 * np.exp(rng.normal(0, 0.01, N.size))
        t = RunTable(
            [str(j) for j in range(N.size)], ["all"] * N.size, N, N * np.nan, N * np.nan, loss
        )
        s = FitSettings(bootstrap=150, seed=i)
        fit = fit_form(get_form("kaplan_n_noE"), t, run_counts(N.size, 150, i), s, 6.0)
        lo, hi = fit["params"]["alpha_N"]["ci"]
        hits += lo <= 0.08 <= hi
    # Binomial(40, 0.95): P(hits <= 33) < 2%; a too-narrow or broken interval fails.
    assert hits >= 34


def test_compare_cells_finds_crossover(make_isoflop, true_params):
    # Cell "b" has a lower irreducible loss but a larger N term: worse at small compute,
    # better at large compute. The crossover is where the true optimal losses are equal.
    pb = {**true_params, "E": 1.5, "A": 1500.0}
    ta = make_isoflop(seed=1, noise=0.001, cell="a")
    tb = make_isoflop(seed=2, noise=0.001, cell="b", p=pb)
    t = RunTable(
        ta.run_id + tb.run_id,
        ta.cell + tb.cell,
        np.r_[ta.N, tb.N],
        np.r_[ta.D, tb.D],
        np.r_[ta.C, tb.C],
        np.r_[ta.loss, tb.loss],
    )
    t.choices = {"c_kind": "6nd", "groups": []}
    s = FitSettings(laws=("chinchilla3",), bootstrap=30)
    res = fit_cells(t, settings=s)
    (cross,) = res["comparison"]["crossovers"]

    def l_opt(p, c):
        n = np.geomspace(1e6, 1e13, 20001)
        return (p["E"] + p["A"] / n ** p["alpha"] + p["B"] / (c / 6 / n) ** p["beta"]).min()

    cs = np.geomspace(1e18, 1e26, 400)
    diff = np.array([l_opt(true_params, c) - l_opt(pb, c) for c in cs])
    true_cross = cs[np.argmax(diff > 0)]
    assert cross["C"] == pytest.approx(true_cross, rel=0.5)
    assert "b overtakes a" in cross["meaning"]
    assert 0 <= cross["fraction_of_resamples_crossing"] <= 1


def test_unknown_law_is_an_error():
    with pytest.raises(ScalingDataError, match="unknown law"):
        FitSettings(laws=("chinchilla4",))


def test_isoflop_grouping_does_not_chain_a_continuum_of_compute():
    # 217 runs spread evenly in log C from 2.9e18 to 1e21: gaps are tiny, so joining
    # neighbours closer than 0.1 dex made them one budget.
    C = np.geomspace(2.9e18, 1e21, 217)
    groups, flags = allocation.isoflop_groups(C, 0.1)
    spans = [np.ptp(np.log10(C[groups == g])) for g in np.unique(groups)]
    assert max(spans) <= 0.1 and len(spans) >= 25
    assert flags and "does not fall into separate IsoFLOP budgets" in flags[0]


def test_isoflop_grouping_finds_jittered_budgets_without_flags():
    rng = np.random.default_rng(0)
    nominal = np.repeat([1e18, 3e18, 1e19, 3e19], 6)
    C = nominal * 10 ** rng.uniform(-0.02, 0.02, nominal.size)
    groups, flags = allocation.isoflop_groups(C, 0.1)
    assert len(np.unique(groups)) == 4 and not flags
    assert all(len(np.unique(nominal[groups == g])) == 1 for g in np.unique(groups))


def test_budget_labels_give_the_budget_compute_in_numeric_order(make_isoflop):
    budgets = (1e18, 3e18, 1e19, 3e19, 1e20)
    t = make_isoflop(budgets=budgets)
    t.C = t.C * 1.05  # counted FLOPs differ from the nominal 6ND budget
    t.budget = [f"{c:.0e}" for c in 6 * t.N * t.D / 1.0]
    fit = allocation.approach2(t, run_counts(35, 0, 0), FitSettings())
    assert [p["C"] for p in fit["isoflop"]] == pytest.approx(budgets, rel=1e-9)
    assert fit["budget_C"] == "budget labels"
    # Each profile holds exactly its own runs.
    assert all(len(p["run_ids"]) == 7 for p in fit["isoflop"])


def test_at_compute_matches_the_fitted_allocation(iso_table):
    s = FitSettings(laws=("chinchilla3", "chinchilla2"), bootstrap=30, at_compute=(1e19, 1e21))
    res = fit_cells(iso_table, settings=s)
    fits = res["cells"]["all"]["fits"]
    p = {k: v["value"] for k, v in fits["chinchilla3"]["params"].items()}
    for entry in fits["chinchilla3"]["at_compute"]:
        n = p["G"] * (entry["C"] / 6.0) ** p["a"]
        assert entry["N_opt"]["value"] == pytest.approx(n, rel=1e-9)
        assert entry["D_opt"]["value"] == pytest.approx(entry["C"] / 6.0 / n, rel=1e-9)
        assert entry["D_per_N"]["value"] == pytest.approx(entry["C"] / 6.0 / n**2, rel=1e-9)
        lo, hi = entry["N_opt"]["ci"]
        assert lo < entry["N_opt"]["value"] < hi
    q = {k: v["value"] for k, v in fits["chinchilla2"]["params"].items()}
    e2 = fits["chinchilla2"]["at_compute"][1]
    assert e2["N_opt"]["value"] == pytest.approx(q["G"] * 1e21 ** q["a"], rel=1e-9)
    assert e2["D_opt"]["value"] == pytest.approx(q["H"] * 1e21 ** q["b"], rel=1e-9)


def test_kfold_and_leave_one_out_report_out_of_sample_error(iso_table):
    form = get_form("chinchilla3")
    for k, kind in ((5, "5-fold"), (-1, "leave-one-out")):
        fit = fit_form(form, iso_table, np.zeros((0, 35)), FitSettings(kfold=k), 6.0)
        cv = fit["crossval"]
        assert cv["kind"] == kind
        # Out of sample is worse than in sample, and near the 0.5% noise for a right law.
        assert cv["in_sample_rmse_log"] < cv["rmse_log"] < 0.012


def test_approach2_leave_one_budget_out(make_isoflop):
    t = make_isoflop(budgets=(1e18, 3e18, 1e19, 3e19, 1e20, 3e20), noise=0.002)
    fit = allocation.approach2(t, run_counts(len(t.N), 0, 0), FitSettings(kfold=-1))
    cv = fit["crossval"]
    assert cv["kind"] == "leave-one-budget-out" and cv["folds"] == 6
    assert cv["in_sample_rmse_log"] < cv["rmse_log"] < 0.2
    # Each budget's held-out prediction is the line through the other five.
    ln = np.log([p["N_opt"] for p in fit["isoflop"]])
    lc = np.log([p["C"] for p in fit["isoflop"]])
    errs = []
    for i in range(6):
        keep = np.arange(6) != i
        sl, ic = np.polyfit(lc[keep], ln[keep], 1)
        errs.append(ln[i] - (ic + sl * lc[i]))
    assert cv["rmse_log"] == pytest.approx(np.sqrt(np.mean(np.square(errs))), rel=1e-6)


def test_frontier_stops_where_a_single_curve_is_left():
    # Two runs; the longer one's curve has a plateau (mid-schedule) past the shorter run's
    # end. There a lone curve is no frontier: only its final point is kept.
    d = np.geomspace(1e6, 1e8, 30)
    short = {"C": 6e5 * d[:20], "D": d[:20], "loss": 3.0 * (6e5 * d[:20] / 1e11) ** -0.1}
    long_loss = 3.2 * (6e6 * d / 1e11) ** -0.1
    long_loss[20:-1] = long_loss[19]  # a plateau, then the schedule's end
    long = {"C": 6e6 * d, "D": d, "loss": long_loss}
    curves = {"short": short, "long": long}
    t = RunTable(
        ["short", "long"],
        ["all"] * 2,
        np.array([1e5, 1e6]),
        np.array([d[19], d[-1]]),
        np.array([short["C"][-1], long["C"][-1]]),
        np.array([short["loss"][-1], long["loss"][-1]]),
        curves=curves,
        choices={"curve_points": "finished"},
    )
    c, loss, run = frontier.frontier_points(t)
    inside = c < long["C"][-1]
    assert c[inside].max() <= short["C"][-1] * (1 + 1e-9)  # no point from the lone tail
    assert c[-1] == long["C"][-1] and loss[-1] == long_loss[-1] and run[-1] == 1
    assert c[inside].min() >= long["C"][0] * (1 - 1e-9)  # nor from the short run's lone head


def test_kaplan_forms_are_least_squares_in_log_space_chinchilla_is_huber():
    # Without E, log L = alpha log N_c - alpha log N is a line: the least-squares fit in log
    # space is the ordinary regression line, whatever one outlying run does to it.
    N = np.geomspace(1e6, 1e9, 8)
    loss = (8.8e13 / N) ** 0.076
    loss[3] *= 1.3
    t = RunTable([str(i) for i in range(8)], ["all"] * 8, N, N * np.nan, N * np.nan, loss)
    v = _values(fit_form(get_form("kaplan_n_noE"), t, np.zeros((0, 8)), FitSettings(), 6.0))
    slope, intercept = np.polyfit(np.log(N), np.log(loss), 1)
    assert v["alpha_N"] == pytest.approx(-slope, rel=1e-6)
    assert np.log(v["N_c"]) == pytest.approx(intercept / -slope, rel=1e-6)
    assert not get_form("kaplan_n").robust and get_form("chinchilla3").robust


def test_mid_schedule_training_losses_are_refused_for_l_of_c_and_approach1():
    # Runs whose logged curves reach far below the next size's final loss at equal compute
    # (as a training loss logged mid-schedule can): L(C) uses the runs' final losses only.
    N = np.geomspace(1e5, 1e7, 5)
    D = 20 * N
    final = 2.0 + 30.0 / N**0.3
    frac = np.array([0.01, 0.1, 1.0])  # each curve spans the next size's compute
    curves = {
        f"r{i}": {"C": 6 * n * D[i] * frac, "D": D[i] * frac, "loss": final[i] * frac**0.15}
        for i, n in enumerate(N)
    }
    t = RunTable([f"r{i}" for i in range(5)], ["all"] * 5, N, D, 6 * N * D, final, curves=curves)
    t.choices = {"c_kind": "6nd", "groups": [], "curve_points": "mid_schedule"}
    c, loss, _ = frontier.frontier_points(t)
    np.testing.assert_array_equal(c, 6 * N * D)
    np.testing.assert_array_equal(loss, final)
    fit = fit_cells(t, settings=FitSettings(laws=("kaplan_c_noE",), bootstrap=0))
    kc = fit["cells"]["all"]["fits"]["kaplan_c_noE"]
    assert kc["n_points"] == 5 and "mid-schedule training curves not used" in kc["points_used"]
    with pytest.raises(ScalingDataError, match="mid-schedule training losses are not used"):
        frontier.approach1(t, run_counts(5, 0, 0), FitSettings())
    # Declared as ends of finished schedules, the same curves are used.
    t.choices["curve_points"] = "finished"
    assert frontier.frontier_points(t)[1].min() < final.min()


def test_approach1_from_final_losses_at_shared_budgets(iso_table, true_params):
    # An IsoFLOP grid of separate runs: per budget, the size with the lowest final loss.
    fit = frontier.approach1(iso_table, run_counts(len(iso_table.N), 20, 0), FitSettings())
    assert fit["n_budgets"] == 5 and "final validation loss" in fit["points_used"]
    a_true = true_params["beta"] / (true_params["alpha"] + true_params["beta"])
    assert fit["params"]["a"]["value"] == pytest.approx(a_true, abs=0.1)


def test_law_in_n_keeps_every_seed_of_the_best_budget_not_the_luckiest_run():
    from scalestudy.scaling.forms import get_form
    from scalestudy.scaling.laws import FitSettings, fit_form
    from scalestudy.scaling.resample import run_counts
    from scalestudy.scaling.table import RunTable

    N = np.geomspace(1e4, 1e6, 6)
    loss = (1e13 / N) ** 0.08
    # Three seeds at the smallest size (their tokens differ slightly: packing), mean log loss
    # on the law, and one run of another budget at that size.
    seed_off = np.array([0.03, -0.02, -0.01])

    def kept(other_off: float) -> list[str]:
        Ns = np.concatenate([N, [N[0]] * 3])
        Ds = np.concatenate([20 * N, 20 * N[0] * np.array([1.0002, 0.9999, 0.25])])
        offs = np.concatenate([[seed_off[0]], np.zeros(5), seed_off[1:], [other_off]])
        Ls = np.concatenate([loss, [loss[0]] * 3]) * np.exp(offs)
        t = RunTable([f"r{i}" for i in range(9)], ["all"] * 9, Ns, Ds, 6 * Ns * Ds, Ls)
        t.choices = {"c_kind": "6nd", "groups": []}
        fit = fit_form(get_form("kaplan_n_noE"), t, run_counts(9, 0, 0), FitSettings(), 6.0)
        return sorted(p["run"] for p in fit["residuals"]["points"])

    rest = [f"r{i}" for i in range(1, 6)]
    # The other budget's run is worse than the seeds' mean (0) but better than one seed: every
    # seed is kept (the lowest single loss would have kept r6 alone).
    assert kept(0.01) == sorted(["r0", "r6", "r7", *rest])
    # Better than the seeds' mean: that budget is the size's point.
    assert kept(-0.015) == sorted(["r8", *rest])


def test_compute_frontier_judges_the_seeds_of_a_point_together():
    # Three sizes, three seeds each, on a falling law: the middle size's seeds spread so that
    # one of them ends above the smallest size's luckiest seed. Judged run by run, that seed
    # would leave the frontier (and a lucky seed of a worse point could enter it); judged by
    # the point's mean, every seed of every point on the law stays.
    from scalestudy.scaling.table import RunTable

    N = np.repeat([1e4, 3e4, 1e5], 3)
    D = np.repeat([2e5, 6e5, 2e6], 3) * np.tile([1.0, 1.0004, 0.9997], 3)  # packing: within 1%
    C = 6 * N * D
    base = (1e9 / C) ** 0.05
    off = np.array([-0.02, 0.0, 0.02, -0.13, 0.0, 0.13, 0.0, 0.01, -0.01])
    loss = base * np.exp(off)
    t = RunTable([f"r{i}" for i in range(9)], ["all"] * 9, N, D, C, loss)
    assert sorted(frontier.final_frontier(t).tolist()) == list(range(9))
    assert loss[5] > loss[0]  # run by run, r5 would have been dropped
    # A size whose mean is above a cheaper size's mean leaves the frontier with all its seeds,
    # even when one seed of it is the lowest run below the cheaper point's mean.
    worse = loss.copy()
    worse[3:6] = base[0] * np.exp([0.05, 0.06, -0.03])
    t2 = RunTable(t.run_id, t.cell, N, D, C, worse)
    assert sorted(frontier.final_frontier(t2).tolist()) == [0, 1, 2, 6, 7, 8]
    # Without repeats it is the runs that no cheaper run beats.
    t3 = RunTable(
        [f"r{i}" for i in range(4)],
        ["all"] * 4,
        N[::3][[0, 1, 2, 2]],
        D[::3][[0, 1, 2, 2]] * [1, 1, 1, 3],
        C[::3][[0, 1, 2, 2]] * [1, 1, 1, 3],
        np.array([2.0, 2.1, 1.9, 1.8]),
    )
    assert frontier.final_frontier(t3).tolist() == [0, 2, 3]


@pytest.mark.parametrize("law", ["clark_ne", "krajewski_ndg"])
def test_moe_forms_jacobians_equal_central_differences(law):
    form = get_form(law)
    rng = np.random.default_rng(3)
    x = np.log(rng.uniform([1e7, 1e9, 1.0][: len(form.inputs)], 1e9, (9, len(form.inputs))).T)
    theta = form.grid(x)[::97][:4] + rng.normal(0, 0.05, (4, len(form.params)))
    _, jac = form.predict(theta, x)
    for q in range(theta.shape[1]):
        step = np.zeros_like(theta)
        step[:, q] = 1e-6
        numeric = (form.predict(theta + step, x)[0] - form.predict(theta - step, x)[0]) / 2e-6
        np.testing.assert_allclose(jac[..., q], numeric, rtol=1e-5, atol=1e-7)


def _moe_table(path, rows):
    import csv

    from scalestudy.scaling.table_input import load_table

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return load_table(path)


def test_clark_law_in_parameters_and_experts_is_least_squares_in_log10(tmp_path):
    """The law of Clark et al. (2022) from a table with an `experts` column (a dense model is
    E = 1): exact data give back its coefficients, noisy data give ordinary least squares in
    log10 L on (log10 N, log10 E, their product, 1)."""
    a, b, c, d = -0.082, -0.108, 0.009, 1.104
    N, E = np.meshgrid([1e7, 3e7, 1e8, 3e8, 1e9], [1, 4, 16, 64])
    u, v = np.log10(N.ravel()), np.log10(E.ravel())
    log10_L = a * u + b * v + c * u * v + d
    noise = np.random.default_rng(4).normal(0, 0.004, u.size)
    form = get_form("clark_ne")
    for eps in (0.0, noise):
        rows = [
            {"params": n, "experts": e, "tokens": 20 * n, "loss": 10**y}
            for n, e, y in zip(N.ravel(), E.ravel(), log10_L + eps)
        ]
        table = _moe_table(tmp_path / "clark.csv", rows)
        fit = fit_form(form, table, np.zeros((0, u.size)), FitSettings(), 6.0)
        A = np.stack([u, v, u * v, np.ones_like(u)], axis=1)
        expected = np.linalg.lstsq(A, log10_L + eps, rcond=None)[0]
        got = [fit["params"][k]["value"] for k in "abcd"]
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(expected, [a, b, c, d], atol=0.03)  # the noise moves them little


def test_krajewski_law_recovers_its_constants_and_shows_the_published_ones(tmp_path):
    """Data made by the law of Krajewski et al. (2024) with their constants, over N, D and
    granularity G: the fit gives them back, and the result carries the published values."""
    from scalestudy.scaling.fit_text import _fit_lines

    form = get_form("krajewski_ndg")
    p = form.published
    rows = []
    for n in (3e7, 1e8, 3e8, 1e9):
        for d in (1e9, 4e9, 1.6e10):
            for g in (1, 2, 4, 8, 16):
                loss = p["c"] + (p["g"] / g ** p["gamma"] + p["a"]) / n ** p["alpha"]
                rows.append(
                    {"N": n, "D": d, "granularity": g, "loss": loss + p["b"] / d ** p["beta"]}
                )
    table = _moe_table(tmp_path / "kraj.csv", rows)
    fit = fit_form(form, table, np.zeros((0, len(rows))), FitSettings(), 6.0)
    for name, value in p.items():
        assert fit["params"][name]["value"] == pytest.approx(value, rel=0.02), name
    assert fit["published"] == p
    assert any(line.strip().startswith("published: a 18.1") for line in _fit_lines("k", fit))
    with pytest.raises(ScalingDataError, match=r"clark_ne needs E.*a column named experts"):
        fit_form(get_form("clark_ne"), table, np.zeros((0, len(rows))), FitSettings(), 6.0)


@pytest.mark.parametrize("law", ["chinchilla3", "kaplan_n", "kaplan_nd_E", "krajewski_ndg"])
def test_a_runaway_bootstrap_fit_is_inf_not_a_warning(law):
    """A resample whose fit ran off to a huge log coefficient: its named parameters are inf
    (the `bound` flag counts them), and nothing is printed on the terminal."""
    import warnings

    form = get_form(law)
    theta = np.full((1, len(form.params)), 800.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        named = form.named(theta)
    assert any(np.isinf(v).all() for v in named.values())


def _smoke_ladder(rng, seeds=(5, 3, 3, 3)):
    """The smoke study's design: 5/3/3/3 seeds at 4 sizes, each rung at its own step count,
    losses on L = E + (N_c/N)^alpha with seed noise like its runs' (5% at the smallest rung,
    2% above it, in log loss)."""
    sizes = np.array([14.1e3, 25e3, 38e3, 84e3])
    N = np.repeat(sizes, seeds)
    sd = np.repeat([0.05, 0.02, 0.02, 0.02], seeds)
    D = np.repeat(sizes * 10, seeds) * np.exp(rng.normal(0, 0.001, N.size))  # packing jitter
    loss = (0.37 + (7600.0 / N) ** 1.46) * np.exp(rng.normal(0, sd))
    t = RunTable([f"r{i}" for i in range(N.size)], ["all"] * N.size, N, D, 6 * N * D, loss)
    t.choices = {"groups": []}
    return t


def test_stratified_bootstrap_keeps_every_size_and_its_run_count():
    counts, df = stratified_counts([0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3], 400, 0)
    assert df == 4 + 2 + 2 + 2
    for size in ([0, 1, 2, 3, 4], [5, 6, 7], [8, 9, 10], [11, 12, 13]):
        np.testing.assert_allclose(counts[:, size].sum(axis=1), len(size))  # keeps its weight
        assert (counts[:, size].max(axis=1) > 0).all()  # and is never lost
    # A size's mean over its resamples varies by s^2 / n, not (n - 1) / n of it.
    y = np.array([0.0, 1.0, 2.0])
    c, _ = stratified_counts([0, 0, 0], 20000, 1)
    assert np.var(c @ y / 3) == pytest.approx(np.var(y, ddof=1) / 3, rel=0.05)
    # Sizes trained once are resampled among themselves, as before: with none repeated, the
    # draws are run_counts' own.
    np.testing.assert_array_equal(stratified_counts([0, 1, 2, 3], 5, 3)[0], run_counts(4, 5, 3))


def test_loss_law_intervals_cover_at_the_smoke_studys_design():
    """The interval `fit_cells` reports for alpha_N and E of L = E + (N_c/N)^alpha_N covers
    the truth at 90-98% (two-sided: too wide fails too) on 120 simulated 5/3/3/3 ladders."""
    rng = np.random.default_rng(11)
    sims, hits = 120, {"alpha_N": 0, "E": 0}
    for i in range(sims):
        s = FitSettings(laws=("kaplan_n",), bootstrap=400, seed=i)
        fit = fit_cells(_smoke_ladder(rng), s)["cells"]["all"]["fits"]["kaplan_n"]
        for name, truth in (("alpha_N", 1.46), ("E", 0.37)):
            lo, hi = fit["params"][name]["ci"]
            hits[name] += lo <= truth <= hi
    # Binomial(120, 0.95) lies in [108, 118] with probability 0.98.
    for name, h in hits.items():
        assert 0.90 <= h / sims <= 0.98, (name, h / sims)


def test_a_law_over_rungs_that_train_their_own_steps_is_labelled_l_of_n_and_d_of_n():
    t = _smoke_ladder(np.random.default_rng(0))
    fit = fit_cells(t, FitSettings(laws=("kaplan_n",), bootstrap=0))["cells"]["all"]["fits"]
    assert fit["kaplan_n"]["formula"] == "L(N, D(N)) = (N_c/N)^alpha_N + E"
    assert "not one of N at fixed D" in fit["kaplan_n"]["along"]
    # The same runs at one token count (seeds' packing jitter only): a law in N alone.
    t.D = np.full(t.N.size, 1e6) * np.exp(np.random.default_rng(1).normal(0, 0.001, t.N.size))
    fit = fit_cells(t, FitSettings(laws=("kaplan_n",), bootstrap=0))["cells"]["all"]["fits"]
    assert fit["kaplan_n"]["formula"] == "L(N) = (N_c/N)^alpha_N + E"
    assert "along" not in fit["kaplan_n"]
