"""The run as an lm-eval model: its scores equal `scalestudy eval`'s on the same task, rolling
log-likelihood equals the validation loss of the text, generation equals the package's greedy
decode, for all three architectures; bad input is one error line."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

# A local JSON task must never reach for the network.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-eval is not installed (pip install '.[lmeval]'; `make test` does)"
)

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from scalestudy.data.objectives import EOS_ID  # noqa: E402
from scalestudy.data.pipeline import make_iterator  # noqa: E402
from scalestudy.data.vocab import get_vocabulary  # noqa: E402
from scalestudy.evaluate import rank  # noqa: E402
from scalestudy.evaluate.harness_model import (  # noqa: E402
    START_TOKEN,
    ScalestudyLM,
    lm_eval_windows,
    rolling_windows,
)
from scalestudy.evaluate.results import examples_path  # noqa: E402
from scalestudy.models.api import build_model  # noqa: E402
from scalestudy.train.rundir import saved_run  # noqa: E402
from scalestudy.train.rundir.checkpoint import Checkpointer  # noqa: E402
from scalestudy.train.step import make_eval_step  # noqa: E402

from .tiny_models import tiny  # noqa: E402

ARCH_OBJECTIVE = {"causal_decoder": "flm", "noncausal_decoder": "plm", "encoder_decoder": "plm"}
ROWS = [
    {"query": "The sky is", "choices": ["blue.", "a green frog", "loud"], "gold": 0},
    {"query": "Two plus two is", "choices": ["four", "five"], "gold": 0},
    {"query": "Cats like to", "choices": ["sleep all day", "fly", "swim far away"], "gold": 0},
    {"query": "Water is", "choices": ["dry", "wet"], "gold": 1},
    {"query": "In winter it is", "choices": ["cold", "hot outside", "odd"], "gold": 0},
]
HARNESS_TASK = """\
task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
fewshot_split: test
output_type: multiple_choice
doc_to_text: "{{{{query}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
SCALESTUDY_TASK = """\
name: tiny_mc
path: {path}
context_field: query
choices_field: choices
label_field: gold
"""


def _save_run(workdir: Path, arch: str, seed: int, step: int = 5) -> Path:
    cfg = tiny(arch, ARCH_OBJECTIVE[arch])
    model = build_model(cfg.model)
    ckpt = Checkpointer(workdir / "checkpoints", async_save=False)
    params = model.init(jax.random.key(seed))
    ckpt.save(step, {"params": params, "step": np.int32(step)}, {"cursor": 0}, cfg)
    ckpt.close()
    return workdir


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("harness_runs")
    return {a: _save_run(root / a, a, seed) for seed, a in enumerate(ARCH_OBJECTIVE)}


@pytest.fixture(scope="module")
def models(runs) -> dict[str, ScalestudyLM]:
    return {a: ScalestudyLM(workdir=str(run)) for a, run in runs.items()}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("harness_tasks")
    data = folder / "tiny.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    # The harness reads every YAML file under its include path: its task has a folder alone.
    (folder / "harness").mkdir()
    (folder / "harness" / "tiny_mc.yaml").write_text(HARNESS_TASK.format(path=data))
    (folder / "tiny_mc.yaml").write_text(SCALESTUDY_TASK.format(path=data))
    return folder


