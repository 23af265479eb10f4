"""Fits the data do not support come back flagged with the reason; sound fits do not."""

import numpy as np

from scalestudy.scaling import flags
from scalestudy.scaling.fit_text import format_table
from scalestudy.scaling.forms import get_form
from scalestudy.scaling.laws import FitSettings, fit_cells, fit_form
from scalestudy.scaling.resample import run_counts
from scalestudy.scaling.table import RunTable


def _table(N, D, loss, cell="all"):
    N, D, loss = (np.asarray(a, dtype=float) for a in (N, D, loss))
    ids = [f"r{i}" for i in range(len(N))]
    t = RunTable(ids, [cell] * len(N), N, D, 6 * N * D, loss)
    t.choices = {"c_kind": "6nd", "groups": []}
    return t


def _fit(law, t, resamples=0, **kw):
    s = FitSettings(bootstrap=resamples, **kw)
    return fit_form(get_form(law), t, run_counts(len(t.N), resamples, 0), s, 6.0)


def _kinds(fit):
    return {f.split(":")[0] for f in fit["flags"]}


def test_smoke_study_like_fit_with_four_sizes_is_flagged():
    # Four tiny sizes of a smoke study, loss close to a pure power law: E runs to its bound.
    rng = np.random.default_rng(0)
    N = np.array([2.5e4, 5.5e4, 1.1e5, 1.9e5])
    t = _table(N, np.full(4, 6e5), 3.2 * (N / 1e4) ** -0.1 * np.exp(rng.normal(0, 0.003, 4)))
    fit = _fit("kaplan_n", t, resamples=60)
    assert {"points", "bound"} <= _kinds(fit)
    assert any("4 points for 3 parameters" in f for f in fit["flags"])
    assert any(f.startswith("bound: E") for f in fit["flags"])


def test_e_on_its_bound_is_flagged_even_with_many_points():
    N = np.geomspace(1e6, 1e10, 20)
    t = _table(N, N * 20, (8.8e13 / N) ** 0.076)  # no irreducible term at all
    fit = _fit("kaplan_n", t)
    assert fit["params"]["E"]["value"] < 1e-3
    assert any("E = " in f and "sits on its bound 0" in f for f in fit["flags"])


def test_six_point_approach3_fit_is_flagged(iso_table):
    keep = [0, 3, 6, 14, 17, 20]  # two budgets, three sizes each
    t = _table(iso_table.N[keep], iso_table.D[keep], iso_table.loss[keep])
    fit = _fit("chinchilla3", t, resamples=40)
    assert "points" in _kinds(fit)
    assert any("6 points for 5 parameters" in f for f in fit["flags"])


def test_span_judges_what_the_law_says_not_how_it_is_written():
    from scalestudy.scaling.flags import param_flags

    # A coefficient's interval over 53 decades is no flag by itself; E's reaching 0 is.
    params = {"A": {"value": 400.0, "ci": [10.0, 1e54]}, "E": {"value": 1.7, "ci": [1e-5, 3.0]}}
    flags = param_flags(params, {}, 0.95, lowest_loss=2.0)
    assert not any(f.startswith("span: A") for f in flags)
    assert any(f.startswith("bound: E's 95% interval reaches down to 1e-05") for f in flags)
    # A small, tight exponent: N_c = exp(a / alpha) moves over decades between resamples,
    # yet the law is determined (alpha's interval and the predictions are tight): no span.
    rng = np.random.default_rng(4)
    N = np.geomspace(1e6, 1e9, 10)
    t = _table(N, N * 20, (1e60 / N) ** 0.01 * np.exp(rng.normal(0, 0.01, 10)))
    fit = _fit("kaplan_n_noE", t, resamples=100)
    lo, hi = fit["params"]["N_c"]["ci"]
    assert np.log10(hi / lo) > 6  # what the former coefficient rule flagged
    assert "span" not in _kinds(fit)
    # Few noisy runs: the predictions within the data are not determined: span.
    t = _table(N[:4], N[:4] * 20, 3.0 * (N[:4] / 1e6) ** -0.05 * np.exp([0.2, -0.2, 0.2, -0.2]))
    flags = _fit("kaplan_n_noE", t, resamples=100)["flags"]
    assert any(f.startswith("span: the law's predicted loss at N = ") for f in flags)


def test_exponent_whose_resamples_disagree_in_sign_is_flagged():
    rng = np.random.default_rng(3)
    N = np.geomspace(1e6, 1e9, 12)
    t = _table(N, N * 20, 3.0 * np.exp(rng.normal(0, 0.02, 12)))  # no trend, only noise
    fit = _fit("kaplan_n_noE", t, resamples=100)
    assert "sign" in _kinds(fit)
    assert any("bootstrap fits give alpha_N of the opposite sign" in f for f in fit["flags"])


def test_outlying_run_is_flagged_by_name(make_isoflop):
    t = make_isoflop(noise=0.002)
    t.loss[10] *= 1.15
    fit = _fit("chinchilla3", t)
    assert "outliers" in _kinds(fit)
    assert fit["residuals"]["outlier_runs"] == [t.run_id[10]]


