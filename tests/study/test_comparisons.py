"""The report's matched comparisons: what is held equal is named, seeds are paired, Holm."""

import math
import statistics
from dataclasses import replace

import numpy as np
import pytest
from scipy import stats

from scalestudy.study.record.rows import RunRow
from scalestudy.study.report import comparisons


def _run(arch, objective, seed, acc, loss=2.0, examples=200, **counts):
    base = {
        "params_total": 1000,
        "flops": 1e9,
        "document_tokens": 4096.0,
        "positions": 4096.0,
        "loss_tokens": 4096.0,
        "inference_flops_per_token": 2e4,
    }
    return RunRow.from_row(
        {
            "name": f"t.{arch}.{objective}.xs.s{seed}",
            "arch": arch,
            "objective": objective,
            "size": "xs",
            "size_index": 0,
            "budget": "",
            "seed": seed,
            "status": "done",
            "loss": loss,
            "eval/probe/acc": acc,
            "eval/probe/n": examples,
            **{**base, **counts},
        }
    )


def test_unequal_data_behind_a_comparison_is_named():
    runs = [
        _run("causal_decoder", "plm", 0, 0.60),
        _run("encoder_decoder", "plm", 0, 0.65, params_total=1400, document_tokens=8192.0),
    ]
    text = "\n".join(comparisons.lines(runs))
    assert "document tokens (2.00x)" in text and "total parameters (1.40x)" in text
    assert "Held equal: training FLOPs, positions, loss-bearing tokens, inference" in text
    # The same data: document tokens are now named as held equal.
    runs[1] = runs[1].replace(document_tokens=4096.0)
    text = "\n".join(comparisons.lines(runs))
    assert "document tokens (" not in text and "document tokens" in text.split("Held equal")[1]


def test_seeds_are_paired_and_unpaired_seeds_are_left_out():
    # Run effects (seed 0 easy, seed 1 hard, ...) much larger than a constant +0.05 gain.
    base = {0: 0.80, 1: 0.40, 2: 0.60, 3: 0.55, 4: 0.70}
    ref = [_run("causal_decoder", "flm", s, base[s], 3 - base[s], 5000) for s in (0, 1, 2, 3)]
    gain = {s: base[s] + 0.05 + 0.002 * s for s in base}
    new = [_run("noncausal_decoder", "flm", s, gain[s], 2.9 - base[s], 5000) for s in (0, 1, 2, 4)]
    found = comparisons.compare(ref + new)
    acc = next(c for c in found if c.metric == "acc")
    assert acc.unpaired == [3, 4] and acc.interval.seeds == 3
    assert acc.interval.low > 0  # unpaired, the run effects would swamp the gain
    # The run is the unit: each run's accuracy already holds its examples' noise, so the
    # interval is the t interval on the 3 per-seed differences, on 2 degrees of freedom
    # (never more), whatever the number of examples behind each run.
    few = [r.replace(evals={**r.evals, "eval/probe/n": 200}) for r in ref + new]
    [acc200] = [c for c in comparisons.compare(few) if c.metric == "acc"]
    d = [gain[s] - base[s] for s in (0, 1, 2)]
    half = stats.t.ppf(0.975, 2) * statistics.stdev(d) / math.sqrt(3)
    assert acc200.interval.df == 2 == acc.interval.df
    assert (acc200.interval.low, acc200.interval.high) == pytest.approx(
        (statistics.mean(d) - half, statistics.mean(d) + half)
    )
    text = "\n".join(comparisons.lines(ref + new))
    assert "noncausal_decoder/flm better" in text and "(n = 3 seeds x 5000 examples)" in text
    assert "Seeds [3, 4] have no partner" in text
    # Holm over the family: two verdicts (accuracy and loss), adjusted p >= raw p.
    assert all(c.p_holm >= c.interval.p_value for c in found)
    assert "secondary family of 2: their p-values are Holm-adjusted among themselves" in text


def test_one_seed_says_its_interval_is_not_between_runs():
    runs = [_run("causal_decoder", "flm", 0, 0.6), _run("noncausal_decoder", "flm", 0, 0.7)]
    text = "\n".join(comparisons.lines(runs))
    assert "over examples only, not a between-run interval" in text
    assert "one seed per side: no between-run interval" in text  # the loss
    assert "better" not in text and "worse" not in text


def test_losses_of_different_objectives_are_not_compared():
    runs = [_run("causal_decoder", "flm", 0, 0.6), _run("encoder_decoder", "mlm", 0, 0.7)]
    assert [c.metric for c in comparisons.compare(runs)] == ["acc"]


