"""The shipped study specs: the smoke study supports its fits and probes, the real-text study
runs end to end at a tiny scale on the real corpora."""

import math
from pathlib import Path

import pytest

from scalestudy.study.run import main_job

counting = pytest.importorskip("scalestudy.models.counting")

REPO = Path(__file__).resolve().parents[2]
STUDIES = REPO / "configs" / "studies"
DATA = REPO.parent / "shared" / "data"
FLM_PLM = {
    ("causal_decoder", "flm"),
    ("causal_decoder", "plm"),
    ("noncausal_decoder", "plm"),
    ("encoder_decoder", "plm"),
}


def _expand(name, overrides=()):
    path = STUDIES / name
    study = main_job.load_study(path, overrides)
    return study, main_job.expand(study, path.parent)


def test_smoke_fit_laws_have_the_runs_their_flags_ask_for():
    """The FLM and PLM laws of the main job: three runs per fitted parameter (the `points`
    flag), two or more seeds at every size (`seed`), and tokens per parameter within the
    `training` flag's ratio across the ladder."""
    forms = pytest.importorskip("scalestudy.scaling.forms")
    laws = pytest.importorskip("scalestudy.scaling.laws")
    flags = pytest.importorskip("scalestudy.scaling.flags")
    study, runs = _expand("smoke.yaml")
    need = laws.FitSettings().min_points_per_param
    cells = {(r.arch, r.objective) for r in runs}
    for cell in FLM_PLM & cells:
        mine = [r for r in runs if (r.arch, r.objective) == cell]
        for law in study.fit.laws:
            n_params = len(forms.get_form(law).params)
            assert len(mine) >= need * n_params, (cell, law, len(mine), n_params)
        sizes = {r.size for r in mine}
        assert len(sizes) >= 3 and all(sum(r.size == s for r in mine) >= 2 for s in sizes)
        ratio = [r.cfg.train.steps / r.params[study.fit.n_kind] for r in mine]
        assert max(ratio) / min(ratio) <= flags.MAX_TOKENS_PER_PARAM_RATIO, cell
        # ... while the sizes span enough to pin an exponent (5.9x does, the old 3.3x did not).
        n = [r.params[study.fit.n_kind] for r in mine]
        assert max(n) / min(n) >= 5, cell
        # Run-to-run spread is widest at the smallest size: more seeds there than elsewhere.
        smallest = min(mine, key=lambda r: r.params[study.fit.n_kind]).size
        per_size = {s: sum(r.size == s for r in mine) for s in sizes}
        assert per_size[smallest] == max(per_size.values()) > min(per_size.values()), cell


def test_the_main_jobs_decoders_train_every_rung_past_the_plateau_with_one_recipe():
    """smoke.yaml: one row shape and optimizer for every run; at least 120 steps at
    every rung of the decoder LM cells and no rung narrower than 24 (narrower rungs left one
    seed in five on the loss plateau after 120 steps), four sizes, laws with E; within a cell
    and size one rate, and across sizes the width rule's (rate x d_model constant)."""
    study, runs = _expand("smoke.yaml")
    assert all(law in ("kaplan_n", "kaplan_c") for law in study.fit.laws)
    decoders = [r for r in runs if (r.arch, r.objective) in FLM_PLM - {("encoder_decoder", "plm")}]
    assert min(r.cfg.train.steps for r in decoders) >= 120
    assert min(r.cfg.model.d_model for r in runs) >= 24
    assert len({r.size for r in decoders}) == 4
    shape = lambda r: (r.cfg.objective.inputs_length, r.cfg.objective.targets_length,
                       r.cfg.model.qk_norm, r.cfg.optim.name, r.cfg.optim.schedule)  # fmt: skip
    assert len({shape(r) for r in runs}) == 1
    for cell in {(r.arch, r.objective) for r in runs}:
        mine = [r for r in runs if (r.arch, r.objective) == cell]
        assert len({round(r.cfg.optim.learning_rate * r.cfg.model.d_model, 9) for r in mine}) == 1