def test_a_small_residual_on_a_near_perfect_fit_is_no_outlier():
    # Six sizes on an exact law but for one point 5% low: the others' residuals are near 0,
    # so without a floor on their spread that point would sit "beyond 5 standard deviations".
    N = np.geomspace(1e4, 3e5, 6)
    loss = (6e4 / N) ** 0.31
    loss[2] *= 0.95
    assert "outliers" not in _kinds(_fit("kaplan_n_noE", _table(N, N * 20, loss)))
    loss[2] *= 0.7 / 0.95  # 30% low is one
    assert "outliers" in _kinds(_fit("kaplan_n_noE", _table(N, N * 20, loss)))


def test_sound_fits_carry_no_flags(make_isoflop):
    # Two seeds of every (N, D): a sound design.
    a, b = (make_isoflop(budgets=(1e18, 3e18, 1e19, 3e19, 1e20, 3e20), seed=i) for i in (0, 1))
    t = RunTable(
        a.run_id + [f"{r}-s1" for r in b.run_id],
        a.cell + b.cell,
        *(np.concatenate([getattr(a, k), getattr(b, k)]) for k in ("N", "D", "C", "loss")),
    )
    t.choices = a.choices
    res = fit_cells(t, settings=FitSettings(laws=("chinchilla3", "chinchilla2"), bootstrap=40))
    for law, fit in res["cells"]["all"]["fits"].items():
        assert fit["flags"] == [], (law, fit["flags"])


def test_answers_beyond_the_data_are_flagged_as_extrapolation(iso_table):
    s = FitSettings(laws=("chinchilla3",), bootstrap=20, at_compute=(3e19, 1e22))
    res = fit_cells(iso_table, settings=s)
    inside, beyond = res["cells"]["all"]["fits"]["chinchilla3"]["at_compute"]
    assert inside["extrapolation"] is None
    assert "100x the largest run's compute 1e+20" in beyond["extrapolation"]
    row = res["comparison"]["at"][-1]  # default budgets: largest C, x10, x100
    assert "extrapolation" in row["extrapolation"]
    text = format_table(res)
    assert "! extrapolation: C = 1e+22" in text


def test_flags_reach_the_text_output(iso_table):
    keep = [0, 3, 6, 14, 17, 20]
    t = _table(iso_table.N[keep], iso_table.D[keep], iso_table.loss[keep])
    res = fit_cells(t, settings=FitSettings(laws=("chinchilla3",), bootstrap=10))
    text = format_table(res)
    assert "FLAGGED" in text and "! points: 6 points for 5 parameters" in text


def test_flags_reach_the_study_report(iso_table):
    from scalestudy.study.report.fits import fits_lines

    keep = [0, 3, 6, 14, 17, 20]
    t = _table(iso_table.N[keep], iso_table.D[keep], iso_table.loss[keep])
    res = fit_cells(t, settings=FitSettings(laws=("chinchilla3",), bootstrap=10))
    row = next(line for line in fits_lines(res) if "| chinchilla3 |" in line)
    assert "**flagged**: points: 6 points for 5 parameters" in row


def test_frontier_fit_counts_the_runs_behind_its_points():
    # Four runs with long training curves: L(C) has many frontier points but only 4 runs.
    ids, N, D, C, L, curves = [], [], [], [], [], {}
    for n in (2.5e4, 5.5e4, 1.1e5, 1.9e5):
        d = np.geomspace(2e4, 6e5, 30)
        loss = 0.6 + 2.2 * (n / 1e4) ** -0.25 + 40 * d**-0.3
        rid = f"{n:.3g}"
        curves[rid] = {"C": 6 * n * d, "D": d, "loss": loss}
        ids.append(rid)
        N.append(n), D.append(d[-1]), C.append(6 * n * d[-1]), L.append(loss[-1])
    t = RunTable(ids, ["all"] * 4, *(np.array(v) for v in (N, D, C, L)), curves=curves)
    t.choices = {"c_kind": "counted", "groups": [], "curve_points": "finished"}
    fit = _fit("kaplan_c", t)
    assert fit["n_points"] > 10
    assert any(f.startswith("points: 4 runs (behind") for f in fit["flags"])


def test_unequal_training_across_the_ladder_is_flagged_for_laws_in_one_variable():
    # Fixed steps: tokens per parameter fall from 60 to 2 up the ladder (as in a smoke study).
    N = np.geomspace(1e4, 3e5, 6)
    D = np.full(6, 6e5)
    loss = (6e4 / N) ** 0.3 + 0.05 * (6e5 / D)
    fit = _fit("kaplan_n_noE", _table(N, D, loss))
    (flag,) = [f for f in fit["flags"] if f.startswith("training:")]
    assert "from 2 (N = 3e+05) to 60 (N = 1e+04), 30x apart" in flag
    even = _fit("kaplan_n_noE", _table(N, 20 * N, loss))
    assert "training" not in _kinds(even)


