"""Task scaling laws: both steps recover known parameters; the backtest predicts the largest."""

import numpy as np
import pytest

from scalestudy.scaling.laws import FitSettings
from scalestudy.scaling.table import RunTable, ScalingDataError
from scalestudy.scaling.task_law import (
    fit_sigmoid,
    fit_task_laws,
    sigmoid,
    sigmoid_jacobian,
    task_loss_from_examples,
)

TASK = {"E": 0.6, "A": 40.0, "alpha": 0.3, "B": 60.0, "beta": 0.3}
SIG = np.array([1.2, 6.0, 0.7, 0.25])  # L0, k, a, b (b: chance of a 4-way task)


def _task_table(noise=0.0, seed=0, sizes=6, with_chance=True):
    """Runs on an N x D grid whose task loss follows a Chinchilla law and whose accuracy is a
    sigmoid of it (both optionally with noise)."""
    rng = np.random.default_rng(seed)
    N, D = np.meshgrid(np.geomspace(1e6, 1e8, sizes), np.geomspace(2e7, 2e9, 4))
    N, D = N.ravel(), D.ravel()
    L = TASK["E"] + TASK["A"] / N ** TASK["alpha"] + TASK["B"] / D ** TASK["beta"]
    L = L * np.exp(rng.normal(0, noise, L.size))
    acc = sigmoid(L, SIG) + rng.normal(0, noise, L.size)
    extra = {"eval/mc/task_loss": L, "eval/mc/acc": acc, "eval/mc/n": np.full(L.size, 1000.0)}
    if with_chance:
        extra["eval/mc/chance"] = np.full(L.size, SIG[3])
    ids = [f"r{i}" for i in range(L.size)]
    return RunTable(ids, ["all"] * L.size, N, D, 6 * N * D, L * 0 + 3.0, extra)


def test_sigmoid_recovers_known_parameters_with_and_without_chance():
    L = np.linspace(0.6, 2.0, 30)
    acc = sigmoid(L, SIG)
    np.testing.assert_allclose(fit_sigmoid(L, acc, np.ones_like(L), None), SIG, rtol=1e-3)
    np.testing.assert_allclose(fit_sigmoid(L, acc, np.ones_like(L), 0.25), SIG, rtol=1e-4)
    # Zero weight leaves a point out: a wild point with weight 0 changes nothing.
    bad = acc.copy()
    bad[3] = 0.99
    w = np.ones_like(L)
    w[3] = 0.0
    np.testing.assert_allclose(fit_sigmoid(L, bad, w, 0.25), SIG, rtol=1e-4)


def test_sigmoid_jacobian_equals_central_differences():
    L = np.linspace(0.2, 3.0, 25)
    for p in (SIG, np.array([2.5, 40.0, 0.3, 0.5]), np.array([0.9, 0.0, 1.0, 0.0])):
        h = 1e-6
        numeric = np.stack(
            [(sigmoid(L, p + h * e) - sigmoid(L, p - h * e)) / (2 * h) for e in np.eye(4)], axis=1
        )
        np.testing.assert_allclose(sigmoid_jacobian(L, p), numeric, rtol=1e-6, atol=1e-8)


def test_two_step_law_recovers_known_parameters():
    res = fit_task_laws(_task_table(), FitSettings(bootstrap=0))
    fit = res["cells"]["all"]["mc"]
    got = {k: v["value"] for k, v in fit["task_loss"]["params"].items()}
    for k, v in TASK.items():
        assert got[k] == pytest.approx(v, rel=1e-3), k
    sig = {k: v["value"] for k, v in fit["accuracy"]["params"].items()}
    np.testing.assert_allclose([sig[k] for k in ("L0", "k", "a", "b")], SIG, rtol=1e-3)
    assert fit["accuracy"]["chance_fixed"] == pytest.approx(0.25)


def test_backtest_predicts_the_largest_size_within_its_interval():
    s = FitSettings(bootstrap=40, seed=1)
    res = fit_task_laws(_task_table(noise=0.004), s, holdout_largest=True)
    bt = res["cells"]["all"]["mc"]["backtest"]
    assert bt["N"] == pytest.approx(1e8) and len(bt["held_out"]) == 4
    # The noiseless law's accuracy at the held-out runs, computed independently.
    t = _task_table()
    held = np.isclose(t.N, t.N.max())
    truth = float(sigmoid(t.extra["eval/mc/task_loss"][held], SIG).mean())
    assert abs(bt["predicted"] - truth) < 0.02
    assert bt["error"] == pytest.approx(bt["predicted"] - bt["observed"])
    lo, hi = bt["error_ci"]
    assert lo < hi and lo <= bt["error"] <= hi
    assert bt["observed_ci"][0] < bt["observed"] < bt["observed_ci"][1]


