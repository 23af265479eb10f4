"""The report's in-context section: curves over K, the gain per run, and the gain's verdict
in the report's Holm family; few-shot rows stay out of the zero-shot probe accuracy."""

import numpy as np
import pytest

from scalestudy.study.plan.spec import StudySpec
from scalestudy.study.record.rows import RunRow
from scalestudy.study.report import answer, incontext, task_law_report
from scalestudy.study.report import page as report

SHOTS = (0, 1, 2, 4, 8)


def _runs(gain: dict[str, float], seeds: int = 3, noise: float = 0.01, rng_seed: int = 0):
    """Runs of each cell at two sizes: zero-shot at 0.5, K-shot rising to `gain[cell]` at
    K = 8, with run-level noise (one draw per run, as a run's own examples would give)."""
    rng = np.random.default_rng(rng_seed)
    runs = []
    for cell, g in gain.items():
        arch, obj = cell.split("/")
        for i, n in enumerate((1e5, 1e6)):
            for s in range(seeds):
                run = {
                    "run_id": f"{cell}{i}{s}",
                    "arch": arch,
                    "objective": obj,
                    "size": f"r{i}",
                    "size_index": i,
                    "seed": s,
                    "status": "done",
                    "params_total": n,
                    "flops": n * 1e5,
                    "loss": 2.0 - 0.1 * i,
                    "eval/probes/acc": 0.4,
                    "eval/probes/n": 400,
                    "eval/incontext_probe/acc": 0.5,
                    "eval/incontext_probe/n": 640,
                }
                for k in SHOTS[1:]:
                    acc = 0.5 + g * np.log2(1 + k) / np.log2(9) + noise * rng.standard_normal()
                    run[f"eval/incontext_probe.{k}shot/acc"] = float(acc)
                    run[f"eval/incontext_probe.{k}shot/n"] = 640
                runs.append(RunRow.from_row(run))
    return runs


def _scores(run: RunRow, changes: dict) -> RunRow:
    """`run` with `changes` to its scores (added after its own)."""
    return run.replace(evals={**run.evals, **changes})


def test_a_task_scored_with_demonstrations_stays_out_of_zero_shot_probe_accuracy():
    """Its K-shot rows and its zero-shot row (the in-context probe is at chance there by
    construction, and would only pull every cell toward 0.5) are the in-context section's;
    so are its task laws."""
    run = _runs({"causal_decoder/flm": 0.4}, seeds=1)[0]
    run = _scores(run, {"eval/incontext_probe/task_loss": 0.7, "eval/probes/task_loss": 1.2})
    acc, n = report.probe_accuracy(run)
    assert (acc, n) == (0.4, 400)
    from scalestudy.study.report.comparisons import _accuracy

    assert _accuracy(run) == (acc, n)
    # Without its few-shot rows the same task is an ordinary zero-shot task again.
    zero_only = run.replace(evals={k: v for k, v in run.evals.items() if "shot" not in k})
    assert report.probe_accuracy(zero_only) == (pytest.approx((0.4 * 400 + 0.5 * 640) / 1040), 1040)
    names = ["probes", "probes/g1", "incontext_probe", "incontext_probe.8shot"]
    assert task_law_report.zero_shot_tasks(names) == ["probes", "probes/g1"]
    assert task_law_report.zero_shot_tasks(names[:3]) == names[:3]


def test_the_gain_is_per_run_and_its_verdict_follows_the_runs():
    clear = {"causal_decoder/flm": 0.3, "noncausal_decoder/plm": 0.1, "encoder_decoder/plm": 0.05}
    runs = _runs(clear)
    gained, largest = incontext.with_gains(runs)
    assert largest == {"incontext_probe": 8}
    for r in gained:
        assert r.value("incontext_gain/incontext_probe") == pytest.approx(
            r.evals["eval/incontext_probe.8shot/acc"] - 0.5
        )
    cmp = answer.compare(runs)
    found = cmp.incontext["incontext_probe"]
    for name in ("equal_params", "equal_compute"):
        got = found[name]
        assert got.leader == "causal_decoder/flm" and got.k == 8
        assert all(t.p_holm is not None for t in got.tests)  # in the report's family
        assert got.verdict[0].startswith("**causal_decoder/flm** is ahead of every other")
    study = StudySpec(name="t", ladder={"preset": "smoke"})
    md = report.render_markdown(study, runs, {}, [])
    head = md[: md.index("## How to read")]
    rows = [line for line in head.splitlines() if "8-shot gain, incontext_probe" in line]
    assert len(rows) == 2 and all("| causal_decoder/flm | **ahead of all 2** |" in r for r in rows)
    assert all(r.split("|")[7].strip() == "3" for r in rows)  # n: runs, not examples
    section = md[md.index("## In-context learning") :]
    assert "| cell | size | K=0 | K=1 | K=2 | K=4 | K=8 | runs |" in section
    assert "| causal_decoder/flm | r1 | 0.500 |" in section

    # Gains within run noise of each other: no winner, whatever the means' order.
    close = {"causal_decoder/flm": 0.2, "noncausal_decoder/plm": 0.195}
    got = answer.compare(_runs(close, noise=0.05)).incontext["incontext_probe"]
    assert "**" not in got["equal_params"].verdict[0]
    assert got["equal_params"].verdict[0].startswith("no winner")
    # One seed: no between-run interval, no winner.
    one = answer.compare(_runs(clear, seeds=1)).incontext["incontext_probe"]
    assert one["equal_params"].verdict[0].startswith("one seed")


