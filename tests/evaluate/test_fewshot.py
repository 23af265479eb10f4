"""Few-shot prompts: the harness's format and sampler, scores of the whole prompt in every
architecture, demonstrations dropped whole to fit the budget, and refusals."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jax
import numpy as np
import pytest

from scalestudy.config.errors import ConfigError
from scalestudy.config.eval_config import EvalConfig
from scalestudy.config.yamlio import validate
from scalestudy.data.vocab import get_vocabulary
from scalestudy.evaluate import fewshot, rank
from scalestudy.evaluate.formats import TaskDataError
from scalestudy.evaluate.tasks import load_task, load_tasks
from scalestudy.models.api import build_model

from .tiny_models import reference_logprob, tiny

ARCH_OBJECTIVE = {"causal_decoder": "flm", "noncausal_decoder": "plm", "encoder_decoder": "plm"}


def _write_task(folder: Path, n: int = 12, **extra) -> Path:
    """A sums task (three choices) of `n` rows, a 5-row demonstration split, and its YAML."""
    rng = random.Random(0)
    rows = []
    for i in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        choices = [str(a + b), str(a + b + 1), str(a * b + 3)]
        rows.append({"id": i, "question": f"{a} plus {b}?", "choices": choices, "label": i % 3})
    (folder / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = [{**r, "id": 100 + r["id"], "question": "So " + r["question"]} for r in rows[:5]]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    config = {"name": "sums", "path": "sums.jsonl", "context_field": "question"}
    config |= {"label_field": "label", **extra}
    path = folder / "sums.yaml"
    path.write_text(json.dumps(config))
    return path


def _prompts(task, k: int, seed: int = 1234, delimiter: str = "\n\n") -> list[str]:
    """Each example's K-shot prompt with no budget limit."""
    examples = list(task.examples)
    unlimited = lambda exs: [np.full(len(e.pairs()), 10**9) for e in exs]
    shown, _ = fewshot.fewshot_examples(task, examples, k, seed, delimiter, list, unlimited)
    return [e.contexts[0] for e in shown]


@pytest.mark.parametrize("split", ["same", "train"])
def test_prompts_equal_the_harness_formatting(tmp_path: Path, monkeypatch, split: str) -> None:
    """lm-evaluation-harness's own `fewshot_context` over the same JSON file and seed builds
    the same prompt for every example, K = 0..3, with a description and both delimiters set."""
    api = pytest.importorskip("lm_eval.api.task", reason="lm-eval is not installed")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    extra = {"description": "Sums.\n", "fewshot_delimiter": "\n", "delimiter": " = "}
    if split == "train":
        extra["fewshot_path"] = "train.jsonl"
    path = _write_task(tmp_path, **extra)
    ours = load_task(str(path))
    files = {"test": str(tmp_path / "sums.jsonl"), "train": str(tmp_path / "train.jsonl")}
    config = {
        "task": "sums",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": files},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}",
        "description": "Sums.\n",
        "fewshot_delimiter": "\n",
        "target_delimiter": " = ",
    }
    # Named even when it is the scored split: the harness removes the scored example only
    # when fewshot_split == test_split (left unset, 0.4.13 can show an example itself).
    config["fewshot_split"] = "train" if split == "train" else "test"
    harness = api.ConfigurableTask(config=config)
    docs = list(harness.test_docs())
    for k in range(4):
        harness.set_fewshot_seed(1234)  # as the harness's evaluator does before each task
        expected = [harness.fewshot_context(doc, k) for doc in docs]
        assert _prompts(ours, k) == expected, k
    assert _prompts(ours, 3) != _prompts(ours, 3, seed=1)  # the seed matters


def test_demonstrations_come_from_the_pool_and_never_the_scored_example(tmp_path: Path) -> None:
    task = load_task(str(_write_task(tmp_path)))
    drawn = fewshot.draw(task, list(task.examples), 4, seed=7)
    assert drawn == fewshot.draw(task, list(task.examples), 4, seed=7)
    for i, picks in enumerate(drawn):
        assert len(set(picks)) == 4 and i not in picks
    # Probes draw within their own pool (kind): no demonstration from another kind.
    probes = load_task("synthetic_probes")
    examples = list(probes.examples)[::40]
    for ex, picks in zip(examples, fewshot.draw(probes, examples, 3, seed=0), strict=True):
        assert all(probes.examples[i].pool == ex.pool and probes.examples[i] != ex for i in picks)
    # Another split: K of its rows, none excluded.
    demos = load_task(str(_write_task(tmp_path, fewshot_path="train.jsonl")))
    assert demos.demos is not None and len(demos.demos) == 5
    assert all(len(p) == 5 for p in fewshot.draw(demos, list(demos.examples), 5, seed=0))