# K > 0: the harness's task names its scored split as the few-shot split, so that it draws
# demonstrations as `scalestudy eval` does (K + 1, the scored example removed).
@pytest.mark.parametrize("num_fewshot", [0, 2])
@pytest.mark.parametrize("arch", list(ARCH_OBJECTIVE))
def test_harness_scores_equal_scalestudy_eval(arch, num_fewshot, runs, models, tasks) -> None:
    # K-shot prompts outgrow the tiny model's 32 training positions: the adapter would cut them
    # to max_length, as lm-eval does (tested below), where `scalestudy eval` keeps them whole.
    lm = models[arch] if num_fewshot == 0 else ScalestudyLM(workdir=str(runs[arch]), max_length=512)
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=["tiny_mc"],
        task_manager=TaskManager(include_path=str(tasks / "harness"), include_defaults=False),
        num_fewshot=num_fewshot,
        bootstrap_iters=0,
        log_samples=True,
    )
    harness = out["results"]["tiny_mc"]
    shots = [f"eval.num_fewshot={num_fewshot}"]
    ours = rank.evaluate_run(runs[arch], tasks=[str(tasks / "tiny_mc.yaml")], overrides=shots)
    name = "tiny_mc" if num_fewshot == 0 else f"tiny_mc.{num_fewshot}shot"
    assert ours[f"{name}/n"] == len(ROWS) and ours[f"{name}/truncated"] == 0
    assert harness["acc,none"] == ours[f"{name}/acc"]
    assert harness["acc_norm,none"] == ours[f"{name}/acc_norm"]
    # Per example and choice: the same log-likelihoods and greedy flags.
    records = [json.loads(x) for x in examples_path(runs[arch], 5, name).read_text().splitlines()]
    samples = sorted(out["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(records) == len(ROWS)
    for sample, record in zip(samples, records, strict=True):
        got = [(float(lp), bool(g)) for lp, g in (r[0] for r in sample["resps"])]
        want = [(c["logprob"], c["greedy"]) for c in record["choices"]]
        np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=1e-6)
        assert [g[1] for g in got] == [w[1] for w in want]
        assert sample["arguments"][0][0] == record["prompt"]  # the harness's own prompt
        assert record.get("shots", 0) == num_fewshot
    # The choices really differ: equal accuracies are not equal constants.
    assert len({round(c["logprob"], 3) for r in records for c in r["choices"]}) > 5


def _reference_rolling(arch: str, model, params, tokens: list[int], row: int) -> float:
    """Sum of log p(token) over hand-laid windows scored with Model.apply: the causal decoder
    reads each window's context and tokens in one row, the non-causal decoder with the
    context as its bidirectional prefix, the encoder-decoder with the context (or a lone EOS)
    in its encoder. Rows are padded to one length (padding is masked): one compile."""
    total = 0.0
    apply = jax.jit(model.apply)
    windows = rolling_windows(tokens, row, row if arch == "encoder_decoder" else None)
    width = row

    def padded(xs: list[int]) -> np.ndarray:
        return np.asarray([[*xs, *[0] * (width - len(xs))]], np.int32)

    for context, predicted in windows:
        if arch == "encoder_decoder":
            batch = {
                "encoder_input_tokens": padded(context or [EOS_ID]),
                "decoder_input_tokens": padded([0, *predicted[:-1]]),
                "decoder_target_tokens": padded(predicted),
            }
            first = 0
        else:
            full = context + predicted
            batch = {
                "decoder_input_tokens": padded([0, *full[:-1]]),
                "decoder_target_tokens": padded(full),
                "decoder_causal_attention": padded([1] * (len(context) + 1)),
            }
            first = len(context)
        logp = np.asarray(jax.nn.log_softmax(apply(params, batch), axis=-1))[0]
        total += sum(float(logp[first + j, t]) for j, t in enumerate(predicted))
    return total


def _request(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=tuple(args), idx=0)


def test_rolling_windows_predict_every_token_once() -> None:
    tokens = list(range(10, 80))
    for encoder in (None, 5):
        windows = rolling_windows(tokens, 16, encoder)
        assert [t for _, p in windows for t in p] == tokens
        start = 0
        for context, predicted in windows:
            assert context == tokens[max(0, start - len(context)) : start]
            assert len(context) + len(predicted) <= 16 if encoder is None else len(context) <= 5
            start += len(predicted)
        last_context, last = windows[-1]
        # Decoder-only: the last window's row is full (the most context); encoder: all of it.
        assert len(last_context) == (16 - len(last) if encoder is None else 5)
    assert rolling_windows([], 16) == []


def _lm_evals_windows(tokens: list[int], row: int) -> list[tuple[list[int], list[int]]]:
    """lm-eval's own rolling windows, as its causal models ask for them."""
    windows = get_rolling_token_windows(tokens, START_TOKEN, max_seq_len=row, context_len=1)
    return list(map(make_disjoint_window, windows))


@pytest.mark.parametrize("row", [1, 2, 5, 16, 32])
def test_lm_eval_windows_equal_lm_evals(row, models) -> None:
    for n in sorted({0, 1, max(row - 1, 0), row, row + 1, 3 * row + 2}):
        tokens = list(range(10, 10 + n))
        want = _lm_evals_windows(tokens, row)
        assert lm_eval_windows(tokens, row) == want, (row, n)
        # The model's own windows (the default rolling=lm_eval) in rows of its max_length.
        if row == 32:  # the tiny runs' training row
            for arch in ("causal_decoder", "noncausal_decoder"):
                assert models[arch].rolling == "lm_eval" and models[arch].max_length == row
                assert models[arch].windows(tokens) == want, (arch, n)


@pytest.mark.parametrize("row", [1, 2, 5, 16])
def test_lm_eval_windows_predict_every_token_once(row) -> None:
    for n in (1, row - 1, row, row + 1, 3 * row + 2, 70):
        tokens = list(range(10, 10 + n))
        windows = lm_eval_windows(tokens, row)
        if not n:
            assert windows == []
            continue
        assert [t for _, p in windows for t in p] == tokens
        # The first row: the start token and the first row - 1 tokens; each later row exactly
        # row text tokens (context, then the predicted but the last), in the text's order.
        context, predicted = windows[0]
        assert context == [START_TOKEN] and predicted == tokens[:row]
        start = len(predicted)
        for context, predicted in windows[1:]:
            assert len(context) + len(predicted) - 1 == row and START_TOKEN not in context
            assert context + predicted == tokens[start - len(context) : start + len(predicted)]
            start += len(predicted)


def _reference_lm_eval_rolling(arch: str, model, params, tokens: list[int], row: int) -> float:
    """Sum of log p(token) over lm-eval's own rolling rows (`get_rolling_token_windows`, its
    input rows as they are: the first `[start] + tokens[:row - 1]`, later ones `row` text
    tokens), the last len(predicted) positions' logits of each scored, as lm-eval scores
    them, through Model.apply; the non-causal decoder's prefix is each window's disjoint
    context (none in the first window)."""
    apply = jax.jit(model.apply)
    total = 0.0
    pairs = list(get_rolling_token_windows(tokens, START_TOKEN, max_seq_len=row, context_len=1))
    for w, (read, predicted) in enumerate(pairs):
        context, _ = make_disjoint_window((read, predicted))

        def padded(xs: list[int]) -> np.ndarray:
            return np.asarray([[*xs, *[0] * (row - len(xs))]], np.int32)

        batch = {
            "decoder_input_tokens": padded(read),
            "decoder_target_tokens": padded([*read[1:], predicted[-1]]),
            "decoder_segment_ids": padded([1] * len(read)),
            "decoder_positions": padded(list(range(len(read)))),
            "decoder_causal_attention": padded([1] * (len(context) if w else 0)),
        }
        logp = np.asarray(jax.nn.log_softmax(apply(params, batch), axis=-1))[0]
        first = len(read) - len(predicted)
        total += sum(float(logp[first + j, t]) for j, t in enumerate(predicted))
    return total


@pytest.mark.parametrize("arch", ["causal_decoder", "noncausal_decoder"])
def test_rolling_lm_eval_equals_direct_rows(arch, runs, models) -> None:
    lm = models[arch]
    _, params, _ = saved_run.restore_params(runs[arch])
    text = "The quick brown fox jumps over the lazy dog; " * 3
    tokens = lm.vocab.encode(text)
    row = lm.max_length
    assert len(tokens) > 2 * row + 1 and (len(tokens) - row) % row  # a short last window
    (got,) = lm.loglikelihood_rolling([_request("loglikelihood_rolling", text)])
    want = _reference_lm_eval_rolling(arch, lm.model, params, tokens, row)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5)
    # Not today's start-token windows: later rows differ (a sum that ignored the form of the
    # windows would equal both).
    old = _reference_rolling(arch, lm.model, params, tokens, row)
    assert abs(want - old) > 1e-3
    # Short texts (one window) and several texts in one call, each its own sum.
    short = "A small red hen."
    both = lm.loglikelihood_rolling(
        [_request("loglikelihood_rolling", short), _request("loglikelihood_rolling", text)]
    )
    want_short = _reference_lm_eval_rolling(arch, lm.model, params, lm.vocab.encode(short), row)
    assert both == pytest.approx([want_short, want], rel=1e-5, abs=1e-5)


