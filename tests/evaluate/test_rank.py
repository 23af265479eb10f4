"""Rank classification: scores equal hand-computed log-probabilities for every architecture,
metric definitions, truncation, run directories."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

from scalestudy.config.errors import ConfigError, ScalestudyError
from scalestudy.config.experiment import ExperimentConfig
from scalestudy.data.objectives import feature_lengths
from scalestudy.data.vocab import get_vocabulary
from scalestudy.evaluate import rank
from scalestudy.evaluate.prompts import Example
from scalestudy.evaluate.results import examples_path
from scalestudy.evaluate.tasks import Task, load_task
from scalestudy.models.api import build_model

from .tiny_models import reference_logprob
from .tiny_models import tiny as tiny_model

DEFAULT = ExperimentConfig()
ARCH_OBJECTIVE = {"causal_decoder": "flm", "noncausal_decoder": "plm", "encoder_decoder": "plm"}


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def tiny(arch: str, **eval_cfg) -> ExperimentConfig:
    return tiny_model(arch, ARCH_OBJECTIVE[arch], **eval_cfg)


@pytest.fixture(scope="module", params=list(ARCH_OBJECTIVE))
def built(request):
    cfg = tiny(request.param)
    model = build_model(cfg.model)
    params = model.init(jax.random.key(1))
    return cfg, model, params, rank.Scorer(cfg, model, params)


def test_score_equals_logprob_from_logits(built) -> None:
    cfg, model, params, scorer = built
    vocab = get_vocabulary(cfg.data)
    pairs = [
        ("The cat sat on", " a mat."),
        ("Once upon a ti", " me, a "),
        ("A b c d e f g ", "h i j k"),
    ]
    inputs = [vocab.encode(c) for c, _ in pairs]
    targets = [vocab.encode(t) for _, t in pairs]
    lp, n_tok, _, truncated = scorer(inputs, targets, np.arange(len(pairs)))
    assert truncated == 0
    np.testing.assert_array_equal(n_tok, [len(t) for t in targets])  # no EOS, no context token
    expected = reference_logprob(cfg, model, params, inputs, targets)
    np.testing.assert_allclose(lp, expected, rtol=1e-4, atol=1e-4)
    assert len(set(np.round(lp, 3))) == 3  # the rows really differ
    if cfg.model.arch == "noncausal_decoder":  # the prefix is really bidirectional
        causal = cfg.replace(model={**cfg.model.model_dump(), "arch": "causal_decoder"})
        other = reference_logprob(causal, build_model(causal.model), params, inputs, targets)
        assert np.all(np.abs(other - expected) > 1e-4)


def test_encoder_decoder_encodes_each_context_once_with_equal_scores() -> None:
    from scalestudy.data.pipeline import scoring_batch

    cfg = tiny("encoder_decoder", batch_size=32)
    model = build_model(cfg.model)
    params = model.init(jax.random.key(2))
    scorer = rank.Scorer(cfg, model, params)
    # 3 examples x 4 choices, and one example whose two choices change the context
    # (partial scoring): 4 distinct contexts among 14 pairs.
    contexts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    inputs = [c for c in contexts for _ in range(4)] + [[20, 21], [22, 21]]
    targets = [[30 + i, 40 + i % 3] for i in range(12)] + [[50], [50]]
    owner = np.repeat(np.arange(4), [4, 4, 4, 2])
    full, _ = scoring_batch(scorer.cfg, inputs, targets)
    sent = scorer._distinct_contexts(full)
    assert len(sent["encoder_input_tokens"]) == 8 < len(inputs)  # 4 distinct, padded to 8
    np.testing.assert_array_equal(
        sent["encoder_input_tokens"][sent["pair_context"]], full["encoder_input_tokens"]
    )
    # A call of one context (64 rows) takes a quarter of its rows (the shape of a 4-choice task's
    # calls), not a shape of its own.
    one, _ = scoring_batch(scorer.cfg, [contexts[0]] * 64, [[30]] * 64)
    assert len(scorer._distinct_contexts(one)["encoder_input_tokens"]) == max(16, scorer.shards)
    lp, n_tok, correct, _ = scorer(inputs, targets, owner)
    # The per-pair path: every pair encodes its own copy of its context.
    reference = jax.device_get(jax.jit(model.score)(params, full))
    np.testing.assert_allclose(lp, reference["logprob"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(n_tok, reference["n_tokens"])
    np.testing.assert_array_equal(correct, reference["all_correct"])


def test_left_truncation_keeps_the_end_and_is_counted(built) -> None:
    cfg, model, params, _ = built
    scorer = rank.Scorer(cfg.replace(eval=cfg.eval.replace(inputs_length=24)), model, params)
    long_ctx = list(range(10, 10 + 24 + 7))
    lp, _, _, truncated = scorer([long_ctx, long_ctx[-24:]], [[5, 6, 7]] * 2, np.arange(2))
    assert truncated == 1
    np.testing.assert_allclose(lp[0], lp[1], rtol=1e-5)
    # Pairs of one example count once.
    assert scorer([long_ctx, long_ctx], [[5], [6]], np.zeros(2, int))[3] == 1


def test_untrained_model_is_near_chance(shared_data: Path, built) -> None:
    cfg, model, params, scorer = built
    if cfg.model.arch != "causal_decoder":
        pytest.skip("one architecture suffices")
    task = load_task("hellaswag", shared_data / "eval")
    out = rank.evaluate_params(cfg, model, params, tasks=[task], max_examples=96, scorer=scorer)
    assert out["hellaswag/n"] == 96 and out["hellaswag/chance"] == 0.25  # 4 endings each
    assert 0.1 <= out["hellaswag/acc"] <= 0.45  # chance: 0.25; binomial sd 0.044
    assert out["hellaswag/truncated"] == 0  # rows sized from the task: nothing cut


def fake_score(per_token: float):
    """A scorer whose sum is `per_token` times the target length: > 0 prefers long choices."""

    def score(fitted):
        n = np.array([len(t) for t in fitted.targets])
        return per_token * n.astype(float), n, np.zeros(len(n), bool)

    return score


def test_acc_and_acc_norm_definitions(shared_data: Path) -> None:
    vocab = get_vocabulary(ExperimentConfig().data)
    task = load_task("arc_easy", shared_data / "eval")
    examples = task.examples[:300]
    nbytes = [np.array([len((" " + c).encode()) for c in e.choices]) for e in examples]
    chars = [np.array([len(c) for c in e.choices]) for e in examples]
    gold = np.array([e.gold for e in examples])
    longest = np.mean([np.argmax(b) for b in nbytes] == gold)  # ties: the first wins
    shortest = np.mean([np.argmax(b / c) for b, c in zip(nbytes, chars)] == gold)
    # Sum = +bytes: acc picks the longest choice; per character (~1 + 1/chars) the shortest.
    out = rank.evaluate_task(task, fake_score(1.0), vocab, DEFAULT, max_examples=300)
    assert (out["arc_easy/acc"], out["arc_easy/acc_norm"]) == (longest, shortest)
    assert longest != shortest
    # A model paying 2 nats per byte: acc prefers short choices, acc_norm long ones.
    out = rank.evaluate_task(task, fake_score(-2.0), vocab, DEFAULT, max_examples=300)
    assert out["arc_easy/acc"] == np.mean([np.argmin(b) for b in nbytes] == gold)
    assert out["arc_easy/acc_norm"] == np.mean(
        [np.argmin(b / c) for b, c in zip(nbytes, chars)] == gold
    )
    # Task loss is per byte: a model paying 2 nats on every byte has task loss 2, whatever
    # the answers' lengths.
    assert out["arc_easy/task_loss"] == pytest.approx(2.0)


def test_task_loss_is_the_gold_nll_per_byte_of_the_example_files(built, tmp_path: Path) -> None:
    from scalestudy.evaluate.results import write_examples
    from scalestudy.scaling.task_law import task_loss_from_examples

    cfg, model, params, scorer = built
    task = load_task("synthetic_probes")
    records: dict[str, list[dict]] = {}
    out = rank.evaluate_params(
        cfg, model, params, tasks=[task], max_examples=6, scorer=scorer, records=records
    )
    write_examples(tmp_path, 3, records)
    rows = _read_jsonl(examples_path(tmp_path, 3, "synthetic_probes"))
    golds = [r["choices"][r["gold"]] for r in rows]
    per_byte = np.array(
        [-g["logprob"] / len((task.delimiter + g["text"]).encode("utf-8")) for g in golds]
    )
    assert out["synthetic_probes/task_loss"] == pytest.approx(per_byte.mean(), rel=1e-12)
    assert out["synthetic_probes/task_loss"] == pytest.approx(
        task_loss_from_examples([g["logprob"] for g in golds], [g["bytes"] for g in golds])
    )
    groups = sorted({r["group"] for r in rows})
    assert len(groups) == 5
    for g in groups:
        mine = per_byte[[r["group"] == g for r in rows]]
        assert out[f"synthetic_probes/{g}/task_loss"] == pytest.approx(mine.mean(), rel=1e-12)
    # An untrained model pays about log(vocab) nats per byte on the answer.
    assert (
        0.5 * math.log(cfg.model.vocab_size) < per_byte.mean() < 2 * math.log(cfg.model.vocab_size)
    )


def test_last_word_and_text_metrics(tmp_path: Path) -> None:
    vocab = get_vocabulary(ExperimentConfig().data)
    task = Task("lw", "last_word", (Example(("a",), ("bc",)), Example(("d",), ("efgh",))), "t")

    def score(fitted):
        return np.array([-1.0, -3.0]), np.array([3, 5]), np.array([True, False])

    out = rank.evaluate_task(task, score, vocab, DEFAULT)
    assert out["lw/acc"] == 0.5
    assert out["lw/ppl"] == pytest.approx(math.exp(2.0))  # exp(-mean per-example loglik)
    assert out["lw/ppl_token"] == pytest.approx(math.exp(4.0 / 8))
    # The delimiter's byte is scored too: " bc" is 3 bytes, " efgh" 5.
    assert out["lw/task_loss"] == pytest.approx((1.0 / 3 + 3.0 / 5) / 2)
    text = tmp_path / "t.txt"
    text.write_text("hello world, " * 20)
    windows = ExperimentConfig(eval={"inputs_length": 8, "targets_length": 16})
    out = rank.evaluate_task(load_task(f"text:{text}"), fake_score(-0.5), vocab, windows)
    assert out["text/tokens"] == len("hello world, " * 20) - 1  # first byte is context only
    assert out["text/loss"] == pytest.approx(0.5)
    assert out["text/bpb"] == pytest.approx(0.5 / math.log(2))  # bytes == tokens here


def test_evaluate_params_end_to_end(built, shared_data: Path, tmp_path: Path) -> None:
    cfg, model, params, scorer = built
    eval_dir = shared_data / "eval"
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    out = rank.evaluate_params(
        cfg,
        model,
        params,
        tasks=["copa", "winogrande", "lambada", f"text:{text}", "synthetic_probes"],
        data_dir=str(eval_dir),
        max_examples=8,
        scorer=scorer,
    )
    assert out["copa/n"] == 8 and 0 <= out["copa/acc"] <= 1 and out["copa/chance"] == 0.5
    assert out["winogrande/acc"] == out["winogrande/acc_norm"]  # same continuation
    assert out["lambada/ppl"] > 1 and 0 <= out["lambada/acc"] <= 1
    assert out["text/bpb"] == pytest.approx(out["text/loss"] / math.log(2))
    assert "synthetic_probes/pronoun/acc" in out
    assert all(np.isfinite(v) for v in out.values())


def test_rows_longer_than_training_are_counted_and_said_once(built, shared_data: Path):
    """COPA's contexts and choices at the default scoring lengths exceed these models' 24 + 8
    training rows: counted per task with the longest row, one warning per task and process
    (not per call), and each example's record says whether it was one of them."""
    cfg, model, params, scorer = built
    enc, dec = feature_lengths(cfg.objective, cfg.model.is_encoder_decoder)
    rank.BEYOND_TRAINING_SAID.clear()  # another test's evaluation of copa may have said it
    records: dict[str, list[dict]] = {}
    kwargs = dict(tasks=["copa"], data_dir=str(shared_data / "eval"), max_examples=16)
    with pytest.warns(UserWarning, match=r"copa: \d+ of 16 examples .* longer than training"):
        out = rank.evaluate_params(cfg, model, params, scorer=scorer, records=records, **kwargs)
    with warnings.catch_warnings():  # resets Python's own once-registry; still not said again
        warnings.simplefilter("error")
        again = rank.evaluate_params(cfg, model, params, scorer=scorer, **kwargs)
    assert again["copa/longer_than_training"] == out["copa/longer_than_training"]
    rows = records["copa"]
    if enc:  # the encoder reads the context (and the input form's EOS, if any)
        suffix = out["copa/longest"] - max(max(r["context_kept"]) for r in rows)
        assert suffix in (0, 1)
        lengths = [max(r["context_kept"]) + suffix for r in rows]
        trained = enc
    else:
        lengths = [
            max(k + c["tokens"] for k, c in zip(r["context_kept"], r["choices"])) for r in rows
        ]
        trained = dec
    assert out["copa/longest"] == max(lengths) > trained
    assert out["copa/longer_than_training"] == sum(n > trained for n in lengths) > 0
    assert [r["longer_than_training"] for r in rows] == [n > trained for n in lengths]