def test_a_groups_accuracy_interval_is_over_its_runs_not_its_examples():
    from scipy.stats import t as student_t

    from scalestudy.study.report import page as report

    # Three seeds scoring the same 100 examples: the run is the unit, n - 1 = 2 degrees of
    # freedom, and no examples term (equal runs give a zero-width interval; one run, none).
    same = [RunRow(evals={"eval/t/acc": 0.6, "eval/t/n": 100.0})] * 3
    assert report.acc_stats(same) == {"mean": pytest.approx(0.6), "half": 0.0, "n": 3}
    accs = [0.55, 0.6, 0.68]
    got = report.acc_stats([RunRow(evals={"eval/t/acc": a, "eval/t/n": 100.0}) for a in accs])
    sd = float(np.std(accs, ddof=1))
    assert got["half"] == pytest.approx(student_t.ppf(0.975, 2) * sd / math.sqrt(3))
    assert report.acc_stats(same[:1])["half"] is None


def test_a_cells_own_recipe_is_named_among_what_is_not_equal():
    from scalestudy.study.plan.recipe import recipe
    from scalestudy.study.report.comparisons import held_equal

    base = (
        "optim:\n  learning_rate: 0.005\ntrain:\n  batch_size: 16\n  seed: 0\n"
        "model:\n  d_model: 32\n"
    )
    other = base.replace("0.005", "0.02").replace("16", "32").replace("d_model: 32", "d_model: 48")
    a = [RunRow(params_total=1.0, recipe=recipe(other + "  qk_norm: true\n"))]
    b = [RunRow(params_total=1.0, recipe=recipe(base))]
    _, differ = held_equal(a, b, 0.03)
    recipes = [d for d in differ if d.startswith("recipe:")]
    assert recipes == [
        "recipe: model.qk_norm True vs 'default'",
        "recipe: optim.learning_rate 0.02 vs 0.005",
        "recipe: train.batch_size 32 vs 16",
    ]  # the shape (d_model) and the seed are not a recipe
    assert not any("recipe" in d for d in held_equal(b, b, 0.03)[1])


def test_a_verdict_too_near_the_level_to_hold_across_hosts_is_borderline_not_called():
    """Two builds of the smoke study moved one Holm-adjusted p from 0.0554 to 0.0434: at a
    plain 0.05 line that is "not distinguishable" on one host and "ahead" on the other. Within
    a factor 2 of the level both read "borderline" (not called); outside it nothing changes."""
    from scalestudy.scaling.intervals import Interval
    from scalestudy.study.report import verdicts
    from scalestudy.study.report.comparisons import leader_lines
    from scalestudy.study.report.verdicts import Leader, Test

    said = {p: verdicts.outcome(0.1, p, True) for p in (0.0554, 0.0434, 0.02, 0.11, 0.025, 0.1)}
    assert said == {
        0.0554: "borderline",
        0.0434: "borderline",
        0.02: "better",
        0.11: "not distinguishable",
        0.025: "borderline",
        0.1: "not distinguishable",
    }

    def test(ref: str, p: float) -> Test:
        iv = Interval(0.1, 0.01, 0.19, p, 3)
        return Test(
            "a", ref, "acc", iv, unpaired=[], held_equal=[], not_equal=[], p_holm=p, shown=iv
        )

    for p in (0.0554, 0.0434):  # one host's p and the other's: the same words
        found = Leader("a", higher=True, tests=[test("b", 0.001), test("c", p)])
        head = leader_lines(found)[0]
        assert head == "no winner: a has the highest mean but is borderline against c (not called)."
        row = verdicts._row("q", "acc", found, verdicts.LEVEL)
        assert row.verdict.startswith("ahead of b; borderline against c (the Holm-adjusted p")
        assert "not called" in verdicts.why(test("c", p))
    clear = Leader("a", higher=True, tests=[test("b", 0.001), test("c", 0.01)])
    assert leader_lines(clear)[0].startswith("**a** is ahead of every other cell")


def test_power_columns_say_why_they_are_empty():
    """Two cells at a ceiling give every run the same value: no spread to size a design by,
    said in the row, never a blank cell."""
    from scalestudy.scaling.intervals import Interval
    from scalestudy.study.report import verdicts
    from scalestudy.study.report.verdicts import Leader, Test

    flat = Interval(0.0, 0.0, 0.0, 1.0, 3, se=0.0)
    test = Test(
        cell="a",
        reference="b",
        metric="acc",
        interval=flat,
        p_holm=1.0,
        shown=flat,
        family=("primary", 4),
        not_equal=[],
    )
    row = verdicts._row("q", "acc", Leader("a", higher=True, tests=[test]), 0.95)
    assert row.cells()[7:9] == ["-", "no run spread"]
    test = replace(test, family=None)
    row = verdicts._row("q", "acc", Leader("a", higher=True, tests=[test]), 0.95)
    assert row.cells()[7:9] == ["-", "-"]