def test_scorer_rows_without_start_token_need_a_context(models) -> None:
    from scalestudy.config.errors import ScalestudyError
    from scalestudy.evaluate.budget import fit_pairs

    for arch in ("causal_decoder", "encoder_decoder"):
        lm = models[arch]
        inputs = [[] if arch == "causal_decoder" else [5, 6]]
        fitted = fit_pairs(lm.cfg, inputs, [[7, 8]])
        with pytest.raises(ScalestudyError, match="rows without the start token"):
            lm.scorer.score(fitted, start_token=False)


@pytest.mark.parametrize("arch", list(ARCH_OBJECTIVE))
def test_rolling_equals_validation_loss_and_windows(arch, runs, models, tmp_path) -> None:
    # Today's windows of every row starting with the start token (rolling=start_token; the
    # encoder-decoder has windows of its own whatever the option).
    lm = models[arch]
    if arch != "encoder_decoder":
        lm = ScalestudyLM(workdir=str(runs[arch]), rolling="start_token")
        assert lm.rolling == "start_token"
    short = "A small red hen."  # fits one training row with its EOS
    long = "The quick brown fox jumps over the lazy dog; " * 3
    got_short, got_long = lm.loglikelihood_rolling(
        [_request("loglikelihood_rolling", short), _request("loglikelihood_rolling", long)]
    )
    # The validation loss of the short text: the training pipeline's validation row of a
    # full-LM run on it (the text as target, no prefix), its EOS's loss left out. The
    # encoder-decoder reads it with the empty input a lone EOS stands for.
    (tmp_path / "val.txt").write_text(short)
    cfg = tiny("causal_decoder", "flm").model_dump(mode="json")
    cfg["data"] |= {"source": "text", "paths": [str(tmp_path / "val.txt")], "split_by": "file"}
    cfg["data"]["validation_paths"] = [str(tmp_path / "val.txt")]
    cfg["objective"] |= {"pieces": "per_document", "pack": False}
    cfg["train"] = {**cfg.get("train", {}), "batch_size": 1}
    from scalestudy.config.experiment import ExperimentConfig

    batch = next(make_iterator(ExperimentConfig.model_validate(cfg), "validation"))
    batch = {k: np.asarray(v) for k, v in batch.items()}
    assert (batch["decoder_target_tokens"] == EOS_ID).sum() == 1
    batch["decoder_loss_weights"] = batch["decoder_loss_weights"] * (
        batch["decoder_target_tokens"] != EOS_ID
    )
    if arch == "encoder_decoder":
        batch["encoder_input_tokens"] = np.asarray([[EOS_ID]], np.int32)
        batch["encoder_segment_ids"] = np.ones((1, 1), np.int32)
        batch["encoder_positions"] = np.zeros((1, 1), np.int32)
    run_cfg, params, _ = saved_run.restore_params(runs[arch])
    sums = jax.jit(make_eval_step(run_cfg, lm.model))(params, batch)
    n_tokens = len(get_vocabulary(run_cfg.data).encode(short))
    assert int(sums["tokens"]) == n_tokens
    assert got_short == pytest.approx(-float(sums["ce"]), rel=1e-5)
    # The long text spans several windows of the training length, each scored on its own.
    tokens = lm.vocab.encode(long)
    row = lm.decoder_length if arch == "encoder_decoder" else lm.max_length
    assert len(tokens) > 2 * row
    want = _reference_rolling(arch, lm.model, params, tokens, row)
    assert got_long == pytest.approx(want, rel=1e-5)
    # lm-eval's windows (the default) begin alike: a text of one window scores the same.
    (default_short,) = models[arch].loglikelihood_rolling(
        [_request("loglikelihood_rolling", short)]
    )
    assert default_short == pytest.approx(got_short, rel=1e-6)


