"""Rank classification with Model.score: one code path for all three architectures.

Every task becomes (context, continuation) token pairs (`pairs.py`), cut to the context
budget with rows sized to hold every continuation whole (`budget.py`), scored in fixed-shape
batches (`scorer.py`), summarised per task (`metrics.py`) and per example (`records.py`); a
run directory's results are written by `results.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

from scalestudy.config.errors import ConfigError, ScalestudyError, not_found
from scalestudy.config.experiment import ExperimentConfig
from scalestudy.config.yamlio import apply_overrides, validate
from scalestudy.data.objectives import (
    feature_lengths,
    scores_zero_shot,
    scoring_inputs_suffix,
    scoring_targets_prefix,
)
from scalestudy.data.pipeline import encode_scoring_pair
from scalestudy.data.vocab import get_vocabulary
from scalestudy.evaluate import fewshot
from scalestudy.evaluate.budget import Fitted, context_budget, fit_pairs, text_lengths
from scalestudy.evaluate.examples import Task
from scalestudy.evaluate.metrics import (
    Scored,
    choice_metrics,
    last_word_metrics,
    task_loss_metrics,
    text_metrics,
)
from scalestudy.evaluate.pairs import limit_examples, text_windows, tokenize_pairs
from scalestudy.evaluate.records import example_records, window_records
from scalestudy.evaluate.results import print_task_lines, write_examples, write_results
from scalestudy.evaluate.scorer import ScoreFn, Scorer, scoring_config
from scalestudy.evaluate.tasks import load_tasks
from scalestudy.models.api import build_model
from scalestudy.train.rundir import layout as rundir
from scalestudy.train.rundir import saved_run

__all__ = [
    "Scorer",
    "evaluate_params",
    "evaluate_run",
    "evaluate_task",
    "limit_examples",
    "load_run",
    "make_eval_fn",
    "scoring_config",
]


@dataclasses.dataclass
class _Prepared:
    """One task (at one number of demonstrations) made into pairs, before scoring."""

    task: Task
    num_fewshot: int
    examples: list | None  # None for held-out text
    shots: list | None
    inputs: list
    targets: list
    owner: np.ndarray
    fitted: Fitted


def _prepare(task: Task, vocab, cfg: ExperimentConfig, max_examples, num_fewshot) -> _Prepared:
    shots = examples = None
    if num_fewshot:
        if task.kind == "text":
            raise ValueError(f"task {task.name!r} is held-out text: it has no few-shot form")
        task = dataclasses.replace(task, name=fewshot.task_name(task.name, num_fewshot))
    if task.kind == "text":
        context, window = text_lengths(cfg)
        inputs, targets = text_windows(vocab.encode, task, window, context, max_examples)
        owner = np.arange(len(inputs))
    else:
        examples = limit_examples(task, max_examples)
        if num_fewshot:
            examples, shots = _fewshot(task, examples, num_fewshot, vocab, cfg)
        inputs, targets, owner = tokenize_pairs(_pair_encoder(cfg, vocab), task, examples)
    fitted = fit_pairs(cfg, inputs, targets, task.name)
    return _Prepared(task, num_fewshot, examples, shots, inputs, targets, owner, fitted)


def _finish(p: _Prepared, scores, vocab, cfg: ExperimentConfig, records: list | None) -> dict:
    """A prepared task's metrics from its pairs' (logprob, n_tokens, all_correct)."""
    task, prefix, (lp, n_tok, correct) = p.task, p.task.name, scores
    truncated = len(set(p.owner[p.fitted.cut].tolist()))
    scored = Scored(np.asarray(lp), np.asarray(n_tok), np.asarray(correct), p.owner, truncated)
    if task.kind == "text":
        n_bytes = [len(vocab.decode(t).encode("utf-8")) for t in p.targets]
        out = text_metrics(scored, sum(n_bytes), prefix)
        if records is not None:
            records += _mark_beyond(cfg, p, window_records(scored, p.fitted, n_bytes))
    else:
        if task.kind == "last_word":
            out = last_word_metrics(scored, prefix)
        else:
            out = choice_metrics(task, p.examples, scored, prefix)
        out |= task_loss_metrics(task, p.examples, scored, prefix)
        if p.shots is not None:
            out |= fewshot.shot_metrics(prefix, p.num_fewshot, p.shots)
        if records is not None:
            kept = example_records(task, p.examples, scored, p.fitted)
            for record, shown in zip(kept, fewshot.shot_records(task, p.shots or []), strict=False):
                record |= shown  # how many demonstrations it really got, and which
            records += _mark_beyond(cfg, p, kept)
    out[f"{prefix}/truncated"] = truncated
    out |= beyond_training(cfg, task.name, p.fitted, p.owner)
    if task.kind == "choice":
        out |= _identical_choices(task.name, p.examples)
    return out


def evaluate_task(
    task: Task,
    score: ScoreFn,
    vocab,
    cfg: ExperimentConfig,
    *,
    max_examples: int | None = None,
    records: list[dict] | None = None,
    num_fewshot: int = 0,
) -> dict[str, float]:
    """Flat metrics of one task ("<task>/<metric>"; K-shot: "<task>.<K>shot/<metric>")
    scored by `score`.

    Pairs keep the context that `cfg.eval`'s rule allows (`budget.py`); continuations are
    never cut. `<task>/truncated` counts the examples whose context was cut. With
    `num_fewshot` K > 0, each context follows K demonstrations (`fewshot.py`). Per-example
    scores are appended to `records` when given. `vocab` is a seqio Vocabulary.
    """
    prepared = _prepare(task, vocab, cfg, max_examples, num_fewshot)
    return _finish(prepared, score(prepared.fitted), vocab, cfg, records)


def _identical_choices(task: str, examples) -> dict:
    """`<task>/identical_choices`: examples that offer one text twice (read the same
    context, so they score the same and the tie goes to the first); a warning when any do."""
    same = sum(
        len(set(ex.pairs())) < len(ex.choices) for ex in examples
    )  # partial scoring's shared continuation follows different contexts: not identical
    if same:
        warnings.warn(
            f"{task}: {same} of {len(examples)} examples offer the same choice twice (the "
            "tie goes to the first; an example whose gold is the second copy cannot be right)",
            stacklevel=2,
        )
    return {f"{task}/identical_choices": same}


def _pair_encoder(cfg: ExperimentConfig, vocab):
    """(context, continuation) -> their tokens, as the model reads a scored pair."""
    return functools.partial(encode_scoring_pair, cfg, vocab)


def _fewshot(task: Task, examples, k: int, vocab, cfg: ExperimentConfig):
    """`examples` as K-shot prompts within each pair's context budget, and their shots."""

    def budget(exs):
        _, targets, owner = tokenize_pairs(_pair_encoder(cfg, vocab), task, exs)
        room = context_budget(cfg, targets)
        if task.demos_within_training:
            room = np.minimum(room, training_room(cfg, targets))
        return np.split(room, np.flatnonzero(np.diff(owner)) + 1) if len(exs) else []

    ev = cfg.eval
    return fewshot.fewshot_examples(
        task, examples, k, ev.fewshot_seed, ev.fewshot_delimiter, vocab.encode, budget
    )


