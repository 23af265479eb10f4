"""Rank classification with Model.score: one code path for all three architectures.

Every task becomes (context, continuation) token pairs (`pairs.py`), scored in fixed-shape
batches (`scorer.py`) and summarised per task (`metrics.py`); a run directory's results are
written by `results.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

from scalestudy.config import ExperimentConfig
from scalestudy.data.vocab import get_vocabulary
from scalestudy.errors import ScalestudyError
from scalestudy.evaluate.examples import Task
from scalestudy.evaluate.metrics import Scored, choice_metrics, last_word_metrics, text_metrics
from scalestudy.evaluate.pairs import limit_examples, text_windows, tokenize_pairs
from scalestudy.evaluate.results import write_results
from scalestudy.evaluate.scorer import ScoreFn, Scorer, scoring_config
from scalestudy.evaluate.tasks import load_tasks
from scalestudy.models.api import build_model
from scalestudy.train import checkpoint

__all__ = [
    "Scorer",
    "bench",
    "evaluate_params",
    "evaluate_run",
    "evaluate_task",
    "limit_examples",
    "make_eval_fn",
    "scoring_config",
]


def evaluate_task(
    task: Task,
    score: ScoreFn,
    vocab,
    *,
    max_examples: int | None = None,
    lengths: tuple[int, int] = (48, 16),
) -> dict[str, float]:
    """Flat metrics of one task ("<task>/<metric>") scored by `score`.

    `lengths` (context, target) sizes the text task's windows; `vocab` is a seqio Vocabulary.
    """
    prefix = task.name
    if task.kind == "text":
        inputs, targets = text_windows(vocab.encode, task, lengths[1], lengths[0], max_examples)
        owner = np.arange(len(inputs))
    else:
        examples = limit_examples(task, max_examples)
        inputs, targets, owner = tokenize_pairs(vocab.encode, task, examples)
    lp, n_tok, correct, truncated = score(inputs, targets, owner)
    scored = Scored(np.asarray(lp), np.asarray(n_tok), np.asarray(correct), owner, truncated)
    if task.kind == "text":
        n_bytes = sum(len(vocab.decode(t).encode("utf-8")) for t in targets)
        out = text_metrics(scored, n_bytes, prefix)
    elif task.kind == "last_word":
        out = last_word_metrics(scored, prefix)
    else:
        out = choice_metrics(task, examples, scored, prefix)
    out[f"{prefix}/truncated"] = int(truncated)
    return out


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
) -> dict[str, float]:
    """Zero-shot metrics of `params` on `tasks` (default: cfg.eval's), flat "<task>/<metric>"."""
    names = [t for t in (tasks or ()) if not isinstance(t, Task)]
    loaded = [t for t in (tasks or ()) if isinstance(t, Task)]
    if tasks is None or names:
        loaded += load_tasks(
            cfg.eval, cfg.data.synthetic, None if tasks is None else names, data_dir
        )
    scorer = scorer or Scorer(cfg, model, params, mesh=mesh)
    vocab = get_vocabulary(cfg.data)
    obj = scorer.cfg.objective
    limit = max_examples or cfg.eval.max_examples
    results: dict[str, float] = {}
    for task in loaded:
        results |= evaluate_task(
            task, scorer, vocab, max_examples=limit, lengths=(obj.inputs_length, obj.targets_length)
        )
    return results


def evaluate_run(
    workdir: str | Path,
    tasks: Sequence[str] | None = None,
    data_dir: str | None = None,
    step: int | None = None,
    max_examples: int | None = None,
) -> dict:
    """Evaluate a run directory's checkpoint (default: latest); results go to its
    summary.json ("eval") and metrics.jsonl, and are returned with the step."""
    workdir = Path(workdir)
    if not workdir.is_dir():
        raise ScalestudyError(f"run directory not found: {workdir}")
    if checkpoint.latest_step(workdir) is None:
        raise ScalestudyError(
            f"no checkpoint in {workdir}: nothing to evaluate; train first "
            f"(`scalestudy train --workdir {workdir}`) or give the directory of a trained run"
        )
    # Straight into the run's parameter shardings, scored under the same mesh as training.
    cfg, params, step = checkpoint.restore_params(workdir, step, on_run_mesh=True)
    model = build_model(cfg.model)
    mesh = jax.tree.leaves(params)[0].sharding.mesh
    results = evaluate_params(
        cfg, model, params, tasks=tasks, data_dir=data_dir, max_examples=max_examples, mesh=mesh
    )
    write_results(workdir, step, results)
    return {"step": step, **results}


def make_eval_fn(cfg: ExperimentConfig) -> Callable[[object, object, int], dict[str, float]]:
    """eval_fn(model, params, step) for loop.train: cfg.eval's tasks, loaded (and checked)
    now so that a bad task fails before training; one compiled scorer reused across calls."""
    tasks = load_tasks(cfg.eval, cfg.data.synthetic)
    state: dict[str, Scorer] = {}

    def eval_fn(model, params, step: int) -> dict[str, float]:
        del step
        if "scorer" not in state:
            state["scorer"] = Scorer(cfg, model, params)
        else:
            state["scorer"].set_params(params)
        return evaluate_params(cfg, model, params, tasks=tasks, scorer=state["scorer"])

    return eval_fn


def bench(cfg: ExperimentConfig | None, steps: int) -> dict:
    """Examples/s of a 4-choice task (a synthetic probe) for each architecture.

    Without a config: the default model size with eval lengths 48+16. Each architecture is
    compiled once (not timed), then `steps` batches of eval.batch_size rows are timed, and
    the training forward pass over the same pairs; each side is the best of three timings.
    """
    import jax

    from scalestudy.config import VALID_CELLS
    from scalestudy.data.pipeline import scoring_batch
    from scalestudy.data.synthetic import probe_tasks
    from scalestudy.data.vocab import get_vocabulary
    from scalestudy.models.api import build_model
    from scalestudy.train import sharding

    cfg = cfg or ExperimentConfig()
    probes = probe_tasks(cfg.data.synthetic)["object_color"]  # 4 choices each
    vocab = get_vocabulary(cfg.data)
    out: dict[str, float | int | str] = {
        "task": "synthetic object_color (4 choices)",
        "batch_rows": cfg.eval.batch_size,
        "devices": len(jax.devices()),
        "d_model": cfg.model.d_model,
        "n_layers": cfg.model.n_layers,
    }
    for arch, objectives in VALID_CELLS.items():
        cell = cfg.replace(
            model={**cfg.model.model_dump(), "arch": arch},
            objective={**cfg.objective.model_dump(), "name": objectives[-1]},
        )
        model = build_model(cell.model)
        scorer = Scorer(cell, model, model.init(jax.random.key(0)))
        n_ex = max(1, steps * scorer.rows // 4)
        items = [probes[i % len(probes)] for i in range(n_ex)]
        inputs = [vocab.encode(x["context"]) for x in items for _ in x["choices"]]
        targets = [vocab.encode(" " + c) for x in items for c in x["choices"]]
        owner = np.repeat(np.arange(n_ex), 4)
        scorer(inputs[: scorer.rows], targets[: scorer.rows], owner[: scorer.rows])  # compile
        dt = _best_time(scorer, inputs, targets, owner)
        out[f"{arch}/examples_per_s"] = round(n_ex / dt, 1)
        out[f"{arch}/pairs_per_s"] = round(len(inputs) / dt, 1)
        # The training forward pass (logits of every pair, each with its own context) over
        # the same pairs: evaluation should cost no more per pair.
        forward = jax.jit(model.apply)
        full, _ = scoring_batch(scorer.cfg, inputs[: scorer.rows], targets[: scorer.rows])
        with sharding.axis_rules(scorer.mesh):
            full = sharding.shard_batch(scorer.mesh, full)
            jax.block_until_ready(forward(scorer.params, full))
            calls = -(-len(inputs) // scorer.rows)
            fwd = _best_time(_call_n, calls, forward, scorer.params, full)
        out[f"{arch}/eval_over_forward"] = round(dt / fwd, 2)
    return out


def _best_time(fn: Callable, *args: object, repeats: int = 3) -> float:
    """The shortest of `repeats` timed calls `fn(*args)`: on a shared host the others also
    measure its load."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times)


def _call_n(n: int, fn: Callable, *args: object) -> None:
    """Call the jitted `fn(*args)` n times, each to completion."""
    import jax

    for _ in range(n):
        jax.block_until_ready(fn(*args))
