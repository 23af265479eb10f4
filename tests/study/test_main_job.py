"""Spec expansion: run counts, stable ids, matching modes, spec files, cluster rendering."""

import json
import re
from pathlib import Path

import pytest

from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import load_config
from scalestudy.study.record.phases import phase
from scalestudy.study.run import after_pretraining, main_job

counting = pytest.importorskip("scalestudy.models.counting")

REPO = Path(__file__).resolve().parents[2]
SPECS = sorted((REPO / "configs" / "studies").glob("*.yaml"))


def _expand(path, overrides=()):
    return main_job.expand(main_job.load_study(path, overrides), Path(path).parent)


def test_a_spec_override_writes_seeds_with_commas_as_members_do():
    spec = REPO / "configs" / "studies" / "smoke.yaml"
    commas = main_job.load_study(spec, ["seeds=0,1", "lr_search.rates=1e-3,3e-3"])
    flow = main_job.load_study(spec, ["seeds=[0, 1]", "lr_search.rates=[1e-3, 3e-3]"])
    assert commas.seeds == flow.seeds == (0, 1)
    assert commas.lr_search.rates == flow.lr_search.rates == (1e-3, 3e-3)


def test_smoke_spec_has_every_cell_with_seeds_and_one_shape_of_rows():
    runs = _expand(REPO / "configs" / "studies" / "smoke.yaml")
    cells = {(r.arch, r.objective) for r in runs}
    assert len(cells) == 7 and ("noncausal_decoder", "flm") not in cells
    sizes = {c: {r.size for r in runs if (r.arch, r.objective) == c} for c in cells}
    # Laws in N: every FLM and PLM cell at three sizes, three seeds at each (9 runs).
    assert all(len(s) >= 3 for c, s in sizes.items() if c[1] != "mlm")
    assert all(
        sum((r.arch, r.objective, r.size) == (*c, size) for r in runs) >= 3
        for c, s in sizes.items()
        for size in s
    )
    # One row length and one number of positions per step for every cell: the prefix-LM
    # encoder-decoder's row holds two pieces in each stack, so it takes half the rows (and
    # reads the same documents in the same steps).
    assert len({r.cfg.objective.decoder_length for r in runs}) == 1
    for r in runs:
        pieces = 2 if (r.arch, r.objective) == ("encoder_decoder", "plm") else 1
        assert r.flops["positions_per_example"] == pieces * r.cfg.objective.decoder_length
        assert r.cfg.train.batch_size * pieces == 16
    sizes = [r.size_index for r in runs]
    assert sizes == sorted(sizes)  # size-major


def test_ids_stable_unique_and_config_sensitive(tiny_spec):
    a, b = _expand(tiny_spec), _expand(tiny_spec)
    assert [r.run_id for r in a] == [r.run_id for r in b]
    assert len({r.run_id for r in a}) == len(a) == 4
    assert all(r.run_id == r.cfg.hash() for r in a)
    changed = _expand(tiny_spec, ["budget.steps=5"])
    assert not {r.run_id for r in a} & {r.run_id for r in changed}
    seeds = _expand(tiny_spec, ["seeds=[0, 1, 2]"])
    assert len(seeds) == 12 and {r.seed for r in seeds} == {0, 1, 2}


def test_equal_flops_matches_training_flops(tiny_spec):
    runs = _expand(tiny_spec, ["matching=equal_flops", "budget.steps=40"])
    for size in {r.size for r in runs}:
        dec, ed = sorted((r for r in runs if r.size == size), key=lambda r: r.arch)
        assert ed.cfg.model.encoder_layers == ed.cfg.model.n_layers == dec.cfg.model.n_layers
        per_step = ed.planned_flops / ed.cfg.train.steps
        assert abs(ed.planned_flops - dec.planned_flops) <= per_step / 2 + 1e-6


def test_equal_total_params_mode(tiny_spec):
    runs = _expand(tiny_spec, ["matching=equal_total_params", "match_tolerance=0.05"])
    for size in {r.size for r in runs}:
        dec, ed = sorted((r for r in runs if r.size == size), key=lambda r: r.arch)
        assert abs(ed.params["total"] - dec.params["total"]) <= 0.05 * dec.params["total"]


def test_learning_rate_scales_inversely_with_width(tiny_spec):
    runs = _expand(
        tiny_spec,
        [
            "ladder.lr_scaling=inverse_width",
            "ladder.lr_reference_width=16",
            "base.optim.learning_rate=0.004",
        ],
    )
    assert {(r.cfg.model.d_model, r.cfg.optim.learning_rate) for r in runs} == {
        (16, 0.004),
        (32, 0.002),
    }


