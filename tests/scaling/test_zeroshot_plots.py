"""Per-task zero-shot figure and the trend test of accuracy against compute."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import optimize, stats

from scalestudy.scaling import zeroshot_plots as zp


def _runs(slope: float, seed: int = 0, n: int = 400) -> list[zp.ScoredRun]:
    """Runs of two cells at four computes; task `a` (2 choices) and `b` (4 choices) whose
    log-odds of a right answer rise by `slope` per decade of compute in cell x/flm only."""
    rng = np.random.default_rng(seed)
    runs = []
    for cell_slope, arch in ((slope, "x"), (0.0, "y")):
        for i, c in enumerate([1e9, 1e10, 1e11, 1e12]):
            evals = {}
            for task, base, chance in (("a", 0.0, 0.5), ("b", -1.0, 0.25)):
                p = 1 / (1 + np.exp(-(base + cell_slope * (np.log10(c) - 10.5))))
                evals[f"eval/probes/{task}/acc"] = rng.binomial(n, p) / n
                evals[f"eval/probes/{task}/n"] = n
                evals[f"eval/probes/{task}/chance"] = chance
            evals["eval/probes/acc"] = 0.5  # the whole task: not a task of its own here
            evals["eval/probes/n"] = 2 * n
            runs.append(zp.ScoredRun(f"{arch}/flm", f"{i}K", c, 1000 * (i + 1), f"{i}K/0", evals))
    return runs


def test_task_scores_take_parts_and_skip_the_whole():
    scores = zp.task_scores(_runs(1.0))
    assert {s.task for s in scores} == {"a", "b"}
    assert len(scores) == 16 and all(s.n == 400 for s in scores)
    assert {s.chance for s in scores if s.task == "b"} == {0.25}


def test_tasks_are_ordered_by_their_gain_over_chance():
    def score(task, acc, chance):
        return zp.TaskScore(task, "x/flm", "1K", 1.0, 1.0, acc, 100, chance)

    scores = [score("easy", 0.9, 0.5), score("hard", 0.6, 0.25), score("flat", 0.3, 0.25)]
    scores += [score("easy", 0.8, 0.5), score("hard", 0.5, 0.25)]
    assert zp.task_order(scores) == ["easy", "hard", "flat"]  # gains 0.35, 0.30, 0.05


@pytest.mark.parametrize(("k", "n"), [(0, 20), (7, 20), (200, 400), (400, 400)])
def test_wilson_matches_scipy(k, n):
    ref = stats.binomtest(k, n).proportion_ci(0.95, method="wilson")
    assert zp.wilson(k, n) == pytest.approx((ref.low, ref.high), abs=1e-6)


def test_wilson_interval_holds_the_proportion_itself():
    # Every answer right (or wrong): rounding once put the upper bound below 1.0.
    for n in range(1, 1001):
        assert zp.wilson(n, n)[1] == 1.0 and zp.wilson(0, n)[0] == 0.0
        lo, hi = zp.wilson(n // 3, n)
        assert lo <= (n // 3) / n <= hi


def test_logistic_slope_equals_a_per_example_maximum_likelihood_fit():
    scores = zp.task_scores(_runs(0.8))
    rows = [s for s in scores if s.cell == "x/flm"]
    x = np.log10([s.flops for s in rows])
    got = zp.logistic_slope([s.task for s in rows], x, [s.correct for s in rows], [400] * 8)
    # independent: expand to one 0/1 outcome per example and minimise the negative log-lik.
    y = np.concatenate([[1] * s.correct + [0] * (s.n - s.correct) for s in rows])
    xe = np.repeat(x, 400)
    te = np.repeat([s.task == "b" for s in rows], 400).astype(float)

    def nll(beta):
        z = beta[0] + beta[1] * te + beta[2] * xe
        return np.sum(np.logaddexp(0, z) - y * z)

    ref = optimize.minimize(nll, np.zeros(3), method="BFGS").x
    assert got["slope"] == pytest.approx(ref[2], abs=1e-3)
    assert got["lo"] < 0.8 < got["hi"] and got["p"] < 1e-6


def test_trend_separates_a_rising_cell_from_a_flat_one():
    trend = zp.accuracy_trend(zp.task_scores(_runs(0.8, seed=3)))
    rising, flat = trend["x/flm"]["fit"], trend["y/flm"]["fit"]
    assert rising["lo"] > 0 and rising["p"] < 0.05 and rising["df"] == 2
    assert trend["x/flm"]["per_example"]["p"] < 1e-6
    assert flat["lo"] < 0 < flat["hi"] and flat["p"] > 0.05
    assert trend["x/flm"]["runs"] == 4 and trend["x/flm"]["examples"] == 3200
    # no variation in compute: no slope to estimate
    assert zp.logistic_slope(["a", "a"], np.array([1.0, 1.0]), [3, 4], [10, 10]) is None


def test_report_section_writes_a_panel_per_task_and_the_tables(tmp_path):
    runs = _runs(0.8)
    fig = zp.fig_task_accuracy(zp.task_scores(runs))
    panels = [ax for ax in fig.axes if ax.get_visible()]
    order = zp.task_order(zp.task_scores(runs))
    assert [ax.get_title().split()[0] for ax in panels] == order
    chances = {"a": 0.5, "b": 0.25}
    for ax, chance in zip(panels, [chances[t] for t in order], strict=True):
        assert chance in [line.get_ydata()[0] for line in ax.get_lines()]
    text = zp.report_section(runs, tmp_path)
    assert (tmp_path / "figures" / "zero_shot_tasks.png").is_file()
    table = [line for line in text.splitlines() if line.startswith("| x/flm | ")]
    assert len(table) == 4 + 1  # a row per run, and the cell's trend row
    assert zp.report_section([zp.ScoredRun("x/flm", "", 1.0, 0.0, "", {})], tmp_path) == ""


def test_run_slope_is_ordinary_least_squares_with_a_t_interval():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=7), rng.normal(size=7)
    got, ref = zp.run_slope(x, y), stats.linregress(x, y)
    assert got["slope"] == pytest.approx(ref.slope) and got["se"] == pytest.approx(ref.stderr)
    assert got["p"] == pytest.approx(ref.pvalue)
    assert got["hi"] - got["slope"] == pytest.approx(stats.t.ppf(0.975, 5) * ref.stderr)
    assert zp.run_slope(x[:2], y[:2]) is None and zp.run_slope(np.ones(5), y[:5]) is None


def _ladder(rng, slope: float, seeds: int = 3, sizes: int = 6, run_sd: float = 0.3) -> list:
    """A simulated cell: runs at `sizes` computes a half decade apart, `seeds` runs each,
    five tasks of 400 examples; a run's log-odds are its task's base + slope x log10 compute
    + the run's own offset (seed noise, sd `run_sd`), then binomial sampling."""
    scores = []
    bases = rng.normal(0.0, 1.0, size=5)
    for i in range(sizes):
        flops = 10 ** (9 + 0.5 * i)
        for seed in range(seeds):
            offset = rng.normal(0.0, run_sd)
            for t, base in enumerate(bases):
                logit = base + slope * (np.log10(flops) - 10) + offset
                k = rng.binomial(400, 1 / (1 + np.exp(-logit)))
                scores.append(
                    zp.TaskScore(
                        f"t{t}", "x/flm", f"s{i}", flops, 1.0, k / 400, 400, None, f"{i}.{seed}"
                    )
                )
    return scores


@pytest.mark.parametrize("seeds", [1, 3])
def test_the_run_level_interval_covers_the_truth_on_ladders_with_seed_noise(seeds):
    rng = np.random.default_rng(seeds)
    covered = per_example = 0
    sims = 400
    for _ in range(sims):
        t = zp.accuracy_trend(_ladder(rng, 0.4, seeds=seeds))["x/flm"]
        covered += t["fit"]["lo"] <= 0.4 <= t["fit"]["hi"]
        e = t["per_example"]
        per_example += e["lo"] <= 0.4 <= e["hi"]
    assert 0.92 <= covered / sims <= 0.98, covered / sims
    # Counting examples as replicates: the interval is far too narrow.
    assert per_example / sims < 0.7, per_example / sims


def test_the_trend_test_on_flat_ladders_rejects_at_most_five_percent():
    rng = np.random.default_rng(11)
    sims = 1000
    rejected = sum(
        zp.accuracy_trend(_ladder(rng, 0.0))["x/flm"]["fit"]["p"] < 0.05 for _ in range(sims)
    )
    # 5% expected; 0.064 is 5% plus two Monte Carlo standard errors of 1,000 simulations.
    assert rejected / sims <= 0.064, rejected / sims