def shot_counts(cfg: ExperimentConfig, task: Task) -> tuple[int, ...]:
    """The numbers of demonstrations `task` is scored with (held-out text: zero only, and
    refused when its numbers leave out 0: it would be scored at none of them)."""
    shots = cfg.eval.shots(task.name)
    if task.kind == "text" and 0 not in shots:
        raise ConfigError(
            f"task {task.name!r} is held-out text, scored without demonstrations only, but "
            f"its numbers of demonstrations are {list(shots)}: it would score nothing; give "
            "0 among them (e.g. --num-fewshot 0,2 or eval.num_fewshot=0,2), or score it apart"
        )
    return (0,) if task.kind == "text" else shots


def training_room(cfg: ExperimentConfig, targets: list[list[int]]) -> np.ndarray:
    """Per pair: the context tokens training's rows hold beside its continuation and the input
    form (the encoder's row for the encoder-decoder; the decoder row that context and
    continuation share otherwise), as `beyond_training` counts rows."""
    encoder, decoder = feature_lengths(cfg.objective, cfg.model.is_encoder_decoder)
    suffix = len(scoring_inputs_suffix(cfg.objective))
    prefix = len(scoring_targets_prefix(cfg.objective))
    n_tgt = np.array([len(t) + prefix for t in targets], dtype=np.int64)
    room = np.full_like(n_tgt, encoder) if encoder else decoder - n_tgt
    return np.maximum(room - suffix, 0)


# (task, row kind, training's length) already warned about in this process: evaluating a run
# at each checkpoint, or K-shot prompts the user asked to run long, would repeat it per call.
BEYOND_TRAINING_SAID: set[tuple[str, str, int]] = set()


def _rows(cfg: ExperimentConfig, fitted) -> tuple[np.ndarray, int, str]:
    """Each pair's row in the stack whose length training fixed, that length, and the stack."""
    encoder, decoder = feature_lengths(cfg.objective, cfg.model.is_encoder_decoder)
    if encoder:
        return np.array([len(x) for x in fitted.inputs]), encoder, "encoder"
    rows = np.array([len(x) + len(y) for x, y in zip(fitted.inputs, fitted.targets)])
    return rows, decoder, "decoder"