def test_backtest_error_is_large_when_the_largest_size_breaks_the_trend():
    t = _task_table()
    held = np.isclose(t.N, t.N.max())
    t.extra["eval/mc/acc"] = np.where(held, 0.95, t.extra["eval/mc/acc"])
    bt = fit_task_laws(t, FitSettings(bootstrap=0), holdout_largest=True)["cells"]["all"]["mc"]
    assert bt["backtest"]["error"] < -0.1  # predicted well below the observed 0.95


def test_flags_and_refusals():
    # One run per (N, D): a single seed, flagged; the same runs twice (two seeds) are not.
    t = _task_table(noise=0.01, with_chance=False)
    fit = fit_task_laws(t, FitSettings(bootstrap=0))["cells"]["all"]["mc"]
    assert any(f.startswith("seed:") for f in fit["task_loss"]["flags"])
    two = _task_table(noise=0.01, seed=1, with_chance=False)
    both = RunTable(
        t.run_id + [f"s{r}" for r in two.run_id],
        t.cell + two.cell,
        *(np.concatenate([getattr(t, a), getattr(two, a)]) for a in ("N", "D", "C", "loss")),
        {k: np.concatenate([v, two.extra[k]]) for k, v in t.extra.items()},
    )
    fit = fit_task_laws(both, FitSettings(bootstrap=0))["cells"]["all"]["mc"]
    assert not any(f.startswith("seed:") for f in fit["task_loss"]["flags"])
    flat = _task_table()
    flat.extra["eval/mc/acc"] = np.full(len(flat.N), 0.25)
    fit = fit_task_laws(flat, FitSettings(bootstrap=0))["cells"]["all"]["mc"]
    assert any(f.startswith("flat:") for f in fit["accuracy"]["flags"])
    # One run's task loss 40% off the law: named as an outlier, as in the loss laws.
    odd = _task_table(noise=0.002)
    odd.extra["eval/mc/task_loss"][5] *= 1.4
    fit = fit_task_laws(odd, FitSettings(bootstrap=0))["cells"]["all"]["mc"]
    assert any(f.startswith("outliers:") and "r5 (" in f for f in fit["task_loss"]["flags"])
    few = _task_table(sizes=2)
    fit = fit_task_laws(few, FitSettings(bootstrap=0))["cells"]["all"]["mc"]
    assert "3 or more distinct values of N" in fit["skipped"]
    none = _task_table()
    none.extra.pop("eval/mc/task_loss")
    with pytest.raises(ScalingDataError, match="task loss"):
        fit_task_laws(none, FitSettings(bootstrap=0))


def test_task_loss_from_examples_is_the_mean_normalised_nll():
    assert task_loss_from_examples([-2.0, -6.0], [2, 3]) == pytest.approx((1.0 + 2.0) / 2)
    with pytest.raises(ScalingDataError):
        task_loss_from_examples([-1.0], [0])