def test_eval_fn_scores_the_params_it_is_given() -> None:
    cfg = tiny("causal_decoder", tasks=["synthetic_probes"], max_examples=4)
    model = build_model(cfg.model)
    eval_fn = rank.make_eval_fn(cfg)
    first = eval_fn(model, model.init(jax.random.key(0)), 1)
    second = eval_fn(model, model.init(jax.random.key(1)), 2)
    assert first.keys() == second.keys() and first != second


def test_run_directory(tmp_path: Path) -> None:
    from scalestudy.cli.main import main
    from scalestudy.train.rundir.checkpoint import Checkpointer

    with pytest.raises(ScalestudyError, match=r"no checkpoint in .*train first"):
        rank.evaluate_run(tmp_path)
    assert main(["eval", "--workdir", str(tmp_path / "absent")]) == 2
    cfg = tiny("encoder_decoder", tasks=["synthetic_probes"], max_examples=4)
    model = build_model(cfg.model)
    ckpt = Checkpointer(tmp_path / "checkpoints", async_save=False)
    ckpt.save(7, {"params": model.init(jax.random.key(0)), "step": np.int32(7)}, {"cursor": 0}, cfg)
    ckpt.close()
    (tmp_path / "summary.json").write_text(json.dumps({"name": "run", "steps": 7}))
    out = rank.evaluate_run(tmp_path)
    assert out["step"] == 7 and "synthetic_probes/acc" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (
        summary["steps"] == 7
        and summary["eval"]["synthetic_probes/acc"] == out["synthetic_probes/acc"]
    )
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert line["step"] == 7 and "eval/synthetic_probes/n" in line
    # Per-example scores beside the aggregates, and they agree with them.
    records = _read_jsonl(examples_path(tmp_path, 7, "synthetic_probes"))
    assert len(records) == out["synthetic_probes/n"] and out["synthetic_probes/truncated"] == 0
    assert np.mean([r["pred"] == r["gold"] for r in records]) == out["synthetic_probes/acc"]
    # Each row names its example in the source and holds the text the model read.
    from scalestudy.data.synthetic import probe_tasks

    probes = probe_tasks(cfg.data.synthetic)
    for r in records:
        group, index = r["source"].rstrip("]").split("[")
        assert r["group"] == group and r["prompt"] == probes[group][int(index)]["context"]

    # The stored settings changed without retraining: a context budget of 4 tokens, from
    # the CLI (an override given after --tasks is an override, not a task name).
    argv = ["eval", "--workdir", str(tmp_path), "--tasks", "synthetic_probes"]
    assert main([*argv, "eval.inputs_length=4", "eval.targets_length=2"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["eval_config"]["inputs_length"] == 4
    cut = summary["eval"]["synthetic_probes/truncated"]
    records = _read_jsonl(examples_path(tmp_path, 7, "synthetic_probes"))
    assert cut == sum(r["truncated"] for r in records) == len(records)
    assert all(max(r["context_kept"]) == 4 < min(r["context_tokens"]) for r in records)
    with pytest.raises(ConfigError, match="accepts only eval"):
        rank.evaluate_run(tmp_path, overrides=["model.d_model=64"])
    assert main([*argv, "model.d_model=64"]) == 2

    # Each evaluation says how it was made: the tasks and limits actually used, a settings key
    # in every metrics row, and per-example files of other settings kept, not overwritten.
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first, second = (r["eval_settings"] for r in rows[-2:])
    assert first != second and set(summary["eval_configs"]) == {first, second}
    folder = examples_path(tmp_path, 7, "synthetic_probes").parent
    kept = folder / f"synthetic_probes.{first}.jsonl"
    assert len(_read_jsonl(kept)) == out["synthetic_probes/n"]  # the first evaluation's rows
    index = json.loads((folder / "settings.json").read_text())
    assert index["synthetic_probes"]["key"] == second
    rank.evaluate_run(tmp_path, tasks=["synthetic_probes"], max_examples=3)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["eval_config"]["tasks"] == ["synthetic_probes"]
    assert summary["eval_config"]["max_examples"] == 3
    assert kept.is_file() and (folder / f"synthetic_probes.{second}.jsonl").is_file()


@pytest.mark.slow  # trains a tiny run on a (2,2,2) mesh: about 19 s at load 7.6
def test_run_directory_is_evaluated_on_the_runs_mesh(tmp_path: Path, monkeypatch) -> None:
    from scalestudy.config.experiment import load_config
    from scalestudy.train import loop, sharding
    from scalestudy.train.rundir import saved_run

    cfg = load_config(
        None,
        [
            "model.d_model=32",
            "model.d_ff=64",
            "model.n_heads=2",
            "model.n_layers=2",
            "model.rel_max_distance=32",
            "objective.inputs_length=24",
            "objective.targets_length=8",
            "data.synthetic.n_train_documents=100",
            "data.synthetic.n_validation_documents=20",
            "train.batch_size=8",
            "train.steps=2",
            "train.eval_batches=1",
            "train.progress=false",
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.tensor=2",
            "eval.tasks=[synthetic_probes]",
            "eval.max_examples=8",
            "eval.batch_size=8",
        ],
    )
    loop.train(cfg, tmp_path)
    mesh = sharding.make_mesh(cfg.mesh, model=cfg.model)
    model = build_model(cfg.model)
    trained_shardings = sharding.param_shardings(mesh, model.param_axes())  # as the train step

    # The path before: parameters on one device, then scored.
    _, one_device, _ = saved_run.restore_params(tmp_path)
    assert all(len(a.sharding.device_set) == 1 for a in jax.tree.leaves(one_device))
    reference = rank.evaluate_params(cfg, model, one_device)

    seen = {}
    real = rank.evaluate_params

    def spy(cfg, model, params, **kw):
        seen["params"], seen["mesh"] = params, kw.get("mesh")
        return real(cfg, model, params, **kw)

    monkeypatch.setattr(rank, "evaluate_params", spy)
    out = rank.evaluate_run(tmp_path)
    restored = jax.tree.leaves(seen["params"])
    assert [a.sharding for a in restored] == jax.tree.leaves(trained_shardings)
    assert any(
        len(a.addressable_shards) == 8 and a.sharding.shard_shape(a.shape) != a.shape
        for a in restored
    )  # split, not one device or copies
    assert seen["mesh"] == mesh
    out.pop("step")
    assert out.keys() == reference.keys() and out["synthetic_probes/n"] > 0
    assert out == pytest.approx(reference, rel=1e-6)
    for key in (k for k in out if k.endswith("acc")):
        assert out[key] == reference[key]


def test_eval_keeps_the_libraries_notes_in_the_runs_log(tmp_path: Path, capfd) -> None:
    from scalestudy.cli.main import main
    from scalestudy.train.rundir.checkpoint import Checkpointer

    cfg = tiny("causal_decoder", tasks=["synthetic_probes"], max_examples=2)
    model = build_model(cfg.model)
    ckpt = Checkpointer(tmp_path / "checkpoints", async_save=False)
    ckpt.save(3, {"params": model.init(jax.random.key(0)), "step": np.int32(3)}, {"cursor": 0}, cfg)
    ckpt.close()
    capfd.readouterr()
    for command in (["eval"], ["attention-rank"]):  # each: notes to the log, none shown
        (tmp_path / "train.log").unlink(missing_ok=True)
        assert main([*command, "--workdir", str(tmp_path)]) == 0
        err = capfd.readouterr().err
        assert "absl" not in err and "read only" not in err, (command, err)
        assert "read only" in (tmp_path / "train.log").read_text()  # orbax's note, kept