def beyond_training(cfg: ExperimentConfig, task: str, fitted, owner: np.ndarray) -> dict:
    """`<task>/longer_than_training`: examples scored in rows longer than the training rows
    (the encoder's for the encoder-decoder, context + continuation for a decoder), and
    `<task>/longest`, the longest such row in tokens; a warning, once per task and process,
    when any is (positions the model never trained on are scored without a word otherwise)."""
    rows, trained, where = _rows(cfg, fitted)
    longer = len(set(owner[rows > trained].tolist())) if rows.size else 0
    longest = int(rows.max()) if rows.size else 0
    if longer and (task, where, trained) not in BEYOND_TRAINING_SAID:
        BEYOND_TRAINING_SAID.add((task, where, trained))
        warnings.warn(
            f"{task}: {longer} of {len(set(owner.tolist()))} examples are scored in "
            f"{where} rows longer than training's {trained} tokens (longest {longest}); "
            "their positions were never trained on (each example's `longer_than_training` "
            "in its per-example record)",
            stacklevel=2,
        )
    return {f"{task}/longer_than_training": longer, f"{task}/longest": longest}


def _mark_beyond(cfg: ExperimentConfig, p: _Prepared, kept: list[dict]) -> list[dict]:
    """Each record (an example, or a text window: both index `owner`) marked with whether any
    of its rows is longer than training's."""
    rows, trained, _ = _rows(cfg, p.fitted)
    beyond = set(p.owner[rows > trained].tolist()) if rows.size else set()
    for i, record in enumerate(kept):
        record["longer_than_training"] = i in beyond
    return kept


def evaluate_params(
    cfg: ExperimentConfig,
    model,
    params,
    *,
    tasks: Sequence[str | Task] | None = None,
    data_dir: str | None = None,
    max_examples: int | None = None,
    mesh=None,
    scorer: Scorer | None = None,
    records: dict[str, list[dict]] | None = None,
) -> dict[str, float]:
    """Zero-shot metrics of `params` on `tasks` (default: cfg.eval's), flat "<task>/<metric>";
    per-example scores into `records[task]` when `records` is given."""
    refusal = scores_zero_shot(cfg.objective)
    if refusal:
        raise ConfigError(refusal)
    names = [t for t in (tasks or ()) if not isinstance(t, Task)]
    loaded = [t for t in (tasks or ()) if isinstance(t, Task)]
    if tasks is None or names:
        loaded += load_tasks(
            cfg.eval, cfg.data.synthetic, None if tasks is None else names, data_dir
        )
    scorer = scorer or Scorer(cfg, model, params, mesh=mesh)
    vocab = get_vocabulary(cfg.data)
    limit = max_examples or cfg.eval.max_examples
    scoring = scoring_config(cfg)
    # Every task at every number of demonstrations is made into pairs first and all are
    # scored in one plan (batching.plan_calls), so that they share their compiled shapes.
    prepared = [_prepare(t, vocab, scoring, limit, k) for t in loaded for k in shot_counts(cfg, t)]
    scores = scorer.score_parts([p.fitted for p in prepared])
    results: dict[str, float] = {}
    for p, part in zip(prepared, scores, strict=True):
        kept = None if records is None else records.setdefault(p.task.name, [])
        results |= _finish(p, part, vocab, scoring, kept)
    return results


def eval_overrides(cfg: ExperimentConfig, overrides: Sequence[str]) -> ExperimentConfig:
    """`cfg` with `eval.key=value` overrides applied; anything else is refused (a trained
    run's model, data and objective are fixed)."""
    if not overrides:
        return cfg
    bad = [o for o in overrides if not o.strip().startswith("eval.")]
    if bad:
        raise ConfigError(
            f"override {bad[0]!r}: evaluating a trained run accepts only eval.* settings "
            "(e.g. eval.inputs_length=512, eval.context_rule=wang2022); its model, data and "
            "objective are those it was trained with"
        )
    data = apply_overrides(cfg.model_dump(mode="json"), list(overrides), ExperimentConfig)
    return validate(ExperimentConfig, data, "eval overrides")