def test_cli_task_law_backtest_table_json_and_figure(tmp_path, capsys):
    import json

    from scalestudy.cli.main import main
    from scalestudy.scaling.table_input import load_table
    from scalestudy.scaling.task_law_plots import fig_task_law

    t = _task_table(noise=0.003)
    path = tmp_path / "runs.csv"
    cols = ["N", "D", "loss", "eval/mc/task_loss", "eval/mc/acc", "eval/mc/chance"]
    rows = zip(t.N, t.D, t.loss, *(t.extra[c] for c in cols[3:]))
    path.write_text("\n".join([",".join(cols)] + [",".join(map(str, r)) for r in rows]))
    out = tmp_path / "task.json"
    argv = ["fit", str(path), "--task-law", "--holdout-largest", "--bootstrap", "10"]
    assert main([*argv, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "backtest at N = 1e+08" in text and "b fixed at chance 0.25" in text
    res = json.loads(out.read_text())
    bt = res["task_laws"]["cells"]["all"]["mc"]["backtest"]
    assert bt["error"] == pytest.approx(bt["predicted"] - bt["observed"])
    fig = fig_task_law(load_table(path), res)
    labels = [x.get_text() for x in fig.axes[1].get_legend().get_texts()]
    assert any(label.startswith("backtest: predicted at N = 1e+08") for label in labels)
    assert main(["fit", str(path), "--holdout-largest"]) == 2
    assert "add --task-law" in capsys.readouterr().err
    assert main(["fit", str(path), "--task-law", "--task-form", "quadratic"]) == 2


def test_backtest_interval_that_misses_its_prediction_is_drawn_from_its_ends():
    """A percentile interval of a nonlinear prediction need not hold the point estimate; the
    figure draws the interval's own ends (an error bar from the point refused it)."""
    from scalestudy.scaling.task_law_plots import fig_task_law

    t = _task_table(noise=0.003)
    s = FitSettings(bootstrap=10, seed=0)
    res = {"task_laws": fit_task_laws(t, s, holdout_largest=True)}
    bt = res["task_laws"]["cells"]["all"]["mc"]["backtest"]
    bt["predicted_ci"] = [bt["predicted"] + 0.01, bt["predicted"] + 0.05]  # misses the point
    fig = fig_task_law(t, res)
    (bars,) = [c for c in fig.axes[1].collections if c.get_gid() == "backtest_interval"]
    (segment,) = bars.get_segments()
    assert segment[:, 1].tolist() == pytest.approx(bt["predicted_ci"])


def test_task_names_take_a_tasks_groups_up_to_a_limit():
    from scalestudy.scaling.task_law import task_names

    t = _task_table(sizes=3)
    ones = np.ones(len(t.N))
    for g in ("a", "b", "c"):
        t.extra[f"eval/mc/{g}/task_loss"] = ones
        t.extra[f"eval/mc/{g}/acc"] = ones
    t.extra["eval/mc/field/syntax/acc"] = ones  # a breakdown without a task loss
    t.extra["eval/lone/task_loss"] = ones  # a task loss without an accuracy
    assert task_names(t) == ["mc", "mc/a", "mc/b", "mc/c"]
    assert task_names(t, max_groups=2) == ["mc"]  # BLiMP's 67 paradigms stay out


def test_auto_form_needs_n_and_d_to_vary_independently():
    """A ladder at a fixed ratio of tokens to parameters (D = 20 N) varies N and D together:
    a law in N and D is not identifiable there, so `auto` fits the law in N alone; it must
    still recover the task loss's exponent in N (the D term is a power of N too)."""
    from scalestudy.scaling.task_law import varies_independently

    N = np.geomspace(2.5e4, 8e5, 6)
    assert not varies_independently(N, 20 * N)
    grid = _task_table()
    assert varies_independently(grid.N, grid.D)
    assert not varies_independently(N, np.full(6, 1e9))  # fixed tokens
    L = TASK["E"] + TASK["A"] / N ** TASK["alpha"]  # D's term folded into N's: same exponent
    acc = sigmoid(L, SIG)
    extra = {"eval/mc/task_loss": L, "eval/mc/acc": acc, "eval/mc/n": np.full(6, 1000.0)}
    table = RunTable([f"r{i}" for i in range(6)], ["all"] * 6, N, 20 * N, 120 * N * N, L, extra)
    fit = fit_task_laws(table, FitSettings(bootstrap=0))["cells"]["all"]["mc"]
    assert fit["task_loss"]["formula"] == "L_t = (N_c/N)^alpha_N + E"
    got = {k: v["value"] for k, v in fit["task_loss"]["params"].items()}
    assert got["alpha_N"] == pytest.approx(TASK["alpha"], rel=1e-2)


def _seeded_ladder(rng, seeds=3, sizes=5, run_sd=0.02):
    """A fixed-data ladder with `seeds` runs per size: each run's task loss and accuracy carry
    its own draw (initialisation and data order), as retrained runs do."""
    N = np.repeat(np.geomspace(1e6, 1e8, sizes), seeds)
    L = TASK["E"] + TASK["A"] / N ** TASK["alpha"] + TASK["B"] / 2e9 ** TASK["beta"]
    L = L * np.exp(rng.normal(0, run_sd, L.size))
    acc = sigmoid(L, SIG) + rng.normal(0, run_sd, L.size)
    extra = {"eval/mc/task_loss": L, "eval/mc/acc": acc, "eval/mc/chance": np.full(L.size, 0.25)}
    ids = [f"r{i}" for i in range(L.size)]
    return RunTable(ids, ["all"] * L.size, N, N * 0 + 2e9, 6 * N * 2e9, L * 0 + 3.0, extra)


@pytest.mark.slow
def test_backtest_intervals_cover_retrained_runs_at_the_stated_rate():
    """The run is the unit: on simulated ladders of 3 seeds per size, the backtest's 95%
    interval holds 0 in at least 90% of them once the held-out runs' own variation is in it,
    and that interval is wider than the law's bootstrap alone in every one."""
    rng = np.random.default_rng(7)
    s = FitSettings(bootstrap=100, seed=3)
    covered = law_only = 0
    sims = 60
    ratios = []
    for _ in range(sims):
        bt = fit_task_laws(_seeded_ladder(rng), s, "kaplan_n", holdout_largest=True)
        bt = bt["cells"]["all"]["mc"]["backtest"]
        assert bt["run_df"] == 8 and bt["run_sd"] > 0  # 4 fitted sizes x (3 - 1)
        covered += bt["error_ci"][0] <= 0.0 <= bt["error_ci"][1]
        law = np.array(bt["predicted_ci"]) - bt["observed"]
        law_only += law[0] <= 0.0 <= law[1]
        ratios.append((bt["error_ci"][1] - bt["error_ci"][0]) / (law[1] - law[0]))
    assert 0.90 <= covered / sims <= 1.0 and covered >= law_only
    # Wider than the law's interval alone: on average clearly, and in every simulation up to
    # the jitter of a 100-resample percentile (where the runs' spread is small beside the
    # law's, the two widths can tie).
    assert np.mean(ratios) > 1.05 and min(ratios) > 0.99


def test_task_laws_fitted_in_two_processes_equal_one_process():
    import json

    t = _task_table(noise=0.02, seed=3)
    n = len(t.run_id)
    both = RunTable(
        [*t.run_id, *(f"b{r}" for r in t.run_id)],
        ["a"] * n + ["b"] * n,
        *(np.concatenate([v, v]) for v in (t.N, t.D, t.C, t.loss)),
        {k: np.concatenate([v, v[::-1]]) for k, v in t.extra.items()},
    )
    s = FitSettings(bootstrap=10)
    one = fit_task_laws(both, s, holdout_largest=True)
    two = fit_task_laws(both, s, holdout_largest=True, workers=2)
    assert set(one["cells"]) == {"a", "b"}
    assert json.dumps(two, sort_keys=True, default=str) == json.dumps(
        one, sort_keys=True, default=str
    )


def test_task_law_predictions_and_interval_ends_stay_within_chance_and_one():
    """acc = b + a sigmoid(...) with b at chance reaches b + a: a must not exceed 1 - b. On a
    ladder whose accuracy still climbs steeply at its largest sizes, a sigmoid free to take
    a up to 1 ran past 1 at the held-out size (the smoke study printed 1.25)."""
    # The held-out size far beyond the fitted ones: its task loss is far below theirs.
    N = np.repeat([1e6, 2e6, 4e6, 8e6, 1.6e7, 1e9], 3)
    rng = np.random.default_rng(5)
    L = (0.6 + 40.0 / N**0.3) * np.exp(rng.normal(0, 0.01, N.size))
    # Accuracy linear in task loss, from 0.3 to 0.97 over the fitted sizes: no saturation in
    # sight, so only the bound keeps the extrapolated sigmoid below 1 (unbounded, this data
    # gave a prediction of 1.036 with an interval reaching 1.125).
    fitted = L[:15]  # every size but the held-out largest
    acc = np.clip(0.3 + 0.67 * (L.max() - L) / np.ptp(fitted), 0, 1)
    acc = acc + rng.normal(0, 0.01, N.size)
    extra = {"eval/mc/task_loss": L, "eval/mc/acc": acc, "eval/mc/chance": np.full(N.size, 0.25)}
    t = RunTable([f"r{i}" for i in range(N.size)], ["all"] * N.size, N, N * 0 + 1e9, N, L, extra)
    fit = fit_task_laws(t, FitSettings(bootstrap=60, seed=2), "kaplan_n", holdout_largest=True)
    fit = fit["cells"]["all"]["mc"]
    a, b = (fit["accuracy"]["params"][k]["value"] for k in ("a", "b"))
    assert b == pytest.approx(0.25) and a <= 1 - b + 1e-12
    assert fit["accuracy"]["params"]["a"]["ci"][1] <= 1 - b + 1e-12
    bt = fit["backtest"]
    assert 0.25 <= bt["predicted"] <= 1.0
    assert 0.25 <= bt["predicted_ci"][0] <= bt["predicted_ci"][1] <= 1.0
    lo, hi = bt["error_ci"]
    assert -bt["observed"] <= lo <= hi <= 1.0 - bt["observed"]
    # Far below the fitted losses the law approaches 1, never past it.
    p = [fit["accuracy"]["params"][k]["value"] for k in ("L0", "k", "a", "b")]
    assert float(sigmoid(np.array([0.0]), p)[0]) <= 1.0
    # Without a chance column b is fitted, and a + b stays within 1 as well.
    free = fit_sigmoid(L, acc, np.ones_like(L), None)
    assert free[2] + free[3] <= 1.0 + 1e-12