def test_isoflop_grid(tiny_spec):
    runs = _expand(tiny_spec, ["budget={kind: isoflop, compute: [3e9, 1e10], min_steps: 2}"])
    assert {r.budget for r in runs} <= {"C3e09", "C1e10"}
    for r in runs:
        c = float(r.budget[1:])
        per_step = r.planned_flops / r.cfg.train.steps
        assert c - per_step < r.planned_flops <= c


def test_cell_sizes_train_a_cell_at_only_the_sizes_named(tiny_spec):
    runs = _expand(tiny_spec, ["ladder.cell_sizes={encoder_decoder/mlm: [s]}"])
    assert sorted((r.arch, r.size) for r in runs) == [
        ("causal_decoder", "s"),
        ("causal_decoder", "xs"),
        ("encoder_decoder", "s"),
    ]
    full = {r.run_id for r in _expand(tiny_spec)}
    assert {r.run_id for r in runs} <= full  # the same runs, fewer of them
    with pytest.raises(ConfigError, match=r"\['m'\] are not sizes of the ladder \(xs, s\)"):
        _expand(tiny_spec, ["ladder.cell_sizes={encoder_decoder/mlm: [m]}"])
    with pytest.raises(ConfigError, match="'noncausal_decoder/plm' is not a cell of the study"):
        _expand(tiny_spec, ["ladder.cell_sizes={noncausal_decoder/plm: [s]}"])
    with pytest.raises(ConfigError, match="'arch/objective' with a non-empty list"):
        _expand(tiny_spec, ["ladder.cell_sizes={encoder_decoder: [s]}"])


def test_repeat_seeds_add_seeds_at_only_the_sizes_named(tiny_spec):
    runs = _expand(tiny_spec, ["repeat_seeds={seeds: [1, 2], sizes: [xs]}"])
    plain = _expand(tiny_spec)
    cells = {(r.arch, r.objective) for r in plain}
    got = sorted({(r.size, r.seed) for r in runs})
    assert got == [("s", 0), ("xs", 0), ("xs", 1), ("xs", 2)]
    assert len(runs) == len(plain) + 2 * len(cells)
    assert {r.run_id for r in plain} <= {r.run_id for r in runs}  # seed 0 runs unchanged
    repeats = [r for r in runs if r.seed == 2]
    assert all(r.cfg.train.seed == 2 and r.cfg.data.seed == 2 for r in repeats)
    with pytest.raises(ConfigError, match=r"\['m'\] are not sizes of the ladder \(xs, s\)"):
        _expand(tiny_spec, ["repeat_seeds={seeds: [1], sizes: [m]}"])
    with pytest.raises(ConfigError, match=r"repeat_seeds.seeds: \[0\] already in seeds"):
        _expand(tiny_spec, ["repeat_seeds={seeds: [0, 1], sizes: [xs]}"])
    with pytest.raises(ConfigError, match="give both seeds"):
        _expand(tiny_spec, ["repeat_seeds={seeds: [1]}"])


def test_steps_per_size_gives_the_named_sizes_their_own_steps(tiny_spec):
    plain = _expand(tiny_spec)
    runs = _expand(tiny_spec, ["budget.steps_per_size={s: 6}"])
    steps = {(r.arch, r.size): r.cfg.train.steps for r in runs}
    # The named size trains its own steps in every cell, the others the budget's; under
    # equal_documents the encoder-decoder's steps follow the causal decoder's at its size.
    assert {k: v for k, v in steps.items() if k[1] == "xs"} == {
        (r.arch, r.size): r.cfg.train.steps for r in plain if r.size == "xs"
    }
    assert steps[("causal_decoder", "s")] == 6
    assert {r.run_id for r in plain if r.size == "xs"} <= {r.run_id for r in runs}
    docs = _expand(tiny_spec, ["budget.steps_per_size={s: 6}", "matching=equal_documents"])
    flm = next(r for r in docs if r.size == "s" and r.arch == "causal_decoder")
    ed = next(r for r in docs if r.size == "s" and r.arch == "encoder_decoder")
    assert flm.cfg.train.steps == 6 and ed.cfg.train.steps != 4
    with pytest.raises(ConfigError, match=r"budget.steps_per_size: \['m'\] are not sizes"):
        _expand(tiny_spec, ["budget.steps_per_size={m: 6}"])
    with pytest.raises(ConfigError, match=r"budget\.steps_per_size is for budget\.kind='steps'"):
        _expand(tiny_spec, ["budget={kind: tokens, tokens: 1000, steps_per_size: {s: 6}}"])
    with pytest.raises(ConfigError, match="steps_per_size"):
        _expand(tiny_spec, ["budget.steps_per_size={s: 0}"])


