"""Report comparisons: probe accuracy across cells, loss within objectives, honest verdicts."""

import math
import re
import statistics
from collections import defaultdict
from html.parser import HTMLParser

import numpy as np
import pytest

from scalestudy.study.record.rows import RunRow
from scalestudy.study.report import answer
from scalestudy.study.report import page as report

Z = 1.959964  # the normal 95% quantile the old unpaired sentences used


def _with(run: RunRow, changes: dict) -> RunRow:
    """`run` with `changes` (columns, or `eval/...` scores added after its own)."""
    return RunRow.from_row(run.as_dict() | changes)


def _run(arch, obj, size_index, n_total, flops, acc, loss, seed=0, n=400):
    return RunRow.from_row(
        {
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
    )


def test_probe_accuracy_uses_task_totals_only():
    r = _run("causal_decoder", "flm", 0, 1e5, 1e10, 0.25, 2.0)
    r = _with(r, {"eval/other/acc": 0.75, "eval/other/n": 100})
    acc, n = report.probe_accuracy(r)
    assert n == 500 and acc == pytest.approx((0.25 * 400 + 0.75 * 100) / 500)


def test_chance_is_example_weighted_over_tasks():
    r = _run("causal_decoder", "flm", 0, 1e5, 1e10, 0.25, 2.0)
    r = _with(r, {"eval/probes/chance": 0.25, "eval/other/acc": 0.5, "eval/other/n": 100})
    r = _with(r, {"eval/other/chance": 0.5, "eval/probes/pronoun/chance": 0.5})  # breakdown
    assert report.chance_accuracy([r]) == pytest.approx((0.25 * 400 + 0.5 * 100) / 500)
    assert report.chance_accuracy([_run("causal_decoder", "flm", 0, 1e5, 1e10, 0.3, 2.0)]) is None


def test_cells_are_read_at_their_runs_never_between_rungs():
    # Causal rungs at 1e5 and 1e6 parameters, the other cell's at 3e5 and 3e6: the largest
    # N both span is 1e6; each cell is read at its own rung nearest to it in log (3e6, not a
    # chord between 3e5 and 3e6), and what the rungs do not hold equal is named.
    runs = []
    for s in range(3):
        for i, n in enumerate((1e5, 1e6)):
            runs.append(_run("causal_decoder", "plm", i, n, 1e10 * 10**i, 0.5, 2.0 - i, s))
            runs.append(_run("noncausal_decoder", "plm", i, 3 * n, 1e10 * 10**i, 0.5, 2.1 - i, s))
    got = answer.compare(runs).loss["equal_params"]["plm"]
    assert got.at == pytest.approx(1e6)
    assert got.read == {"causal_decoder/plm": 1e6, "noncausal_decoder/plm": 3e6}
    assert got.scores["noncausal_decoder/plm"].mean == pytest.approx(1.1)  # its runs' value
    [test] = got.tests
    assert "total parameters (0.33x)" in test.not_equal


def _two_cells(loss_a, loss_b, acc=0.5):
    runs = []
    for seed, (la, lb) in enumerate(zip(loss_a, loss_b, strict=True)):
        runs.append(_run("causal_decoder", "plm", 0, 1e5, 1e10, acc, la, seed=seed))
        runs.append(_run("noncausal_decoder", "plm", 0, 1e5, 1e10, acc, lb, seed=seed))
    return runs


def test_an_unpaired_lead_the_seeds_do_not_support_names_no_winner():
    # Each cell's seeds agree closely, so unpaired intervals are narrow, but the per-seed
    # differences (-0.12, -0.06, 0.00) do not agree: paired over 3 seeds, no verdict.
    loss_a, loss_b = [1.00, 1.02, 1.04], [1.12, 1.08, 1.04]
    halves = [Z * statistics.stdev(x) / math.sqrt(3) for x in (loss_a, loss_b)]
    gap = statistics.mean(loss_b) - statistics.mean(loss_a)
    assert gap > math.hypot(*halves)  # the unpaired means would call a clear lead
    cmp = answer.compare(_two_cells(loss_a, loss_b))
    text = "\n".join(cmp.loss["equal_params"]["plm"].verdict)
    assert text.startswith("no winner: causal_decoder/plm has the lowest mean")
    assert "not distinguishable from noncausal_decoder/plm" in text and "**" not in text
    assert "-0.060 [" in text and "(n = 3 seeds)" in text and "Holm-adjusted p = " in text
    assert "Held equal: total parameters, training FLOPs." in text


def test_a_lead_every_seed_shows_is_a_winner_despite_seed_spread():
    # Seed effects (0.4) dwarf a steady 0.05 gain: unpaired, not separable; paired, clear.
    base = [2.0, 2.4, 1.8, 2.2]
    gain = [0.05, 0.052, 0.048, 0.051]
    runs = _two_cells([b - g for b, g in zip(base, gain, strict=True)], base)
    cmp = answer.compare(runs)
    [line, detail] = cmp.loss["equal_params"]["plm"].verdict
    assert line.startswith("**causal_decoder/plm** is ahead of every other cell")
    assert "causal_decoder/plm minus noncausal_decoder/plm: -0.050 [" in detail
    # One Holm family over the report: the matched comparisons (accuracy, loss) and the
    # leaders' tests (accuracy and loss, at equal N and at equal C). On one rung they state
    # the same two hypotheses three times each, which count once.
    leaders = [cmp.accuracy[k] for k in ("equal_params", "equal_compute")]
    leaders += [cmp.loss[k]["plm"] for k in ("equal_params", "equal_compute")]
    tests = cmp.matched + [t for g in leaders for t in g.tests]
    assert len(tests) == 6 and cmp.family == 2 and all(t.p_holm is not None for t in tests)
    assert all(t.p_holm >= t.interval.p_value for t in tests)
    loss = [t for t in tests if t.metric == "loss"]
    assert len(loss) == 3 and len({t.p_holm for t in loss}) == 1
    p = sorted({round(t.interval.p_value, 12) for t in tests})
    assert len(p) == 2 and loss[0].p_holm == pytest.approx(min(1.0, 2 * p[0]))


def test_one_seed_names_no_winner_only_the_better_run():
    cmp = answer.compare(_two_cells([1.0], [1.3]))
    [line, detail] = cmp.loss["equal_compute"]["plm"].verdict
    assert line == (
        "one seed: causal_decoder/plm had the lower loss in this run; with no between-run "
        "interval no winner is named."
    )
    assert "no between-run interval" in detail and "Holm" not in detail
    acc = (
        answer.compare(
            [
                _run("causal_decoder", "flm", 0, 1e5, 1e10, 0.7, 2.0),
                _run("noncausal_decoder", "flm", 0, 1e5, 1e10, 0.5, 2.0),
            ]
        )
        .accuracy["equal_params"]
        .verdict
    )
    assert acc[0].startswith("one seed: causal_decoder/flm had the higher accuracy in this run")
    assert "an interval over examples only, not between runs" in acc[1]


def test_what_is_not_held_equal_at_equal_compute_is_named():
    runs = []
    for seed in (0, 1):
        for i, (n, c) in enumerate([(1e5, 1e10), (1e6, 1e12)]):
            runs.append(_run("causal_decoder", "plm", i, n, c, 0.5, 2.0 - i + 0.01 * seed, seed))
            runs.append(_run("encoder_decoder", "plm", i, 2 * n, c, 0.5, 2.1 - i, seed))
    cmp = answer.compare(runs)
    assert cmp.loss["equal_compute"]["plm"].at == pytest.approx(1e12)
    text = "\n".join(cmp.loss["equal_compute"]["plm"].verdict)
    assert "Not equal (causal_decoder/plm / encoder_decoder/plm): total parameters (0.50x)" in text
    assert "Held equal: training FLOPs." in text
    # At equal parameters (1e6, the largest N both span) each cell is read at its rung
    # nearest in log (1e6 and 2e6, no interpolation between rungs): the parameters' ratio
    # is named, the FLOPs are held equal.
    cmp_n = "\n".join(cmp.loss["equal_params"]["plm"].verdict)
    assert cmp.loss["equal_params"]["plm"].at == pytest.approx(1e6)
    assert cmp.loss["equal_params"]["plm"].read["encoder_decoder/plm"] == pytest.approx(2e6)
    assert "Held equal: training FLOPs." in cmp_n and "total parameters (0.50x)" in cmp_n


def test_not_scaling_names_cells_whose_loss_rises_up_the_ladder():
    runs = [
        _run("causal_decoder", "plm", 0, 1e5, 1e10, 0.3, 2.0),
        _run("causal_decoder", "plm", 1, 1e6, 1e11, 0.3, 1.5),
    ]
    assert answer.compare(runs).not_scaling == []
    runs.append(_run("causal_decoder", "plm", 2, 1e7, 1e13, 0.3, 5.0))  # worse when larger
    assert answer.compare(runs).not_scaling == ["causal_decoder/plm"]


def test_variants_are_ladders_of_their_own_and_isoflop_budgets_are_not_ladders():
    """A sparse variant's runs (more total parameters, higher loss) are not rungs of the
    dense cell's ladder, and each point counts its own runs; along an IsoFLOP budget loss
    against size is a valley, never called a ladder that does not scale."""
    from scalestudy.study.plan.spec import StudySpec

    runs = []
    for variant, total, offset in (("dense", 1.0, 0.0), ("e16", 8.0, 0.5)):
        for i, n in enumerate((1e5, 1e6)):
            for s in range(2):
                r = _run("causal_decoder", "flm", i, n * total, 1e10, 0.3,
                         2.0 - 0.1 * i + offset, seed=s)  # fmt: skip
                name = f"t.causal_decoder.flm.{variant}.r{i}.s{s}"
                runs.append(r.replace(name=name, run_id=name))
    assert answer.not_scaling(runs) == []
    runs[-2:] = [r.replace(loss=9.0) for r in runs[-2:]]  # e16's top rung, both seeds
    assert answer.not_scaling(runs) == ["causal_decoder/flm/e16"]
    md = report.render_markdown(StudySpec(name="t", ladder={"preset": "smoke"}), runs, {}, [])
    assert "- Runs per point: 2 to 2." in md
    valley = [r.replace(budget="C1e11") for r in runs]
    assert answer.not_scaling(valley) == []


class _Page(HTMLParser):
    """The text, tags and images of an HTML page, as a browser would lay them out."""

    def __init__(self):
        super().__init__()
        self.text, self.tagged, self.images = [], [], []
        self.tags: dict[str, int] = defaultdict(int)
        self.open: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags[tag] += 1
        self.open.append(tag)
        if tag == "img":
            self.images.append(dict(attrs)["src"])

    def handle_endtag(self, tag):
        while self.open and self.open.pop() != tag:
            pass

    def handle_data(self, data):
        self.text.append(data)
        if self.open:
            self.tagged.append((self.open[-1], data))


def test_markdown_and_html_render(tmp_path):
    from scalestudy.study.plan.spec import StudySpec

    runs = [_run("causal_decoder", "flm", 0, 1e5, 1e10, 0.3, 2.0)]
    shape = {"d_model": 32, "n_layers": 2, "steps": 10, "tokens": 1e4}
    runs = [r.replace(**shape, params_non_embedding=5e4) for r in runs]
    study = StudySpec(name="t", ladder={"preset": "smoke"})
    md = report.render_markdown(study, runs, {}, ["figures/a.png"])
    assert "| causal_decoder/flm | r0 | 32 | 2 |" in md and "![a](figures/a.png)" in md
    # Tokens per parameter by both counts (Chinchilla's 20 counts every parameter).
    assert "0.1 to 0.1 tokens per total parameter (0.2 to 0.2 per non-embedding parameter)" in md
    md += "\n**not comparable** and `code` | a | b |\n"
    page = _Page()
    page.feed(report.render_html(md))
    # What a browser shows: no Markdown syntax left in the text, tables as tables.
    shown = "".join(page.text)
    assert "**" not in shown and "`" not in shown and "| causal_decoder" not in shown
    assert "not comparable" in shown and ("strong", "not comparable") in page.tagged
    assert page.tags["table"] >= 1 and page.tags["td"] >= 12 and page.images == ["figures/a.png"]


def test_truncation_is_reported_as_the_worst_runs_share():
    a = _with(_run("causal_decoder", "flm", 0, 1e5, 1e10, 0.3, 2.0), {"eval/probes/truncated": 40})
    b = _with(
        _run("encoder_decoder", "plm", 0, 1e5, 1e10, 0.3, 2.0), {"eval/probes/truncated": 400}
    )
    assert report.truncated_share([a, b]) == (400, 400)
    assert report.truncated_share([_run("causal_decoder", "flm", 0, 1e5, 1e10, 0.3, 2.0)]) is None


def test_runs_of_one_seed_at_one_size_are_averaged_not_picked():
    # Two budgets of one seed at the same N: the seed's value at that N is their mean.
    runs = _two_cells([1.0], [1.5]) + _two_cells([1.2], [1.5])
    scores = answer.compare(runs).loss["equal_params"]["plm"].scores
    assert scores["causal_decoder/plm"].mean == pytest.approx(1.1)


def _ladder(cells: dict[str, float], seeds=3, sizes=(1e5, 1e6), own=(0.0, 0.0, 0.0)):
    """Runs of `cells` ({"arch/objective": loss offset}) at two sizes, `seeds` seeds each;
    each seed's noise is shared by the cells (paired), the offsets are the true gaps, and
    `own[s]` is run noise of seed s in every cell but the first (alternating in sign)."""
    runs = []
    for cell, offset in cells.items():
        arch, obj = cell.split("/")
        for i, n in enumerate(sizes):
            for s in range(seeds):
                loss = 2.0 - 0.2 * i + offset + 0.01 * ((s * 7) % 3 - 1) + 0.001 * s * i
                loss += own[s] * (-1) ** i if cell != next(iter(cells)) else 0.0
                # accuracy moves with the run's loss noise: runs vary in both
                acc = 0.5 - (loss - 2.0 + 0.2 * i)
                runs.append(_run(arch, obj, i, n, n * 1e5, acc, loss, seed=s))
    return runs


def test_the_report_opens_with_the_answer_and_it_follows_the_paired_tests():
    from scalestudy.study.plan.spec import StudySpec

    study = StudySpec(name="t", ladder={"preset": "smoke"})
    clear = {"causal_decoder/plm": 0.0, "noncausal_decoder/plm": 0.2, "encoder_decoder/plm": 0.3}
    md = report.render_markdown(study, _ladder(clear), {}, ["figures/answer.png"])
    head = md[: md.index("## How to read")]
    assert head.index("## The answer") < head.index("![the answer's metric") < head.index("cannot")
    rows = [line for line in head.splitlines() if line.startswith("| equal ")]
    # equal parameters and equal compute, probe accuracy and PLM loss: four questions.
    assert len(rows) == 4
    assert all("| causal_decoder/plm | **ahead of all 2** |" in row for row in rows)
    assert all(row.split("|")[7].strip() == "3" for row in rows)  # n: runs, not examples
    # One seed: the same table names no winner.
    one = report.render_markdown(study, _ladder(clear, seeds=1), {}, [])
    assert "no verdict: one seed" in one and "**ahead" not in one
    # Cells within noise of each other: not distinguishable, whatever the mean order.
    close = {"causal_decoder/plm": 0.0, "noncausal_decoder/plm": 0.001}
    text = report.render_markdown(study, _ladder(close, own=(0.03, -0.03, 0.01)), {}, [])
    assert "**ahead" not in text
    assert re.search(r"\| not distinguishable from (non)?causal_decoder/plm \|", text)
    # Ahead of some, not of all: both are named.
    mixed = {"causal_decoder/plm": 0.0, "noncausal_decoder/plm": 0.001, "encoder_decoder/plm": 0.3}
    text = report.render_markdown(study, _ladder(mixed, own=(0.03, -0.03, 0.01)), {}, [])
    assert re.search(
        r"\| ahead of encoder_decoder/plm; not distinguishable from (non)?causal_decoder/plm \|",
        text,
    )


def test_a_cell_whose_runs_end_below_the_others_is_left_out_and_named():
    from scalestudy.study.plan.spec import StudySpec

    runs = _ladder({"causal_decoder/plm": 0.0, "noncausal_decoder/plm": 0.2})
    runs += _ladder({"causal_decoder/mlm": 0.1}, sizes=(1e3, 1e4))  # ends below 1e5
    assert answer.compare(runs).accuracy["equal_params"].left_out == ["causal_decoder/mlm"]
    md = report.render_markdown(StudySpec(name="t", ladder={"preset": "smoke"}), runs, {}, [])
    assert "(left out: causal_decoder/mlm)" in md
    assert "Left out (their runs end below this x): causal_decoder/mlm." in md


def test_moe_runs_add_a_verdict_at_equal_active_parameters():
    """MoE against dense: at equal total parameters the MoE cell uses fewer parameters per
    token, at equal active parameters more in all; the report asks both, and says which
    count each verdict holds equal. A dense-only study never mentions active parameters."""
    from scalestudy.study.plan.spec import StudySpec

    runs = []
    for variant, experts, total, gain in (("dense", 1, 1.0, 0.0), ("e8", 8, 4.0, 0.05)):
        for i, active in enumerate((1e5, 1e6)):
            for s in range(3):
                r = _run("causal_decoder", "flm", i, active * total, active * 6e5, 0.5 + gain,
                         2.0 - 0.2 * i - gain + 0.01 * s, seed=s)  # fmt: skip
                r = r.replace(name=f"t.causal_decoder.flm.{variant}.r{i}.s{s}", experts=experts)
                runs.append(r.replace(params_active=active, run_id=r.name))
    cmp = answer.compare(runs)
    active = cmp.accuracy["equal_active"]
    assert active.at == pytest.approx(1e6) and active.leader == "causal_decoder/flm/e8"
    [test] = active.tests
    assert "active parameters" in test.held_equal and "training FLOPs" in test.held_equal
    assert "total parameters (4.00x)" in test.not_equal
    [test] = cmp.accuracy["equal_params"].tests  # near 1e6 total: the dense model's top rung
    assert cmp.accuracy["equal_params"].at == pytest.approx(1e6)
    # read at the runs (dense 1e6, e8's 4e5 rung, nearest in log): neither count is equal,
    # and both ratios are named
    assert cmp.accuracy["equal_params"].read["causal_decoder/flm/e8"] == pytest.approx(4e5)
    assert {d.split(" (")[0] for d in test.not_equal} >= {
        "total parameters",
        "active parameters",
    }
    md = report.render_markdown(StudySpec(name="t", ladder={"preset": "smoke"}), runs, {}, [])
    assert "| equal active parameters (1e+06 active non-embedding parameters) |" in md
    assert "**Equal active parameters** (probe accuracy near 1e+06 active" in md
    dense = [r.replace(name=r.name.replace(".dense.", ".")) for r in runs if r.experts == 1]
    other = [r.replace(arch="noncausal_decoder", run_id=r.run_id + "n") for r in dense]
    md = report.render_markdown(
        StudySpec(name="t", ladder={"preset": "smoke"}), dense + other, {}, []
    )
    assert "active" not in md


def _design(rng, sd, examples=800):
    """The items of a simulated study at the smoke design, shared by every run and cell
    (answers correlated across runs and cells through their difficulty), the run effect's
    scale in logits that gives runs an accuracy spread of about `sd` between seeds, and the
    true accuracy of each cell on these items (its mean over retraining)."""
    from scipy.special import expit

    difficulty = rng.normal(0.3, 1.5, examples)
    scale = sd / float(np.mean(expit(difficulty) * (1 - expit(difficulty))))
    nodes, weights = np.polynomial.hermite_e.hermegauss(40)
    truth = {
        c: float(np.sum(weights * expit(difficulty[:, None] + s + scale * nodes).mean(0)))
        / float(np.sum(weights))
        for c, s in SHIFT.items()
    }
    return difficulty, scale, truth


SHIFT = {"causal_decoder/flm": 0.1, "encoder_decoder/mlm": 0.0}  # logits: the cells' gap


def _design_runs(rng, seeds, difficulty, scale):
    """Causal FLM and encoder-decoder MLM at one rung, `seeds` shared seeds, each run
    answering every item (half of a run's effect shared by the two cells' runs of one seed,
    as data order is)."""
    from scipy.special import expit

    shared = rng.normal(0, scale / math.sqrt(2), seeds)
    runs = []
    for cell, s in SHIFT.items():
        arch, obj = cell.split("/")
        own = rng.normal(0, scale / math.sqrt(2), seeds)
        p = expit(difficulty[None, :] + s + (shared + own)[:, None])
        acc = (rng.random(p.shape) < p).mean(axis=1)
        for seed in range(seeds):
            runs.append(_run(arch, obj, 0, 1e5, 1e10, float(acc[seed]), 2.0, seed, p.shape[1]))
    return runs


@pytest.mark.parametrize("seeds", [3, 5])
def test_the_answer_rows_cover_at_this_studys_design(seeds):
    """Coverage of the verdict path itself (`answer.compare` then `verdicts.answer_rows`, the
    rows the answer table prints) on simulated studies of this design (800 items): the
    interval beside the answer covers the true margin 92-98% of the time at seed sd 0.005,
    0.02 and 0.05, two-sided: neither too narrow (examples counted as replicates) nor too
    wide (an examples term on top of runs that already hold it)."""
    from scalestudy.study.report import verdicts

    rng = np.random.default_rng(seeds)
    sims = 300  # binomial sd 1.3% at 95%: the 92-98% band is ~2.4 sd either side
    for sd in (0.005, 0.02, 0.05):
        difficulty, scale, truth = _design(rng, sd)
        hits = 0
        for _ in range(sims):
            cmp = answer.compare(_design_runs(rng, seeds, difficulty, scale))
            row = verdicts.answer_rows(cmp, "total parameters")[0]
            iv = row.closest.shown
            assert cmp.family == 1 and iv.df == seeds - 1  # one hypothesis, runs' df
            margin = truth[row.best] - truth[row.closest.reference]
            hits += iv.low <= margin <= iv.high
        assert 0.92 <= hits / sims <= 0.98, (sd, hits / sims)


def test_the_primary_family_holds_the_answers_tests_only():
    """Holm's adjustment of the answer counts only its own rows' tests (primary); the
    per-rung matched comparisons are a secondary family, adjusted among themselves."""
    from scalestudy.scaling.intervals import holm
    from scalestudy.study.plan.spec import StudySpec

    cells = {"causal_decoder/plm": 0.0, "noncausal_decoder/plm": 0.01, "encoder_decoder/plm": 0.3}
    runs = _ladder(cells, own=(0.02, -0.01, 0.015))
    cmp = answer.compare(runs)
    leaders = [cmp.accuracy[k] for k in ("equal_params", "equal_compute")]
    leaders += [cmp.loss[k]["plm"] for k in ("equal_params", "equal_compute")]
    primary = [t for g in leaders for t in g.tests]
    distinct = {(frozenset((t.cell, t.reference)), t.metric, t.interval.p_value)
                for t in primary}  # fmt: skip
    assert cmp.family == len(distinct) < len(primary) + len(cmp.matched)
    want = dict(zip(distinct, holm([d[2] for d in distinct]), strict=True))
    for t in primary:
        key = (frozenset((t.cell, t.reference)), t.metric, t.interval.p_value)
        assert t.p_holm == pytest.approx(want[key]) and t.family[0] == "primary"
    matched = cmp.matched
    assert cmp.secondary == len(matched) == 8  # 2 rungs x 2 cells x (accuracy, loss)
    for t, p in zip(matched, holm([t.interval.p_value for t in matched]), strict=True):
        assert t.p_holm == pytest.approx(p) and t.family == ("secondary", 8)
    md = report.render_markdown(StudySpec(name="t", ladder={"preset": "smoke"}), runs, {}, [])
    assert f"primary family of {cmp.family} tests" in md
    assert "secondary family of 8" in md


def test_a_cell_at_one_rung_leaves_an_answer_along_the_ladder_for_the_others():
    from scalestudy.study.plan.spec import StudySpec

    runs = _ladder({"causal_decoder/flm": 0.0, "noncausal_decoder/plm": 0.1})
    runs += _ladder({"encoder_decoder/mlm": 0.2}, sizes=(1e5,))  # the bottom rung only
    cmp = answer.compare(runs)
    assert cmp.accuracy["equal_params"].at == pytest.approx(1e5)  # every cell: the bottom rung
    ladder = cmp.accuracy["equal_params_ladder"]
    assert ladder.at == pytest.approx(1e6) and ladder.left_out == ["encoder_decoder/mlm"]
    assert set(ladder.read) == {"causal_decoder/flm", "noncausal_decoder/plm"}
    md = report.render_markdown(StudySpec(name="t", ladder={"preset": "smoke"}), runs, {}, [])
    assert "| equal parameters (1e+06 total parameters; cells spanning the ladder) |" in md
    bottom = "every cell, at the rung of the one-rung encoder_decoder/mlm"
    assert f"| equal parameters (1e+05 total parameters; {bottom}) |" in md
    assert "Left out (their runs are at one rung only): encoder_decoder/mlm." in md


def test_a_loss_row_names_the_one_rung_cells_only_where_its_objective_has_one():
    """The bottom-rung label ("every cell, at the rung of the one-rung ...") belongs to rows
    the one-rung cells are in: a PLM loss row read at the top of the ladder does not carry it."""
    from scalestudy.study.report import verdicts

    runs = _ladder({"causal_decoder/plm": 0.0, "noncausal_decoder/plm": 0.1})
    runs += _ladder({"encoder_decoder/mlm": 0.2}, sizes=(1e5,))
    cmp = answer.compare(runs)
    plm = [r for r in verdicts.answer_rows(cmp, "total parameters") if r.metric == "val loss, plm"]
    assert plm and not any("one-rung" in r.question for r in plm)
    accuracy = [
        r for r in verdicts.answer_rows(cmp, "total parameters") if r.metric == "probe accuracy"
    ]
    assert any("one-rung encoder_decoder/mlm" in r.question for r in accuracy)


def test_each_answer_row_gives_the_designs_power():
    """Detectable: the smallest difference found with 80% power at the primary family's
    Bonferroni level from the measured spread of the per-seed differences; seeds to resolve:
    the runs a side at which the observed margin would be found so."""
    from scalestudy.scaling import intervals
    from scalestudy.study.report import verdicts

    cells = {"causal_decoder/plm": 0.0, "noncausal_decoder/plm": 0.004}
    cmp = answer.compare(_ladder(cells, own=(0.02, -0.01, 0.015)))
    rows = verdicts.answer_rows(cmp, "total parameters")
    assert rows and all(r.detectable is not None for r in rows)
    for row in rows:
        iv = row.closest.interval
        alpha = 0.05 / cmp.family
        sd = iv.se * math.sqrt(iv.seeds)  # the per-seed differences' spread
        assert row.detectable == pytest.approx(intervals.detectable(sd, 3, alpha))
        assert row.detectable > abs(iv.mean)  # a margin this small: not detectable with 3
        n = int(row.seeds_needed)
        assert intervals.detectable(sd, n, alpha) <= abs(iv.mean)
        assert intervals.detectable(sd, n - 1, alpha) > abs(iv.mean)
        assert row.cells()[7] == f"{row.detectable:.3f}" and row.cells()[8] == str(n)


def test_the_answer_figure_plots_the_tables_metric_and_rings_the_points_read(tmp_path):
    """Under the answer: probe accuracy as the table computes it (not a mean over tasks),
    its chance line, and a ring at each cell's rung an accuracy row is read at."""
    runs = _ladder({"causal_decoder/plm": 0.0, "encoder_decoder/plm": 0.1})
    more = {"eval/probes/chance": 0.3, "eval/other/acc": 0.9, "eval/other/n": 100}
    runs = [_with(r, more | {"eval/other/chance": 0.5}) for r in runs]
    assert report.answer_figure(runs, tmp_path, 0.03) == "figures/answer.png"
    svg = (tmp_path / "figures" / "answer.svg").read_text()
    cmp = answer.compare(runs)
    for name, held in (("equal_params", "parameters"), ("equal_compute", "compute")):
        for cell in cmp.accuracy[name].read:
            assert f'id="read:equal {held}:{cell}"' in svg
    from scalestudy.scaling import zeroshot_plots

    chance = report.chance_accuracy(runs)
    assert chance == pytest.approx((0.3 * 400 + 0.5 * 100) / 500)  # example-weighted
    points = [
        zeroshot_plots.AnswerPoint("a/b", 1e10, 0.4),
        zeroshot_plots.AnswerPoint("a/b", 1e11, 0.5),
    ]
    points.append(zeroshot_plots.AnswerPoint("a/b", 1e11, 0.5, "equal compute"))
    fig = zeroshot_plots.fig_answer(points, "probe accuracy (zero-shot)", chance)
    ax = fig.axes[0]
    assert [line.get_ydata()[0] for line in ax.lines if line.get_linestyle() == ":"] == [chance]
    assert ax.get_ylabel() == "probe accuracy (zero-shot)"
    ys = sorted(float(y) for c in ax.collections for _, y in c.get_offsets())
    assert ys == [0.4, 0.5, 0.5]  # two runs and the ring at the point read
