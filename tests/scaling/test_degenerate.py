"""Degenerate inputs give clear errors or clearly flagged fits, never silent numbers."""

import numpy as np
import pytest

from scalestudy.scaling import allocation
from scalestudy.scaling.forms import get_form
from scalestudy.scaling.laws import FitSettings, fit_cells, fit_form
from scalestudy.scaling.resample import run_counts
from scalestudy.scaling.table import RunTable, ScalingDataError


def _table(N, D, loss):
    N, D, loss = (np.asarray(a, dtype=float) for a in (N, D, loss))
    t = RunTable([str(i) for i in range(len(N))], ["all"] * len(N), N, D, 6 * N * D, loss)
    t.choices = {"c_kind": "6nd", "groups": []}
    return t


def _fit(law, t):
    return fit_form(get_form(law), t, np.zeros((0, len(t.N))), FitSettings(), 6.0)


def test_too_few_points_is_an_error():
    t = _table([1e6, 1e7, 1e8], [1e9, 1e9, 1e10], [3.0, 2.8, 2.6])
    with pytest.raises(ScalingDataError, match="5 parameters and needs at least 6 points; got 3"):
        _fit("chinchilla3", t)


def test_one_size_only_is_an_error():
    t = _table([1e7] * 6, np.geomspace(1e9, 1e11, 6), np.linspace(3, 2.5, 6))
    with pytest.raises(ScalingDataError, match=r"same N .*at least 2 distinct"):
        _fit("kaplan_n", t)


def test_flat_curve_is_flagged():
    N = np.geomspace(1e6, 1e9, 12)
    t = _table(N, N * 20, np.full(12, 3.0))
    flags = " ".join(_fit("kaplan_n", t)["flags"])
    assert "flat" in flags


def test_loss_rising_with_size_is_flagged():
    N = np.geomspace(1e6, 1e9, 12)
    t = _table(N, N * 20, 2.0 + 0.05 * np.log(N))
    flags = " ".join(_fit("kaplan_n_noE", t)["flags"])
    assert "alpha_N" in flags and "degenerate" in flags


def test_auto_reports_skipped_laws_with_reasons():
    t = _table([1e7] * 6, np.geomspace(1e9, 1e11, 6), np.linspace(3, 2.5, 6))
    res = fit_cells(t, settings=FitSettings(bootstrap=0))
    fits = res["cells"]["all"]["fits"]
    assert "same N" in fits["kaplan_n"]["skipped"]
    assert "finished-schedule points" in fits["chinchilla1"]["skipped"]
    assert "3 model sizes" in fits["chinchilla2"]["skipped"]
    assert "theta" in fits["kaplan_d"]  # L(D) is fine: D varies
    # Explicitly asked for, a law that cannot be fitted is an error naming the cell.
    with pytest.raises(ScalingDataError, match=r"cell 'all'.*same N"):
        fit_cells(t, settings=FitSettings(laws=("kaplan_n",), bootstrap=0))


def test_isoflop_budget_without_interior_minimum_is_left_out_and_flagged(make_isoflop):
    t = make_isoflop(budgets=(1e18, 1e19, 1e20), sizes=5)
    # Make the smallest budget's loss fall monotonically with N: no minimum inside.
    first = t.C.min() == t.C
    t.loss[first] = 4.0 - 0.1 * np.log(t.N[first])
    fit = allocation.approach2(t, run_counts(len(t.N), 10, 0), FitSettings())
    assert fit["n_budgets"] == 2
    assert any("no minimum inside" in f for f in fit["flags"])