def test_cell_base_changes_only_the_cell_it_names(tiny_spec):
    over = "cell_base={encoder_decoder/mlm: {optim: {learning_rate: 0.02}, train: {batch_size: 4}}}"
    runs = _expand(tiny_spec, [over, "base.optim.learning_rate=0.004"])
    plain = {r.run_id: r for r in _expand(tiny_spec, ["base.optim.learning_rate=0.004"])}
    for r in runs:
        if r.arch == "encoder_decoder":
            assert (r.cfg.optim.learning_rate, r.cfg.train.batch_size) == (0.02, 4)
            assert r.run_id not in plain
        else:  # other cells keep their configs, so their runs (ids) are the same
            assert r.run_id in plain and r.cfg == plain[r.run_id].cfg
    scaled = _expand(
        tiny_spec, [over, "ladder.lr_scaling=inverse_width", "ladder.lr_reference_width=16"]
    )
    # The cell's own rate is the one the ladder scales by width.
    lrs = {(r.cfg.model.d_model, r.cfg.optim.learning_rate) for r in scaled if r.arch[0] == "e"}
    assert lrs == {(16, 0.02), (32, 0.01)}
    with pytest.raises(ConfigError, match="cell_base: 'noncausal_decoder/plm' is not a cell"):
        _expand(tiny_spec, ["cell_base={noncausal_decoder/plm: {train: {batch_size: 4}}}"])


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_every_study_spec_validates(path, capsys):
    main_job.run_study(path, Path("unused"), dry_run=True)
    assert "runs" in capsys.readouterr().out


def test_bad_specs_name_the_problem(tiny_spec):
    with pytest.raises(ConfigError, match="not a valid cell"):
        _expand(tiny_spec, ["cells=[[encoder_decoder, flm]]"])
    with pytest.raises(ConfigError, match="unknown key 'matchng'"):
        _expand(tiny_spec, ["matchng=equal_flops"])
    with pytest.raises(ConfigError, match="d_model"):
        _expand(tiny_spec, ["base.model.d_model=-1"])


def test_launch_renders_slurm_and_tpu(tiny_spec, tmp_path):
    out = tmp_path / "study"
    text = after_pretraining.launch(tiny_spec, "slurm", out, submit=False)
    assert "#SBATCH --array=0-3" in text
    assert "scalestudy train --eval --config" in text and "study --collect --spec" in text
    listed = (out / "runs.txt").read_text().split()
    assert len(listed) == 4
    runs = _expand(tiny_spec)
    for run, workdir in zip(runs, listed):
        assert load_config(Path(workdir) / "config.yaml").hash() == run.run_id
    tpu = after_pretraining.launch(tiny_spec, "tpu", out, submit=False)
    assert "gcloud compute tpus queued-resources create" in tpu
    assert tpu.count("train --eval --config") == 4 and tpu.count(" all 'cd ") == 5
    assert "launch --spec" in tpu  # workers write the run configs themselves


def _fake_train(cfg, workdir):
    summary = {"steps": cfg.train.steps, "tokens": 1.0, "flops": 1.0, "final_val_loss": 1.0}
    (workdir / "summary.json").write_text(json.dumps(summary))
    return summary


def test_a_study_off_a_terminal_prints_a_line_as_each_phase_starts_and_ends(
    tmp_path, tiny_spec, capsys
):
    main_job.run_study(tiny_spec, tmp_path / "out", train_fn=_fake_train)
    out = capsys.readouterr()  # pytest's captured stderr is not a terminal
    assert "\r" not in out.out + out.err
    phases = [ln for ln in out.out.splitlines() if ln.startswith("study: ")]
    said = [re.sub(r" \(\d+\.\d+s\)$", "", ln) for ln in phases]
    # No learning-rate search in this spec: no line for it. Fits run inside the report.
    assert said == [
        "study: pretraining started",
        "study: pretraining finished",
        "study: report started",
        "study: fits started",
        "study: fits finished",
        "study: report finished",
    ]


def test_a_phase_that_raises_says_it_did_not_finish_and_a_terminal_gets_no_line(capsys):
    with pytest.raises(KeyError), phase("stages", plain=True):
        raise KeyError("x")
    with phase("fits", plain=False):
        pass
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "study: stages started"
    assert re.fullmatch(r"study: stages did not finish \(\d+\.\d+s\)", lines[1])
    assert len(lines) == 2