@pytest.mark.parametrize("arch", list(ARCH_OBJECTIVE))
def test_generate_until_equals_greedy_decode(arch, models) -> None:
    lm = models[arch]
    prompts = ["Once upon a time", "Long ago, a"]  # two lengths, padded into one call
    steps = 12
    generate = jax.jit(lm.model.generate, static_argnums=2)
    out = [  # each prompt alone, unpadded
        np.asarray(generate(lm.scorer.params, np.asarray([lm.vocab.encode(p)], np.int32), steps))[0]
        for p in prompts
    ]
    want = [lm.vocab.decode(row.tolist()) for row in out]
    assert any(len(w) > 3 for w in want), want  # something to cut
    # No EOS among them: a max_gen_toks ignored (256 by default) would give longer texts.
    assert EOS_ID not in np.asarray(out).ravel()
    asked = {"until": [], "max_gen_toks": steps}
    assert lm.generate_until([_request("generate_until", p, asked) for p in prompts]) == want
    # A stop string cuts the text before its first occurrence (the earliest of several).
    text = max(want, key=len)
    prompt = prompts[want.index(text)]
    stop = text[2:4]
    asked = {"until": ["\x00never", stop], "max_gen_toks": steps}
    assert lm.generate_until([_request("generate_until", prompt, asked)]) == [
        text[: text.find(stop)]
    ]


