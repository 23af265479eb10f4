"""Rank classification with Model.score: one code path for all three architectures.

Every task becomes (context, continuation) token pairs; `data.pipeline.scoring_batch` lays
them out as the architecture needs (causal: concatenation; non-causal: context as the
bidirectional prefix; encoder-decoder: context to the encoder), and `Model.score` returns the
sum of the continuation tokens' log-probabilities, their count, and whether greedy decoding
would have produced every one of them. From those three numbers per pair:

- multiple choice: `acc` (argmax of the sum), `acc_norm` (argmax of the sum divided by the
  choice's length in characters), as the public harnesses define them;
- last word (LAMBADA): `acc` (greedy exact match of all target tokens) and `ppl`
  (exp of minus the mean per-example log-likelihood) from the same pass;
- text: `loss` (nats per token), `ppl`, `bpb` (bits per UTF-8 byte, comparable across
  vocabularies).

Pairs are scored in batches of one fixed shape, so one compilation serves every task.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scalestudy.config import ExperimentConfig
from scalestudy.errors import ScalestudyError
from scalestudy.evaluate.prompts import Example
from scalestudy.evaluate.tasks import Task

# (inputs, targets, example index per pair) -> per pair: logprob sum, target token count,
# all greedy-correct; and the number of examples whose context was truncated.
ScoreFn = Callable[[list[list[int]], list[list[int]], np.ndarray], tuple]


@dataclass
class Scored:
    """Per-pair results of one task, in pair order, and the examples they came from."""

    logprob: np.ndarray
    n_tokens: np.ndarray
    all_correct: np.ndarray
    example_of_pair: np.ndarray
    n_truncated: int


def scoring_config(cfg: ExperimentConfig) -> ExperimentConfig:
    """`cfg` with the objective lengths replaced by eval.inputs_length/targets_length if set."""
    lengths = {
        k: v
        for k, v in (
            ("inputs_length", cfg.eval.inputs_length),
            ("targets_length", cfg.eval.targets_length),
        )
        if v is not None
    }
    if not lengths:
        return cfg
    return cfg.replace(objective=cfg.objective.replace(**lengths))


class Scorer:
    """Scores token pairs with `Model.score` in fixed-shape, mesh-sharded batches."""

    def __init__(self, cfg: ExperimentConfig, model, params, *, mesh=None) -> None:
        import jax

        from scalestudy.data.pipeline import scoring_batch
        from scalestudy.train import sharding

        self.cfg = scoring_config(cfg)
        self._scoring_batch = scoring_batch
        self._sharding = sharding
        self.mesh = mesh if mesh is not None else sharding.make_mesh(cfg.mesh)
        # Rows per call: eval.batch_size rounded up to a multiple of the batch shards.
        probe = self.mesh.devices.size
        shards = probe // sharding.batch_sharding(self.mesh).shard_shape((probe, 1))[0]
        self.rows = -(-cfg.eval.batch_size // shards) * shards
        # Distinct-context row counts (encoder-decoder): shards x 1, 2, 4, ... up to rows.
        sizes = [shards * 2**i for i in range(self.rows.bit_length()) if shards * 2**i < self.rows]
        self._context_sizes = [*sizes, self.rows]
        self._param_shardings = sharding.param_shardings(self.mesh, model.param_axes())
        self.set_params(params)
        self._score = jax.jit(model.score)
        self.calls = 0

    def set_params(self, params) -> None:
        """Score with `params` from now on (placed as the mesh's rules say; no recompile)."""
        import jax

        self.params = jax.device_put(params, self._param_shardings)

    def _run(self, batch: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
        import jax

        with self._sharding.axis_rules(self.mesh):
            out = self._score(self.params, self._sharding.shard_batch(self.mesh, batch))
        self.calls += 1
        out = jax.device_get(out)
        return out["logprob"], out["n_tokens"], out["all_correct"]

    def _distinct_contexts(self, batch: dict[str, np.ndarray], rows: np.ndarray) -> dict:
        """The rows `rows` of `batch`; encoder features (where the batch has them) only once
        per distinct context, with `pair_context` pointing each pair at its context.

        Distinct contexts are padded (repeating the first) to the smallest of a few sizes, so
        that a handful of compiled shapes serve every task.
        """
        out = {k: v[rows] for k, v in batch.items() if not k.startswith("encoder_")}
        encoder = sorted(k for k in batch if k.startswith("encoder_"))
        if not encoder:
            return out
        rows_ctx = np.concatenate([batch[k][rows] for k in encoder], axis=1)
        _, first, pair_context = np.unique(rows_ctx, axis=0, return_index=True, return_inverse=True)
        size = next(s for s in self._context_sizes if s >= len(first))
        keep = rows[np.concatenate([first, np.full(size - len(first), first[0])])]
        out |= {k: batch[k][keep] for k in encoder}
        out["pair_context"] = pair_context.reshape(-1).astype(np.int32)
        return out

    def __call__(
        self, inputs: list[list[int]], targets: list[list[int]], owner: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """Per pair: (logprob, n_tokens, all_correct); and the number of examples (pairs
        grouped by `owner`, contiguous) with a context cut to fit."""
        n = len(inputs)
        cuts = np.flatnonzero(np.diff(owner)) + 1
        parts, truncated = [], 0
        for lo, hi in zip([0, *cuts], [*cuts, n], strict=True):
            batch, n_cut = self._scoring_batch(self.cfg, inputs[lo:hi], targets[lo:hi])
            parts.append(batch)
            truncated += n_cut > 0
        batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        outs: list[list[np.ndarray]] = [[], [], []]
        for start in range(0, n, self.rows):
            rows = np.arange(start, min(start + self.rows, n))
            rows = np.concatenate([rows, np.full(self.rows - len(rows), rows[0])])  # pad: reuse
            part = self._run(self._distinct_contexts(batch, rows))
            for acc, value in zip(outs, part, strict=True):
                acc.append(np.asarray(value)[: min(self.rows, n - start)])
        return (*(np.concatenate(o) for o in outs), int(truncated))


def limit_examples(task: Task, max_examples: int | None) -> list[Example]:
    """The first `max_examples` examples of each group (all of them when None)."""
    if max_examples is None:
        return list(task.examples)
    taken: dict[str, int] = {}
    out = []
    for ex in task.examples:
        if taken.get(ex.group, 0) < max_examples:
            taken[ex.group] = taken.get(ex.group, 0) + 1
            out.append(ex)
    return out


def _tokenize(encode: Callable[[str], list[int]], task: Task, examples: list[Example]):
    """Token pairs of a choice/last-word task and, per pair, the example index."""
    inputs, targets, owner = [], [], []
    for i, ex in enumerate(examples):
        for context, choice in ex.pairs():
            inputs.append(list(encode(context)))
            targets.append(list(encode(task.delimiter + choice)))
            owner.append(i)
    return inputs, targets, np.asarray(owner)


def _text_windows(encode, task: Task, length: int, context: int, max_examples: int | None):
    """Non-overlapping target windows over each document, each after up to `context` tokens.

    A document's first token is only context (an encoder must see at least one token).
    """
    inputs, targets = [], []
    for ex in task.examples:
        tokens = list(encode(ex.choices[0]))
        for start in range(1, len(tokens), length):
            inputs.append(tokens[max(0, start - context) : start])
            targets.append(tokens[start : start + length])
    return inputs[:max_examples], targets[:max_examples]


def choice_metrics(
    task: Task, examples: list[Example], scored: Scored, prefix: str
) -> dict[str, float]:
    """acc and acc_norm of rank classification (overall, and per group when groups differ)."""
    hits, hits_norm, groups = [], [], []
    pair = 0
    for ex in examples:
        k = len(ex.choices)
        lp = scored.logprob[pair : pair + k]
        chars = np.array([max(len(c), 1) for c in ex.choices], dtype=np.float64)
        hits.append(int(np.argmax(lp)) == ex.gold)
        hits_norm.append(int(np.argmax(lp / chars)) == ex.gold)
        groups.append(ex.group)
        pair += k
    out = {}
    names = sorted(set(groups))
    per_group = {}
    for g in names:
        idx = [i for i, x in enumerate(groups) if x == g]
        per_group[g] = (np.mean([hits[i] for i in idx]), np.mean([hits_norm[i] for i in idx]))
        if len(names) > 1:
            out[f"{prefix}/{g}/acc"] = float(per_group[g][0])
            out[f"{prefix}/{g}/acc_norm"] = float(per_group[g][1])
    if task.aggregate == "median":
        out[f"{prefix}/acc"] = float(np.median([a for a, _ in per_group.values()]))
        out[f"{prefix}/acc_norm"] = float(np.median([b for _, b in per_group.values()]))
    else:
        out[f"{prefix}/acc"] = float(np.mean(hits))
        out[f"{prefix}/acc_norm"] = float(np.mean(hits_norm))
    out[f"{prefix}/n"] = len(examples)
    # Expected accuracy of a uniform random guess, so that every table can show chance.
    out[f"{prefix}/chance"] = float(np.mean([1.0 / len(ex.choices) for ex in examples]))
    return out


def last_word_metrics(scored: Scored, prefix: str) -> dict[str, float]:
    """Greedy exact match and perplexity (per example, as the harness; and per token)."""
    lp, n = scored.logprob.astype(np.float64), scored.n_tokens.astype(np.float64)
    return {
        f"{prefix}/acc": float(np.mean(scored.all_correct)),
        f"{prefix}/ppl": float(math.exp(-np.mean(lp))),
        f"{prefix}/ppl_token": float(math.exp(-lp.sum() / n.sum())),
        f"{prefix}/n": len(lp),
    }


def text_metrics(scored: Scored, n_bytes: int, prefix: str) -> dict[str, float]:
    """Held-out loss per token, perplexity and bits per byte."""
    nll, tokens = -float(scored.logprob.astype(np.float64).sum()), float(scored.n_tokens.sum())
    return {
        f"{prefix}/loss": nll / tokens,
        f"{prefix}/ppl": math.exp(nll / tokens),
        f"{prefix}/bpb": nll / math.log(2) / n_bytes,
        f"{prefix}/tokens": int(tokens),
        f"{prefix}/n": len(scored.logprob),
    }


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
        inputs, targets = _text_windows(vocab.encode, task, lengths[1], lengths[0], max_examples)
        owner = np.arange(len(inputs))
    else:
        examples = limit_examples(task, max_examples)
        inputs, targets, owner = _tokenize(vocab.encode, task, examples)
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
    from scalestudy.data.vocab import get_vocabulary
    from scalestudy.evaluate.tasks import load_tasks

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


def _write_results(workdir: Path, step: int, results: dict[str, float]) -> None:
    """Merge into summary.json["eval"] and append one line to metrics.jsonl."""
    summary_path = workdir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    summary["eval"] = {**summary.get("eval", {}), **results, "step": step}
    tmp = summary_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(summary_path)  # atomic: a crash never leaves half a summary
    with (workdir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": step, **{f"eval/{k}": v for k, v in results.items()}}) + "\n")


def evaluate_run(
    workdir: str | Path,
    tasks: Sequence[str] | None = None,
    data_dir: str | None = None,
    step: int | None = None,
    max_examples: int | None = None,
) -> dict:
    """Evaluate a run directory's checkpoint (default: latest); results go to its
    summary.json ("eval") and metrics.jsonl, and are returned with the step."""
    import jax

    from scalestudy.models.api import build_model
    from scalestudy.train import checkpoint

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
    _write_results(workdir, step, results)
    return {"step": step, **results}


def make_eval_fn(cfg: ExperimentConfig) -> Callable[[object, object, int], dict[str, float]]:
    """eval_fn(model, params, step) for loop.train: cfg.eval's tasks, loaded (and checked)
    now so that a bad task fails before training; one compiled scorer reused across calls."""
    from scalestudy.evaluate.tasks import load_tasks

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