@pytest.fixture(scope="module", params=list(ARCH_OBJECTIVE))
def built(request):
    cfg = tiny(request.param, ARCH_OBJECTIVE[request.param], num_fewshot=[2])
    model = build_model(cfg.model)
    params = model.init(jax.random.key(3))
    return cfg, model, params, rank.Scorer(cfg, model, params)


def test_fewshot_scores_are_the_whole_prompts_log_likelihood(built, tmp_path: Path) -> None:
    """Each choice's score is log p(" " + choice | prompt) computed directly from the model's
    logits on the prompt built by hand from the recorded demonstrations: the causal decoder
    reads it causally, the non-causal decoder as its prefix, the encoder-decoder encodes it."""
    cfg, model, params, scorer = built
    task = load_task(str(_write_task(tmp_path, n=6)))
    vocab = get_vocabulary(cfg.data)
    records: list[dict] = []
    out = rank.evaluate_task(
        task, scorer.score, vocab, cfg, records=records, num_fewshot=2, max_examples=4
    )
    assert out["sums.2shot/n"] == 4 and out["sums.2shot/shots"] == 2
    by_source = {ex.source: ex for ex in task.examples}
    for record in records:
        demos = [by_source[s] for s in record["shown"]]
        assert record["source"] not in record["shown"] and len(demos) == 2
        prompt = "".join(f"{d.contexts[0]} {d.choices[d.gold]}\n\n" for d in demos)
        prompt += by_source[record["source"]].contexts[0]
        assert record["prompt"] == prompt
        for choice in record["choices"]:
            context, target = vocab.encode(prompt), vocab.encode(" " + choice["text"])
            expected = reference_logprob(cfg, model, params, [context], [target])[0]
            assert choice["logprob"] == pytest.approx(expected, rel=1e-4, abs=1e-4)
    zero = rank.evaluate_task(task, scorer.score, vocab, cfg, max_examples=4)
    assert zero["sums/task_loss"] != out["sums.2shot/task_loss"]  # the prompt is really read


def test_demonstrations_that_do_not_fit_are_dropped_whole_from_the_front(tmp_path: Path) -> None:
    task = load_task(str(_write_task(tmp_path)))
    vocab = get_vocabulary(tiny("causal_decoder", "flm").data)
    examples = list(task.examples)
    demo = fewshot.demonstration(task, examples[0]) + "\n\n"
    # Room for the question and one demonstration (every demonstration here is as long).
    room = len(vocab.encode(demo + examples[0].contexts[0])) + 2
    budget = lambda exs: [np.full(len(e.pairs()), room) for e in exs]
    shown, shots = fewshot.fewshot_examples(task, examples, 3, 0, "\n\n", vocab.encode, budget)
    drawn = fewshot.draw(task, examples, 3, 0)
    for ex, new, s, picks in zip(examples, shown, shots, drawn, strict=True):
        assert s.drawn == picks and s.kept == 1
        last = fewshot.demonstration(task, task.examples[picks[-1]]) + "\n\n"
        assert new.contexts == (last + ex.contexts[0],)  # the last one kept, whole
    metrics = fewshot.shot_metrics("sums.3shot", 3, shots)
    assert metrics == {"sums.3shot/shots": 1.0, "sums.3shot/fewshot_dropped": len(examples)}
    record = fewshot.shot_records(task, shots)[0]
    assert record["shots"] == 1 and record["fewshot_dropped"] == 2
    assert record["shown"] == [task.examples[drawn[0][-1]].source]
    # No room for even one demonstration anywhere: refused, saying what to change.
    tight = lambda exs: [np.full(len(e.pairs()), room - 8) for e in exs]
    with pytest.raises(TaskDataError, match=r"not one 3-shot prompt fits.*inputs_length"):
        fewshot.fewshot_examples(task, examples, 3, 0, "\n\n", vocab.encode, tight)