def load_run(
    workdir: str | Path, step: int | None = None, overrides: Sequence[str] = ()
) -> tuple[ExperimentConfig, object, int]:
    """(config with `eval.key=value` overrides applied, parameters, step) of a run directory's
    checkpoint (default: the latest), the parameters in the run's own shardings on the mesh
    its config describes (scored there as training placed them)."""
    workdir = Path(workdir)
    if not workdir.is_dir():
        raise ScalestudyError(not_found(workdir, "run directory", "a run directory"))
    if saved_run.latest_step(workdir) is None:
        raise ScalestudyError(
            f"no checkpoint in {workdir}: nothing to evaluate; train first "
            f"(`scalestudy train --workdir {workdir}`) or give the directory of a trained run"
        )
    cfg, params, step = saved_run.restore_params(workdir, step, on_run_mesh=True)
    return eval_overrides(cfg, overrides), params, step


def evaluate_run(
    workdir: str | Path,
    tasks: Sequence[str] | None = None,
    data_dir: str | None = None,
    step: int | None = None,
    max_examples: int | None = None,
    overrides: Sequence[str] = (),
    out: str | Path | None = None,
) -> dict:
    """Evaluate a run directory's checkpoint (default: latest) with its stored evaluation
    settings changed by `overrides` (`eval.key=value`); no retraining. Aggregates go to its
    summary.json ("eval", with the settings in "eval_config") and metrics.jsonl, per-example
    scores to eval_examples/step_<step>/<task>.jsonl (or the aggregates to the JSON file
    `out`); returns the aggregates and the step (rundir.RunNotUpdated carries them when the
    run cannot be written)."""
    workdir = Path(workdir)
    cfg, params, step = load_run(workdir, step, overrides)
    # The settings recorded beside the results are the ones that scored them.
    given = {"tasks": tuple(tasks) if tasks else None, "data_dir": data_dir}
    given["max_examples"] = max_examples
    cfg = cfg.replace(eval=cfg.eval.replace(**{k: v for k, v in given.items() if v is not None}))
    model = build_model(cfg.model)
    mesh = jax.tree.leaves(params)[0].sharding.mesh
    records: dict[str, list[dict]] = {}
    results = evaluate_params(
        cfg,
        model,
        params,
        tasks=tasks,
        data_dir=data_dir,
        max_examples=max_examples,
        mesh=mesh,
        records=records,
    )
    print_task_lines(step, results)
    settings = cfg.eval.model_dump(mode="json")

    def write_into_run() -> None:
        write_examples(workdir, step, records, settings)
        write_results(workdir, step, results, settings)

    scores = {"step": step, **results}
    rundir.record_results(workdir, scores, write_into_run, out)
    return scores


def check_tasks(cfg: ExperimentConfig, tasks: Sequence[Task]) -> None:
    """Refuse, before any training, a task whose rows would exceed eval.max_length."""
    vocab = get_vocabulary(cfg.data)
    scoring = scoring_config(cfg)
    for task in tasks:
        if task.kind == "text":
            shot_counts(cfg, task)  # scored at zero shots, or refused
            continue  # windows are cut to the eval lengths by construction
        examples = limit_examples(task, cfg.eval.max_examples)
        for k in shot_counts(cfg, task):
            shown = examples
            if k:  # enough demonstrations, and room for at least one of them
                shown, _ = _fewshot(task, examples, k, vocab, scoring)
            inputs, targets, _ = tokenize_pairs(_pair_encoder(scoring, vocab), task, shown)
            fit_pairs(scoring, inputs, targets, fewshot.task_name(task.name, k))


def make_eval_fn(
    cfg: ExperimentConfig, workdir: str | Path | None = None
) -> Callable[[object, object, int], dict[str, float]] | None:
    """eval_fn(model, params, step) for loop.train: cfg.eval's tasks, loaded (and checked)
    now so that a bad task fails before training; one compiled scorer reused across calls.
    With `workdir`, each call also writes its per-example scores there. None, with one line
    on stderr saying why, for an objective rank classification cannot score (bmlm)."""
    refusal = scores_zero_shot(cfg.objective)
    if refusal:
        print(f"zero-shot evaluation skipped: {refusal}", file=sys.stderr)
        return None
    tasks = load_tasks(cfg.eval, cfg.data.synthetic)
    check_tasks(cfg, tasks)
    state: dict[str, Scorer] = {}

    def eval_fn(model, params, step: int) -> dict[str, float]:
        if "scorer" not in state:
            state["scorer"] = Scorer(cfg, model, params)
        else:
            state["scorer"].set_params(params)
        records: dict[str, list[dict]] | None = None if workdir is None else {}
        out = evaluate_params(
            cfg, model, params, tasks=tasks, scorer=state["scorer"], records=records
        )
        if records is not None and jax.process_index() == 0:
            write_examples(Path(workdir), step, records, cfg.eval.model_dump(mode="json"))
        return out

    return eval_fn