def test_curves_without_a_comparison_are_shown_and_say_why():
    """One cell (nothing to compare it with): the curve table is still the section, with the
    reason there is no verdict."""
    runs = _runs({"causal_decoder/flm": 0.3})
    assert answer.compare(runs).incontext == {}
    study = StudySpec(name="t", ladder={"preset": "smoke"})
    section = report.render_markdown(study, runs, {}, [])
    section = section[section.index("## In-context learning") :]
    assert "| causal_decoder/flm | r0 | 0.500 |" in section
    assert "No comparison of the gain" in section


def test_no_few_shot_rows_no_section():
    runs = [
        _scores(r, {k: None for k in r.evals if "shot" in k})
        for r in _runs({"causal_decoder/flm": 0.3})
    ]
    assert answer.compare(runs).incontext == {}
    study = StudySpec(name="t", ladder={"preset": "smoke"})
    assert "## In-context learning" not in report.render_markdown(study, runs, {}, [])


def test_the_section_says_how_many_demonstrations_prompts_really_held():
    """Each run's mean shots per K (`<task>.<K>shot/shots`): one line when every prompt held
    all K; a table of the cells and K where some held fewer (training's rows dropped some)."""
    runs = _runs({"causal_decoder/flm": 0.3, "encoder_decoder/mlm": 0.1})
    shots = {f"eval/incontext_probe.{k}shot/shots": float(k) for k in SHOTS[1:]}
    runs = [_scores(r, shots) for r in runs]
    assert incontext.shots_lines(runs, "incontext_probe")[0].startswith("Every prompt held all")
    held = iter([6.5, 6.0, 7.0])
    runs = [
        _scores(r, {"eval/incontext_probe.8shot/shots": next(held)})
        if r.objective == "mlm" and r.size == "r0"
        else r
        for r in runs
    ]
    got = incontext.shots_lines(runs, "incontext_probe")
    assert "| encoder_decoder/mlm | r0 | 6.500 |" in got  # the mean of its three runs
    assert "| causal_decoder/flm | r0 | 8.000 |" in got
    assert not any("K=4" in line for line in got)  # only the K some prompts fell short of
    study = StudySpec(name="t", ladder={"preset": "smoke"})
    section = report.render_markdown(study, runs, {}, [])
    assert "Demonstrations really shown" in section[section.index("## In-context learning") :]


def test_the_gain_is_read_along_the_ladder_where_a_cell_has_one_rung():
    """With a one-rung cell, every cell meets only at the bottom rung; the gain is read again
    over the cells that span the ladder, at their largest common size, where the gain that
    only grows with scale shows (the bottom reading alone would hide it)."""
    runs = _runs(
        {"causal_decoder/flm": 0.1, "noncausal_decoder/plm": 0.1, "encoder_decoder/mlm": 0.1}
    )
    runs = [r for r in runs if not (r.objective == "mlm" and r.size_index == 1)]

    def learns(r: RunRow) -> RunRow:  # the causal decoder learns the rule at the top rung only
        if r.arch == "causal_decoder" and r.size_index == 1:
            keys = [f"eval/incontext_probe.{k}shot/acc" for k in SHOTS[1:]]
            return _scores(r, {k: r.evals[k] + 0.3 for k in keys})
        return r

    runs = [learns(r) for r in runs]
    found = answer.compare(runs).incontext["incontext_probe"]
    bottom, ladder = found["equal_params"], found["equal_params_ladder"]
    assert bottom.at == pytest.approx(1e5) and not bottom.verdict[0].startswith("**")
    assert ladder.at == pytest.approx(1e6) and ladder.leader == "causal_decoder/flm"
    assert ladder.left_out == ["encoder_decoder/mlm"]
    assert all(t.p_holm is not None for t in ladder.tests)  # in the primary family
    assert ladder.verdict[0].startswith("**causal_decoder/flm** is ahead of every other")
    study = StudySpec(name="t", ladder={"preset": "smoke"})
    md = report.render_markdown(study, runs, {}, [])
    head = md[: md.index("## How to read")]
    rows = [line for line in head.splitlines() if "8-shot gain, incontext_probe" in line]
    spanning = [r for r in rows if "cells spanning the ladder" in r]
    assert len(rows) == 4 and len(spanning) == 2
    verdict = "| causal_decoder/flm | **ahead of all 1** (left out: encoder_decoder/mlm) |"
    assert all(verdict in r for r in spanning)
    assert all(
        "at the rung of the one-rung encoder_decoder/mlm" in r for r in rows if r not in spanning
    )
    assert "Equal parameters, the cells spanning the ladder" in md