def test_the_context_budget_drops_demonstrations_in_evaluation(tmp_path: Path) -> None:
    """eval.inputs_length cuts K-shot prompts at demonstration boundaries: the question is
    never cut, the examples given fewer than K are counted."""
    cfg = tiny("encoder_decoder", "plm", inputs_length=40)
    model = build_model(cfg.model)
    params = model.init(jax.random.key(0))
    task = load_task(str(_write_task(tmp_path)))
    vocab = get_vocabulary(cfg.data)
    records: list[dict] = []
    scorer = rank.Scorer(cfg, model, params)
    out = rank.evaluate_task(task, scorer.score, vocab, cfg, records=records, num_fewshot=4)
    assert out["sums.4shot/truncated"] == 0 and 0 < out["sums.4shot/shots"] < 4
    assert out["sums.4shot/fewshot_dropped"] == sum(r["shots"] < 4 for r in records) > 0
    for r in records:
        assert max(r["context_tokens"]) <= 40 and r["shots"] + r["fewshot_dropped"] == 4
        assert r["prompt"].count("\n\n") == r["shots"]


def test_bad_fewshot_settings_are_one_clear_error(tmp_path: Path) -> None:
    path = _write_task(tmp_path)
    task = load_task(str(path))
    with pytest.raises(TaskDataError, match=r"num_fewshot=12 but only 11 demonstrations"):
        fewshot.draw(task, list(task.examples), 12, 0)
    with pytest.raises(ConfigError, match="num_fewshot=-1; accepted: a whole number"):
        validate(EvalConfig, {"num_fewshot": -1}, "eval")
    (tmp_path / "other").mkdir()
    missing = _write_task(tmp_path / "other", fewshot_path="dev.jsonl")
    with pytest.raises(TaskDataError, match=r"'sums': fewshot_path 'dev.jsonl' not found"):
        load_task(str(missing))
    with pytest.raises(ConfigError, match=r"eval.fewshot_files names \['piqa'\]"):
        load_tasks(EvalConfig(tasks=[str(path)], fewshot_files={"piqa": "x.jsonl"}))
    # Held-out text has no few-shot form: scored zero-shot only.
    cfg = tiny("causal_decoder", "flm", num_fewshot=[0, 2])
    assert rank.shot_counts(cfg, load_task(f"text:{path}")) == (0,)
    assert rank.shot_counts(cfg, task) == (0, 2)
    # ... and without 0 among the numbers it would score nothing: refused, naming it.
    only_two = tiny("causal_decoder", "flm", num_fewshot=[2])
    text = load_task(f"text:{path}")
    with pytest.raises(ConfigError, match=rf"task '{text.name}' is held-out text.*\[2\]"):
        rank.shot_counts(only_two, text)
    with pytest.raises(ConfigError, match="would score nothing"):
        rank.check_tasks(only_two, [task, text])  # before any training


def test_per_task_shot_counts_replace_num_fewshot_for_the_tasks_they_name(tmp_path: Path) -> None:
    """eval.num_fewshot_per_task gives one task its own K list (the in-context probe at
    0..8 beside zero-shot probes); other tasks keep eval.num_fewshot; a name that is not
    scored is refused when the tasks load; the command line's --num-fewshot clears it."""
    path = _write_task(tmp_path)
    sums = load_task(str(path))
    cfg = tiny("causal_decoder", "flm", num_fewshot=[0, 1])
    cfg = cfg.replace(
        eval=cfg.eval.replace(tasks=[str(path), "synthetic_probes"],
                              num_fewshot_per_task={"sums": [0, 2, 4]})
    )  # fmt: skip
    probes = load_task("synthetic_probes")
    assert rank.shot_counts(cfg, sums) == (0, 2, 4)
    assert rank.shot_counts(cfg, probes) == (0, 1)
    assert [t.name for t in load_tasks(cfg.eval)] == ["sums", "synthetic_probes"]
    with pytest.raises(ConfigError, match=r"num_fewshot_per_task names 'sum', which is not a"):
        load_tasks(cfg.eval.replace(num_fewshot_per_task={"sum": [2]}))
    with pytest.raises(ConfigError, match=r"num_fewshot_per_task.sums=\[-2\]; accepted"):
        validate(EvalConfig, {"num_fewshot_per_task": {"sums": [-2]}}, "eval")
    with pytest.raises(ConfigError, match=r"num_fewshot_per_task=\[2\]; accepted: a mapping"):
        validate(EvalConfig, {"num_fewshot_per_task": [2]}, "eval")
    # Naming a task that is scored with other tasks given (`eval --tasks`) is not an error.
    assert [t.name for t in load_tasks(cfg.eval, names=["synthetic_probes"])] == [
        "synthetic_probes"
    ]


