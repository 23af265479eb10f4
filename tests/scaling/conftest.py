"""Synthetic runs drawn from known scaling laws, shared by the scaling tests."""

import numpy as np
import pytest

from scalestudy.scaling.table import RunTable

TRUE = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}


def chinchilla_loss(N, D, p=TRUE):
    return p["E"] + p["A"] / N ** p["alpha"] + p["B"] / D ** p["beta"]


def isoflop_table(
    seed=0, noise=0.005, budgets=(1e18, 3e18, 1e19, 3e19, 1e20), sizes=7, cell="all", p=TRUE
):
    """Runs on IsoFLOP budgets (C = 6ND) with multiplicative log-normal noise."""
    rng = np.random.default_rng(seed)
    N, D, ids = [], [], []
    for C in budgets:
        for n in np.geomspace(C**0.5 / 40, C**0.5 / 2, sizes):
            N.append(n)
            D.append(C / (6 * n))
            ids.append(f"{cell}-{C:g}-{n:.3g}")
    N, D = np.array(N), np.array(D)
    loss = chinchilla_loss(N, D, p) * np.exp(rng.normal(0, noise, N.size))
    t = RunTable(ids, [cell] * N.size, N, D, 6 * N * D, loss)
    t.choices = {"c_kind": "6nd", "groups": []}
    return t


@pytest.fixture
def iso_table():
    return isoflop_table()


@pytest.fixture
def make_isoflop():
    return isoflop_table


@pytest.fixture
def true_params():
    return dict(TRUE)
