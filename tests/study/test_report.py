"""Report comparisons: probe accuracy across cells, loss within objectives, honest verdicts."""

import math

import pytest

from scalestudy.study import report


def _run(arch, obj, size_index, n_total, flops, acc, loss, seed=0, n=400):
    return {
        "run_id": f"{arch}{obj}{size_index}{seed}",
        "arch": arch,
        "objective": obj,
        "size": f"r{size_index}",
        "size_index": size_index,
        "seed": seed,
        "status": "done",
        "params_total": n_total,
        "flops": flops,
        "loss": loss,
        "eval/probes/acc": acc,
        "eval/probes/n": n,
        "eval/probes/pronoun/acc": 1.0,  # a breakdown: must not count twice
    }


def test_probe_accuracy_uses_task_totals_only():
    r = _run("causal_decoder", "flm", 0, 1e5, 1e10, 0.25, 2.0)
    r |= {"eval/other/acc": 0.75, "eval/other/n": 100}
    acc, n = report.probe_accuracy(r)
    assert n == 500 and acc == pytest.approx((0.25 * 400 + 0.75 * 100) / 500)


def test_chance_is_example_weighted_over_tasks():
    r = _run("causal_decoder", "flm", 0, 1e5, 1e10, 0.25, 2.0)
    r |= {"eval/probes/chance": 0.25, "eval/other/acc": 0.5, "eval/other/n": 100}
    r |= {"eval/other/chance": 0.5, "eval/probes/pronoun/chance": 0.5}  # breakdown ignored
    assert report.chance_accuracy([r]) == pytest.approx((0.25 * 400 + 0.5 * 100) / 500)
    assert report.chance_accuracy([_run("causal_decoder", "flm", 0, 1e5, 1e10, 0.3, 2.0)]) is None


def test_interpolation_in_log_scale_is_exact():
    # Halfway between 1e10 and 1e12 in log C is 1e11: the accuracies average.
    pts = [(1e10, 0.2, 0.03), (1e12, 0.4, 0.04)]
    acc, half = report._interp_at(pts, 1e11)
    assert acc == pytest.approx(0.3) and half == pytest.approx(math.hypot(0.015, 0.02))
    assert report._interp_at(pts, 1e13) is None


def test_compare_names_the_better_cell_and_its_confidence():
    runs = []
    for i, (n, c) in enumerate([(1e5, 1e10), (1e6, 1e12)]):
        runs.append(_run("causal_decoder", "flm", i, n, c, 0.30 + 0.30 * i, 2.0 - i))
        runs.append(_run("encoder_decoder", "mlm", i, 2 * n, c, 0.30 + 0.05 * i, 2.5 - i))
        runs.append(_run("encoder_decoder", "plm", i, 2 * n, c, 0.30 + 0.04 * i, 2.2 - i))
        runs.append(_run("causal_decoder", "plm", i, n, c, 0.30 + 0.03 * i, 2.1 - i))
    cmp = report.compare(runs)
    # Equal parameters: at 1e6 (largest common N), causal/flm is interpolated at its top run.
    assert cmp["equal_params"]["at"] == pytest.approx(1e6)
    assert cmp["equal_params"]["verdict"].startswith("**causal_decoder/flm**")
    assert "clear lead" in cmp["equal_params"]["verdict"]
    # Equal compute: every cell spans [1e10, 1e12].
    assert cmp["equal_compute"]["scores"]["encoder_decoder/mlm"][0] == pytest.approx(0.35)
    # Losses are compared only within an objective (flm has a single cell: no comparison).
    assert set(cmp["equal_compute_loss"]) == {"plm"}
    assert "single seed" in cmp["equal_compute_loss"]["plm"]["verdict"]
    assert cmp["not_scaling"] == []
    runs.append(_run("causal_decoder", "plm", 2, 1e7, 1e13, 0.3, 5.0))  # worse when larger
    assert report.compare(runs)["not_scaling"] == ["causal_decoder/plm"]


def test_close_cells_are_called_indistinguishable_and_seeds_widen_intervals():
    runs = [
        _run("causal_decoder", "flm", 0, 1e5, 1e10, 0.50, 1.0, seed=0),
        _run("causal_decoder", "flm", 0, 1e5, 1e10, 0.54, 1.0, seed=1),
        _run("causal_decoder", "plm", 0, 1e5, 1e10, 0.50, 1.0, seed=0),
        _run("causal_decoder", "plm", 0, 1e5, 1e10, 0.50, 1.0, seed=1),
    ]
    cmp = report.compare(runs)
    scores = cmp["equal_params"]["scores"]
    assert scores["causal_decoder/flm"][0] == pytest.approx(0.52)
    assert scores["causal_decoder/flm"][1] > scores["causal_decoder/plm"][1]  # seed spread
    assert "not distinguishable" in cmp["equal_params"]["verdict"]


def test_markdown_and_html_render(tmp_path):
    from scalestudy.study.spec import StudySpec

    runs = [_run("causal_decoder", "flm", 0, 1e5, 1e10, 0.3, 2.0)]
    for r in runs:
        r |= {"d_model": 32, "n_layers": 2, "steps": 10, "tokens": 1e4, "params_non_embedding": 5e4}
    study = StudySpec(name="t", ladder={"preset": "smoke"})
    md = report.render_markdown(study, runs, {}, ["figures/a.png"])
    assert "| causal_decoder/flm | r0 | 32 | 2 |" in md and "![a](figures/a.png)" in md
    html = report.render_html(md)
    assert "<table>" in html and '<img src="figures/a.png"' in html


def test_truncation_is_reported_as_the_worst_runs_share():
    a = _run("causal_decoder", "flm", 0, 1e5, 1e10, 0.3, 2.0) | {"eval/probes/truncated": 40}
    b = _run("encoder_decoder", "plm", 0, 1e5, 1e10, 0.3, 2.0) | {"eval/probes/truncated": 400}
    assert report.truncated_share([a, b]) == (400, 400)
    assert report.truncated_share([_run("causal_decoder", "flm", 0, 1e5, 1e10, 0.3, 2.0)]) is None