def test_smoke_probes_mostly_fit_the_scoring_length():
    from scalestudy.data.pipeline import scoring_batch
    from scalestudy.data.vocab import get_vocabulary
    from scalestudy.evaluate.rank import limit_examples, scoring_config
    from scalestudy.evaluate.tasks import load_task

    _, runs = _expand("smoke.yaml")
    for arch in ("causal_decoder", "noncausal_decoder", "encoder_decoder"):
        cfg = next(r.cfg for r in runs if r.arch == arch)
        vocab = get_vocabulary(cfg.data)
        task = load_task("synthetic_probes", synthetic=cfg.data.synthetic)
        examples = limit_examples(task, cfg.eval.max_examples)
        scoring = scoring_config(cfg)
        cut = 0
        for ex in examples:
            pairs = ex.pairs()
            inputs = [list(vocab.encode(c)) for c, _ in pairs]
            targets = [list(vocab.encode(t)) for _, t in pairs]
            cut += scoring_batch(scoring, inputs, targets)[1] > 0
        # Before: every probe context (78-277 bytes) was cut to the 48 training input bytes.
        assert cut <= len(examples) // 4, (arch, cut, len(examples))


def test_realtext_spec_has_every_cell_at_six_sizes_and_relative_paths():
    study, runs = _expand("realtext.yaml")
    cells = {(r.arch, r.objective) for r in runs}
    assert len(cells) == 7 and len({r.size for r in runs}) >= 6
    data = runs[0].cfg.data
    paths = [*data.paths, *data.validation_paths, data.spm_path, runs[0].cfg.eval.data_dir]
    paths += [t.split(":", 1)[1] for t in study.tasks if t.startswith("text:")]
    assert all(not Path(p).is_absolute() for p in paths), paths
    # Relative to the repository root, the data paths name the shared corpora.
    if DATA.is_dir():
        for p in [*data.paths, *data.validation_paths, runs[0].cfg.eval.data_dir]:
            assert (REPO / p).exists(), p


@pytest.mark.slow
@pytest.mark.skipif(not DATA.is_dir(), reason=f"real data not found at {DATA}")
def test_realtext_spec_runs_at_tiny_scale(tmp_path):
    from scalestudy.cli import main as cli
    from scalestudy.data.vocab import train_sentencepiece
    from scalestudy.study.record.registry import load_runs

    pytest.importorskip("scalestudy.train.loop")
    corpora, evals = DATA / "corpora", DATA / "eval"
    valid = corpora / "tinystories" / "tinystories_valid_first794KB.txt"
    spm = train_sentencepiece([valid], tmp_path / "vocab.model", vocab_size=256)
    wiki = corpora / "wikitext2" / "valid.txt"
    tasks = ["copa", "piqa", "arc_easy", "hellaswag", "winogrande", "lambada", f"text:{wiki}"]
    out = tmp_path / "study"
    overrides = [
        f"base.data.paths=[{corpora / 'tinystories' / 'tinystories_train_first2316stories.txt'}"
        f",{corpora / 'gutenberg_children'}]",
        f"base.data.validation_paths=[{valid}]",
        f"base.data.spm_path={spm}",
        "base.data.max_documents=40",
        "base.model.vocab_size=384",
        f"base.eval.data_dir={evals}",
        "base.eval.max_examples=3",
        "base.optim.warmup_steps=1",
        "base.train.eval_batches=1",
        "base.train.checkpoint_every=3",
        "base.train.async_checkpoint=false",
        f"tasks=[{','.join(tasks)}]",
        "cells=[[noncausal_decoder,mlm]]",
        "ladder.preset=null",
        "ladder.sizes=[{name: xs, d_model: 16, n_layers: 2, d_ff: 32}]",
        "budget.steps=3",
        "fit.bootstrap=0",
    ]
    args = ["study", "--spec", str(STUDIES / "realtext.yaml"), "--out", str(out), *overrides]
    assert cli.main(args) == 0
    runs = load_runs(out)
    assert len(runs) == 1 and all(r["status"] == "done" for r in runs)
    for r in runs:
        config = (Path(r["workdir"]) / "config.yaml").read_text()
        assert f"spm_path: {spm}" in config and "vocab: sentencepiece" in config
        for task in tasks[:-1]:
            assert r[f"eval/{task}/n"] == 3, task
        assert math.isfinite(r["eval/text/bpb"]) and r["eval/text/bpb"] > 0
    assert (out / "report.md").is_file()