class LocalTasks(TaskManager):
    """lm-eval's task index of the include path alone: its thousands of built-in task files
    take seconds to index and are not under test."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **{**kwargs, "include_defaults": False})


def test_cli_runs_a_local_task_offline(runs, models, tasks, tmp_path, monkeypatch, capsys):
    from scalestudy.cli.main import main

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalTasks)
    run, out = runs["causal_decoder"], tmp_path / "out"
    argv = ["harness", "--model", "scalestudy", "--tasks", "tiny_mc", "--include_path",
            str(tasks / "harness"), "--output_path", str(out), "--log_samples"]  # fmt: skip
    assert main([*argv, "--model_args", f"workdir={run},batch_size=4"]) == 0
    assert "tiny_mc" in capsys.readouterr().out
    (results,) = out.rglob("results_*.json")
    acc = json.loads(results.read_text())["results"]["tiny_mc"]["acc,none"]
    samples = [
        json.loads(x) for f in out.rglob("samples_*.jsonl") for x in f.read_text().split("\n") if x
    ]
    assert len(samples) == len(ROWS)
    hits = []
    for sample in samples:  # the command scored what the model object scores
        pairs = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
        requests = [_request("loglikelihood", *pair) for pair in pairs]
        want = [lp for lp, _ in models["causal_decoder"].loglikelihood(requests)]
        got = [float(r[0][0]) for r in sample["resps"]]
        np.testing.assert_allclose(got, want, rtol=1e-6)
        hits.append(int(np.argmax(got)) == sample["doc"]["gold"])
    assert acc == np.mean(hits)
    # An empty continuation has log-likelihood 0 and changes nothing beside it.
    lm = models["causal_decoder"]
    alone = lm.loglikelihood([_request("loglikelihood", "The sky is", " blue.")])
    both = lm.loglikelihood(
        [
            _request("loglikelihood", "The sky is", ""),
            _request("loglikelihood", "The sky is", " blue."),
        ]
    )
    assert both[0] == (0.0, True) and both[1][1] == alone[0][1]
    assert both[1][0] == pytest.approx(alone[0][0], rel=1e-6)
    # Bad model args: one error line, exit status 2.
    for model_args, says in (
        (f"workdir={run},pretrained=gpt2", "unknown key 'pretrained'; accepted: workdir"),
        (f"workdir={tmp_path}", "no checkpoint in"),
        (f"workdir={run},step=9", "no checkpoint for step 9"),
    ):
        assert main([*argv, "--model_args", model_args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error: ") and says in err[-1], err[-1]
        assert not any("Traceback" in line for line in err)


def test_bad_model_args(runs, tmp_path) -> None:
    from scalestudy.config.errors import ScalestudyError

    with pytest.raises(ScalestudyError, match="workdir is required"):
        ScalestudyLM()
    with pytest.raises(ScalestudyError, match="run directory not found"):
        ScalestudyLM(workdir=str(tmp_path / "absent"))
    with pytest.raises(ScalestudyError, match="no checkpoint in"):
        ScalestudyLM(workdir=str(tmp_path))
    with pytest.raises(ScalestudyError, match=r"unknown key 'pretrained'; accepted: workdir"):
        ScalestudyLM(workdir=str(runs["causal_decoder"]), pretrained="gpt2")
    with pytest.raises(ScalestudyError, match=r"batch_size='x'; accepted"):
        ScalestudyLM(workdir=str(runs["causal_decoder"]), batch_size="x")
    with pytest.raises(
        ScalestudyError, match=r"^model_args: rolling='harness'; accepted: lm_eval, start_token$"
    ):
        ScalestudyLM(workdir=str(runs["causal_decoder"]), rolling="harness")
    with pytest.raises(ScalestudyError, match=r"max_length=1 leaves no room.*accepted: 2 or more"):
        ScalestudyLM(workdir=str(runs["causal_decoder"]), max_length=1)
    # lm-eval always passes its --batch_size (1 by default): an explicit eval.batch_size wins.
    lm = ScalestudyLM(workdir=str(runs["causal_decoder"]), batch_size=1, **{"eval.batch_size": 24})
    assert lm.scorer.rows == 24 and lm.run_cfg.eval.batch_size == 24


CHILD = textwrap.dedent(
    """
    import sys
    sys.modules["lm_eval"] = None
    from scalestudy.cli.main import main
    sys.exit(main(["harness", "--model", "scalestudy", "--model_args", "workdir=x",
                   "--tasks", "tiny_mc"]))
    """
)


def test_without_lm_eval_one_error_line() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2])])}
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=120
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error:"), done.stderr
    assert "lm-eval" in lines[0] and "scalestudy[lmeval]" in lines[0]


@pytest.mark.parametrize("arch", ["causal_decoder", "encoder_decoder"])
def test_loglikelihood_tokenises_and_cuts_as_lm_eval(arch, models) -> None:
    lm = models[arch]
    ll = lambda *pairs: lm.loglikelihood([_request("loglikelihood", c, t) for c, t in pairs])
    # The context's trailing space is read as the continuation's first token, as lm-eval does.
    (moved,), (given,) = ll(("The sky is ", "blue.")), ll(("The sky is", " blue."))
    assert moved[0] == pytest.approx(given[0], rel=1e-6) and moved[1] == given[1]
    # A context longer than max_length keeps what fits beside the continuation (decoders) or
    # in the encoder, cut from the left; a cut is counted in a warning.
    long = "The quick brown fox jumps over the lazy dog; " * 3 + "and the sky is"
    target = " blue."
    n_tgt = len(lm.vocab.encode(target))
    keep = lm.max_length - (0 if lm.encoder_length else n_tgt)
    assert len(lm.vocab.encode(long)) > keep
    with pytest.warns(
        UserWarning, match=f"1 of 1 contexts cut from the left to fit max_length={lm.max_length}"
    ):
        (cut,) = ll((long, target))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the kept context alone: no cut, nothing past training
        (kept,) = ll((long[-keep:], target))
    assert not [w for w in caught if "cut" in str(w.message) or "training" in str(w.message)]
    assert cut[0] == pytest.approx(kept[0], rel=1e-6) and cut[1] == kept[1]
    # One token less of context changes the score: the cut is exactly there, not shorter.
    (shorter,) = ll((long[-keep + 1 :], target))
    assert shorter[0] != pytest.approx(kept[0], rel=1e-6)


def test_generate_until_prompt_keeps_half_the_row(models) -> None:
    lm = models["causal_decoder"]
    long = "Once upon a time there was a small red hen who lived on a farm. " * 2
    steps = lm.max_length + 8  # more than the row: the prompt still keeps half of it
    keep = lm.max_length // 2
    assert len(lm.vocab.encode(long)) > keep
    generate = jax.jit(lm.model.generate, static_argnums=2)
    prompt = np.asarray([lm.vocab.encode(long)[-keep:]], np.int32)
    want = lm.vocab.decode(np.asarray(generate(lm.scorer.params, prompt, steps))[0].tolist())
    asked = {"until": [], "max_gen_toks": steps}
    with pytest.warns(UserWarning, match="1 of 1 prompts cut from the left"):
        got = lm.generate_until([_request("generate_until", long, asked)])
    assert got == [want]


def test_no_checkpoint_log_noise(runs, caplog) -> None:
    """Restoring a run logs orbax's read-only warnings through absl; the adapter keeps them
    from a harness run's output."""
    caplog.set_level(logging.WARNING, logger="absl")
    rank.load_run(runs["causal_decoder"], None, [])
    assert "read only" in caplog.text  # the noise is there without the adapter's guard
    caplog.clear()
    ScalestudyLM(workdir=str(runs["causal_decoder"]))
    assert "read only" not in caplog.text and logging.getLogger("absl").level == logging.WARNING


def test_lm_eval_own_command_line_points_to_scalestudy_harness() -> None:
    """lm-eval 0.4.x reads no model plugins: its own command line cannot find the model, and
    the evaluation page says to use `scalestudy harness`."""
    from lm_eval.api import registry

    if hasattr(registry, "load_plugins") or "entry_points(" in Path(registry.__file__).read_text():
        pytest.skip("this lm-eval reads plugins: see docs/evaluation.md")
    # A fresh process, as `lm_eval --model scalestudy` starts: lm-eval alone does not find it.
    probe = "from lm_eval.api.registry import get_model; get_model('scalestudy')"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0 and "no model for this name found" in done.stderr
    page = (Path(__file__).parents[2] / "docs" / "evaluation.md").read_text()
    assert "lm_eval --model scalestudy" in page and "Use `scalestudy harness`" in page