def test_eval_cli_scores_each_k_under_its_own_name(tmp_path: Path, capsys) -> None:
    from scalestudy.cli.main import main
    from scalestudy.evaluate.results import examples_path, write_examples
    from scalestudy.train.rundir.checkpoint import Checkpointer

    cfg = tiny("causal_decoder", "flm", tasks=[str(_write_task(tmp_path))], max_examples=3)
    cfg = cfg.replace(eval=cfg.eval.replace(num_fewshot_per_task={"sums": [4]}))
    model = build_model(cfg.model)
    run = tmp_path / "run"
    ckpt = Checkpointer(run / "checkpoints", async_save=False)
    ckpt.save(5, {"params": model.init(jax.random.key(0)), "step": np.int32(5)}, {"cursor": 0}, cfg)
    ckpt.close()
    (run / "summary.json").write_text(json.dumps({"name": "run", "steps": 5}))
    before = sorted(p.name for p in run.rglob("*"))
    assert main(["eval", "--workdir", str(run), "--num-fewshot", "20"]) == 2  # > the pool
    with pytest.raises(SystemExit) as exit_:  # argparse's one line, exit 2
        main(["eval", "--workdir", str(run), "--num-fewshot", "-1"])
    assert exit_.value.code == 2
    # Held-out text has no few-shot form: at K=2 only, one error naming it (it said "could
    # not update the run directory" once nothing had been scored).
    (tmp_path / "notes.txt").write_text("Some held-out text to score. " * 20)
    capsys.readouterr()
    text = ["--tasks", f"text:{tmp_path / 'notes.txt'}", "--num-fewshot", "2"]
    assert main(["eval", "--workdir", str(run), *text]) == 2
    err = capsys.readouterr().err
    assert "is held-out text" in err and "would score nothing" in err
    assert "could not update" not in err
    # Nothing scored writes nothing (no settings index into a folder never made).
    assert write_examples(tmp_path / "empty", 5, {}, {"num_fewshot": [2]}) == []
    assert not (tmp_path / "empty").exists()
    after = sorted(p.name for p in run.rglob("*") if p.name != "train.log")  # the run's log
    assert after == before  # no results written
    assert main(["eval", "--workdir", str(run), "--num-fewshot", "0,2"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_config"]["num_fewshot"] == [0, 2]
    assert "num_fewshot_per_task" not in summary["eval_config"]  # the run's [4] gave way
    assert not any(key.startswith("sums.4shot") for key in summary["eval"])
    assert {"sums/acc", "sums.2shot/acc", "sums.2shot/shots"} <= set(summary["eval"])
    rows = [json.loads(x) for x in examples_path(run, 5, "sums.2shot").read_text().splitlines()]
    assert len(rows) == 3 and all(r["shots"] == 2 and len(r["shown"]) == 2 for r in rows)
    assert np.mean([r["pred"] == r["gold"] for r in rows]) == summary["eval"]["sums.2shot/acc"]


def _reader(vocab):
    """A scorer that has learnt only to copy: a choice scores 1 when the prompt already says
    "<word> is <choice>", else 0 (ties go to the first choice)."""

    def score(fitted):
        lp = []
        for x, t in zip(fitted.inputs, fitted.targets, strict=True):
            prompt, choice = vocab.decode(x), vocab.decode(t).strip()
            word = prompt.rsplit("\n", 1)[-1].removesuffix(" is")
            lp.append(float(f"{word} is {choice}" in prompt))
        n = np.array([len(t) for t in fitted.targets])
        return np.array(lp), n, np.zeros(len(n), bool)

    return score


def _rule_reader(vocab):
    """A scorer that has learnt the corpus's rule: a choice scores 1 when it is the colour of
    the prompt's lines before the question (all one colour in an episode), else 0."""

    def score(fitted):
        lp = []
        for x, t in zip(fitted.inputs, fitted.targets, strict=True):
            prompt, choice = vocab.decode(x), vocab.decode(t).strip()
            shown = [line.rsplit(" is ", 1)[-1] for line in prompt.split("\n")[:-1]]
            lp.append(float(bool(shown) and shown[-1] == choice))
        n = np.array([len(t) for t in fitted.targets])
        return np.array(lp), n, np.zeros(len(n), bool)

    return score


def _smoke_rows(arch: str, objective: str):
    """The tiny model trained on the smoke study's rows (96 + 32 positions)."""
    cfg = tiny(arch, objective)
    return cfg.replace(objective=cfg.objective.replace(inputs_length=96, targets_length=32))


def test_the_incontext_probe_is_at_chance_without_demonstrations() -> None:
    """Zero-shot, every twin pair reads the same prompt and choices with opposite answers:
    exactly chance for any model (a real untrained one, a copier, a rule reader); with
    demonstrations from its own episode a model that has learnt the episode's rule is right
    from K = 1, while one that only copies the scored question from the prompt stays at
    chance at every K (no demonstration holds it)."""
    task = load_task("incontext_probe")
    cfg = _smoke_rows("causal_decoder", "flm")  # rows that hold 8 demonstrations
    vocab = get_vocabulary(cfg.data)
    copied, ruled = {}, {}
    for k in (0, 1, 2, 4, 8):
        name = fewshot.task_name("incontext_probe", k)
        copied[k] = rank.evaluate_task(task, _reader(vocab), vocab, cfg, num_fewshot=k)[
            f"{name}/acc"
        ]
        ruled[k] = rank.evaluate_task(task, _rule_reader(vocab), vocab, cfg, num_fewshot=k)[
            f"{name}/acc"
        ]
    assert set(copied.values()) == {0.5}
    assert ruled[0] == 0.5 and all(ruled[k] == 1.0 for k in (1, 2, 4, 8))
    model = build_model(cfg.model)
    scorer = rank.Scorer(cfg, model, model.init(jax.random.key(5)))
    out = rank.evaluate_task(task, scorer.score, vocab, cfg, max_examples=None)
    assert out["incontext_probe/acc"] == 0.5 and out["incontext_probe/acc_norm"] == 0.5
    # Demonstrations never leave their episode, and the twins' answers really differ.
    drawn = fewshot.draw(task, list(task.examples), 8, seed=0)
    for ex, picks in zip(task.examples, drawn, strict=True):
        assert len(picks) == 8 and all(task.demos[i].pool == ex.pool for i in picks)
    twins = {}
    for ex in task.examples:
        twins.setdefault((ex.pool[:-1], ex.contexts, ex.choices), set()).add(ex.gold)
    assert all(golds == {0, 1} for golds in twins.values())


def test_incontext_demonstrations_are_a_pool_disjoint_from_the_scored_items() -> None:
    """No prompt holds a scored item, nor the scored question: demonstrations come from the
    episodes' own lines about other words, and every line shown is right for the scored
    item's episode (never its twin's)."""
    task = load_task("incontext_probe")
    scored = set(task.examples)
    scored_sources = {ex.source for ex in task.examples}
    assert task.demos and not scored & set(task.demos)
    assert not scored_sources & {d.source for d in task.demos}
    # No scored item is repeated within its episode either (one per word).
    assert len({(ex.pool, ex.contexts) for ex in task.examples}) == len(task.examples)
    right = {ex.pool: ex.choices[ex.gold] for ex in task.examples}
    asked = {(ex.pool, ex.contexts[0]) for ex in task.examples}
    for k in (1, 8):
        for ex, picks in zip(
            task.examples, fewshot.draw(task, list(task.examples), k, 0), strict=True
        ):
            for i in picks:
                demo = task.demos[i]
                assert demo not in scored and demo.pool == ex.pool
                assert demo.contexts[0] != ex.contexts[0]  # never the scored question
                assert (ex.pool, demo.contexts[0]) not in asked  # nor another of its episode
                assert demo.choices[0] == right[ex.pool]


@pytest.mark.parametrize(
    ("arch", "objective"),
    [
        ("causal_decoder", "flm"),
        ("noncausal_decoder", "plm"),
        ("encoder_decoder", "plm"),
        ("causal_decoder", "mlm"),
        ("encoder_decoder", "mlm"),
    ],
)
def test_incontext_prompts_keep_within_training_rows(arch: str, objective: str) -> None:
    """At the smoke study's rows (96 + 32) the first 160 items span 80 episodes; no 8-shot
    prompt is longer than training's rows (no warning); each example's shots are recorded and
    summarised, fewer only where training's rows cannot hold all 8 (the span-corruption
    encoder's 96 positions), dropped from the front."""
    import warnings

    cfg = _smoke_rows(arch, objective)
    task = load_task("incontext_probe")
    vocab = get_vocabulary(cfg.data)
    assert len({ex.pool[:-1] for ex in rank.limit_examples(task, 160)}) == 80
    records: list[dict] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "longer than training" would be a warning
        out = rank.evaluate_task(
            task, _reader(vocab), vocab, cfg, max_examples=160, records=records, num_fewshot=8
        )
    name = "incontext_probe.8shot"
    assert out[f"{name}/longer_than_training"] == 0
    shots = [r["shots"] for r in records]
    assert len(shots) == 160 and out[f"{name}/shots"] == pytest.approx(np.mean(shots))
    assert out[f"{name}/fewshot_dropped"] == sum(s < 8 for s in shots)
    assert all(len(r["shown"]) == r["shots"] for r in records)
    if (arch, objective) == ("encoder_decoder", "mlm"):
        assert min(shots) >= 5 and np.mean(shots) < 8  # the encoder trained on 96 positions
    else:
        assert min(shots) == 8


def test_incontext_documents_join_the_corpus_only_when_asked() -> None:
    from scalestudy.config.experiment import SyntheticConfig
    from scalestudy.data import synthetic

    plain = synthetic.documents(SyntheticConfig(n_train_documents=200), "train")
    mixed = synthetic.documents(
        SyntheticConfig(n_train_documents=200, incontext_share=0.3), "train"
    )
    episodes = [i for i, (a, b) in enumerate(zip(plain, mixed, strict=True)) if a != b]
    assert 30 < len(episodes) < 90 and all(
        mixed[i] == plain[i] for i in range(200) if i not in episodes
    )
    for i in episodes:  # one colour for every made-up word of its document: the rule
        colour: dict[str, str] = {}
        for line in mixed[i].split("\n"):
            word, _, c = line.partition(" is ")
            assert colour.setdefault(word, c) == c
        assert len(set(colour.values())) == 1 and len(colour) > 4  # words met for the first time
    colours = {
        synthetic.incontext_episode(0, "train", i).split(" is ")[1].split("\n")[0]
        for i in range(40)
    }
    assert len(colours) > 3  # drawn anew per document


def test_a_registered_task_draws_demonstrations_from_the_named_split(shared_data: Path) -> None:
    """eval.fewshot_files: COPA's scored split (dev 401-500) with demonstrations from the
    released test file: K of its rows per example, none of them a scored one."""
    eval_dir = shared_data / "eval"
    demos_file = eval_dir / "copa" / "copa-test.jsonl"
    cfg = EvalConfig(
        tasks=["copa"], data_dir=str(eval_dir), fewshot_files={"copa": str(demos_file)}
    )
    (task,) = load_tasks(cfg)
    assert task.demos is not None and task.demos_source == str(demos_file)
    assert len(task.demos) > 100 and len(task.examples) == 100
    scored = {ex.source for ex in task.examples}
    prompts = _prompts(task, 3)
    for prompt, picks in zip(
        prompts, fewshot.draw(task, list(task.examples), 3, 1234), strict=True
    ):
        shown = [task.demos[i] for i in picks]
        assert all(d.source not in scored for d in shown)
        assert prompt.startswith(fewshot.demonstration(task, shown[0]) + "\n\n")