def test_the_main_job_has_one_recipe_and_searches_every_cells_rate():
    study, runs = _expand("smoke.yaml")
    assert not study.cell_base and study.lr_search is not None and len(study.seeds) >= 3
    from scalestudy.data.objectives import feature_lengths

    # Equal positions per step: the PLM encoder-decoder's rows hold two pieces, so half as many.
    row = lambda r: sum(feature_lengths(r.cfg.objective, r.arch == "encoder_decoder"))
    same = {
        (
            r.cfg.train.batch_size * row(r),
            r.cfg.objective.inputs_length,
            r.cfg.objective.targets_length,
            r.cfg.model.qk_norm,
            r.cfg.model.dropout,
            r.cfg.optim.model_copy(update={"learning_rate": 0.0}).model_dump_json(),
        )
        for r in runs
    }
    assert len(same) == 1, same
    # Equal data: every cell reads the causal decoder's document tokens at each size.
    from scalestudy.data.pipeline import document_tokens_per_row

    for size in {r.size for r in runs}:
        docs = {
            r.cfg.train.steps * r.cfg.train.batch_size * document_tokens_per_row(r.cfg)
            for r in runs
            if r.size == size
        }
        assert max(docs) / min(docs) <= 1.1, (size, docs)
    # ... in the same steps where a row holds whole pieces (match_by: batch): every PLM cell.
    plm = {(r.size, r.cfg.train.steps) for r in runs if r.objective == "plm"}
    assert len(plm) == len({r.size for r in runs if r.objective == "plm"}) == 4


def test_the_wang_spec_gives_every_cell_the_same_tokens_and_updates():
    """Wang et al. halved the encoder-decoder PLM cell's batch (its rows hold two examples), so
    every cell trains 168B tokens in the same number of updates under the rsqrt schedule."""
    from scalestudy.data.pipeline import document_tokens_per_row

    _, runs = _expand("wang2022.yaml")
    steps = {(r.cfg.model.arch, r.cfg.objective.name): r.cfg.train.steps for r in runs}
    tokens = {
        (r.cfg.model.arch, r.cfg.objective.name): r.cfg.train.steps
        * r.cfg.train.batch_size
        * document_tokens_per_row(r.cfg)
        for r in runs
    }
    assert len(steps) == 6 and len(set(steps.values())) == 1, steps
    # Document tokens: equal across the language-modeling cells (PLM's encoder-decoder too),
    # and across the span-corruption cells (whose 626 positions hold fewer raw tokens).
    for objectives in (("flm", "plm"), ("mlm",)):
        group = [t for (_, o), t in tokens.items() if o in objectives]
        assert max(group) / min(group) < 1.001, tokens


def test_incontext_study_scores_every_run_at_every_k_on_a_corpus_with_episodes():
    _, runs = _expand("incontext.yaml")
    assert {(r.arch, r.objective) for r in runs} == {
        ("causal_decoder", "flm"),
        ("noncausal_decoder", "plm"),
        ("encoder_decoder", "plm"),
    }
    for r in runs:
        assert r.cfg.eval.num_fewshot == (0, 1, 2, 4, 8)
        assert r.cfg.eval.tasks == ("incontext_probe",)
        assert r.cfg.data.synthetic.incontext_share == 0.3
    seeds = {(r.arch, r.size): set() for r in runs}
    for r in runs:
        seeds[(r.arch, r.size)].add(r.seed)
    assert all(s == {0, 1, 2} for s in seeds.values())  # every point paired by seed