def test_a_single_seed_is_flagged_and_repeated_sizes_are_not():
    N = np.geomspace(1e4, 3e5, 6)
    loss = (6e4 / N) ** 0.3
    assert "seed" in _kinds(_fit("kaplan_n_noE", _table(N, 20 * N, loss)))
    NN = np.repeat(N, 2)
    noisy = np.repeat(loss, 2) * np.exp(np.tile([0.01, -0.01], 6))
    assert "seed" not in _kinds(_fit("kaplan_n_noE", _table(NN, 20 * NN, noisy)))
    # Seeds of one planned run count slightly different tokens (packing): still repeats.
    D = 20 * N
    DD = np.concatenate([D, D[:1] * 1.0002])
    repeat = np.concatenate([loss, loss[:1] * 1.01])
    fit = _fit("kaplan_n_noE", _table(np.append(N, N[0]), DD, repeat))
    # One size with two seeds does not vouch for the five with one (the flag is per size).
    flag = next(f for f in fit["flags"] if f.startswith("seed"))
    assert "5 of 6 (N, D) points trained by one run only (5 sizes, N = " in flag
    both = _table(np.concatenate([N, N]), np.concatenate([D, D * 1.0002]), np.tile(loss, 2))
    assert "seed" not in _kinds(_fit("kaplan_n_noE", both))
    # ... but a size trained at twice the tokens is another point, not a repeat.
    twice = _table(np.append(N, N[0]), np.concatenate([D, D[:1] * 2]), repeat)
    assert "seed" in _kinds(_fit("kaplan_n_noE", twice))


def test_residuals_that_curve_flag_a_misspecified_form():
    # A power law with an irreducible term, fitted without one: residuals bow; with E: none.
    N = np.geomspace(1e4, 1e7, 10)
    rng = np.random.default_rng(0)
    loss = (1.5 + (6e4 / N) ** 0.3) * np.exp(rng.normal(0, 0.002, 10))
    flags = _fit("kaplan_n_noE", _table(N, 20 * N, loss))["flags"]
    assert any(f.startswith("misfit: the residuals trend or curve along log N") for f in flags)
    assert "misfit" not in _kinds(_fit("kaplan_n", _table(N, 20 * N, loss)))


def test_a_prediction_interval_that_runs_off_is_called_unbounded_not_a_percentage():
    from scalestudy.scaling.flags import MAX_PRED_SPAN, prediction_span_flag

    rng = np.random.default_rng(5)
    x_P, pred_P = np.array([1e5, 1e6]), np.array([3.0, 2.0])
    tight_R = pred_P * np.exp(rng.normal(0, 0.01, (200, 2)))
    assert prediction_span_flag(pred_P, tight_R, 0.95, x_P, "N") == []

    # A wide but bounded interval: its ends (as numpy's percentiles give them) and its share.
    wide_R = tight_R.copy()
    wide_R[:, 1] = pred_P[1] * np.exp(rng.normal(0, 0.3, 200))
    [flag] = prediction_span_flag(pred_P, wide_R, 0.95, x_P, "N")
    lo, hi = np.percentile(wide_R[:, 1], [2.5, 97.5])
    share = (hi - lo) / pred_P[1]
    assert share > MAX_PRED_SPAN
    assert f"at N = 1e+06 has a 95% interval [{lo:.3g}, {hi:.3g}] around 2, {share:.0%}" in flag

    # A tenth of the bootstrap fits run off to 1e15 (what printed "454984388109619776%").
    runaway_R = tight_R.copy()
    runaway_R[:20, 1] = 9e15
    [flag] = prediction_span_flag(pred_P, runaway_R, 0.95, x_P, "N")
    assert (
        "at N = 1e+06 has an unbounded 95% interval around 2 (bootstrap fits reach 9e+15)" in flag
    )
    assert "%" not in flag.replace("95%", "")

    # Overflowed fits (inf) count as beyond every finite one; failed fits (NaN) are dropped.
    runaway_R[:20, 1] = np.inf
    runaway_R[:, 0] = np.nan
    [flag] = prediction_span_flag(pred_P, runaway_R, 0.95, x_P, "N")
    assert "unbounded 95% interval" in flag and "reach past the largest float" in flag


def test_a_grid_of_sizes_and_token_counts_is_counted_in_points_and_sizes():
    """5 sizes x 4 token counts, each trained once: 20 (N, D) points of 5 sizes, not "20 of 20
    sizes"."""
    N = np.repeat(np.geomspace(1e7, 1e9, 5), 4)
    D = np.tile(np.geomspace(2e9, 6e10, 4), 5)
    [flag] = flags.seed_flag(N, D)
    assert flag.startswith("seed: 20 of 20 (N, D) points trained by one run only (5 sizes, N = ")
    assert "N = 1e+07, 3.16e+07, 1e+08, 3.16e+08, 1e+09)" in flag