def test_the_main_job_scores_the_incontext_probe_at_every_k_with_every_demonstration():
    """smoke.yaml: the in-context probe at K = 0..8 beside the zero-shot probes, on a corpus
    with episodes, and every 8-shot prompt keeps its 8 demonstrations within the scoring
    budget in every architecture (none dropped from the front)."""
    from scalestudy.data.vocab import get_vocabulary
    from scalestudy.evaluate.rank import _fewshot, limit_examples, scoring_config, shot_counts
    from scalestudy.evaluate.tasks import load_tasks

    _, runs = _expand("smoke.yaml")
    for arch in ("causal_decoder", "noncausal_decoder", "encoder_decoder"):
        cfg = next(r.cfg for r in runs if r.arch == arch)
        assert cfg.data.synthetic.incontext_share == 0.3
        probes, icl = load_tasks(cfg.eval, cfg.data.synthetic)
        assert (probes.name, icl.name) == ("synthetic_probes", "incontext_probe")
        assert shot_counts(cfg, probes) == (0,)
        assert shot_counts(cfg, icl) == (0, 1, 2, 4, 8)
        examples = limit_examples(icl, cfg.eval.max_examples)
        vocab = get_vocabulary(cfg.data)
        _, shots = _fewshot(icl, examples, 8, vocab, scoring_config(cfg))
        assert [s.kept for s in shots] == [8] * len(examples), arch


def test_the_moe_laws_spec_varies_only_the_experts_at_each_size(tmp_path):
    """configs/studies/moe_laws.yaml: at each rung the 4- and 16-expert variants use the dense
    model's active parameters per token plus their routers (top-1 experts as wide as the
    dense MLP), so Clark et al.'s law sees E change at nearly fixed N; the rows carry both."""
    study, runs = _expand("moe_laws.yaml")
    assert study.fit.laws == ("clark_ne",) and study.fit.n_kind == "active"
    rows = [r.row(study.name, tmp_path / r.dirname) for r in runs]
    assert {r["experts"] for r in rows} == {1, 4, 16} and {r["granularity"] for r in rows} == {1.0}
    for r in rows:  # the same active parameters as the dense model but for each layer's router
        dense = next(d for d in rows if d["size"] == r["size"] and d["experts"] == 1)
        router = r["n_layers"] * (r["d_model"] + 1) * r["experts"] if r["experts"] > 1 else 0
        assert r["params_active"] - dense["params_active"] == router


def test_the_granularity_spec_varies_n_d_and_g_at_fixed_expansion(tmp_path):
    """configs/studies/moe_granularity.yaml: at each size the three granularities have the
    same active and total parameters but for their routers (4G experts d_ff / G wide, top
    G), and the two IsoFLOP budgets give each (size, G) two token counts, so Krajewski et
    al.'s law sees N, D and G vary apart."""
    study, runs = _expand("moe_granularity.yaml")
    assert study.fit.laws == ("krajewski_ndg",) and study.fit.n_kind == "active"
    rows = [r.row(study.name, tmp_path / r.dirname) for r in runs]
    assert {r["granularity"] for r in rows} == {1.0, 2.0, 4.0}
    for r in rows:
        g = int(r["granularity"])
        assert r["experts"] == 4 * g
        g1 = next(
            d for d in rows
            if d["size"] == r["size"] and d["granularity"] == 1 and d["steps"] >= r["steps"] * 0.9
            and d["steps"] <= r["steps"] * 1.1
        )  # fmt: skip
        router = r["n_layers"] * (r["d_model"] + 1) * (r["experts"] - g1["experts"])
        assert r["params_active"] - g1["params_active"] == router
        assert r["params_total"] - g1["params_total"] == router
    for size in {r["size"] for r in rows}:
        assert len({r["steps"] for r in rows if r["size"] == size and r["granularity"] == 1}) == 2
