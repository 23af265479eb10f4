"""Rank-classification throughput of each architecture, against its training forward pass,
and the CPU cost of scoring the config's tasks with bucketed rows against one shape per task."""

from __future__ import annotations

import time

import jax
import numpy as np

from scalestudy.bench.cells import best_time, cells
from scalestudy.config.experiment import ExperimentConfig
from scalestudy.data.pipeline import scoring_batch
from scalestudy.data.synthetic import probe_tasks
from scalestudy.data.vocab import get_vocabulary
from scalestudy.evaluate.rank import Scorer, evaluate_params
from scalestudy.evaluate.tasks import load_tasks
from scalestudy.models.api import build_model
from scalestudy.train import sharding


def bench(cfg: ExperimentConfig | None, steps: int) -> dict:
    """Examples/s of a 4-choice task (a synthetic probe) for each architecture.

    Without a config: the default model size with eval lengths 48+16. Each architecture is
    compiled once (not timed), then `steps` batches of eval.batch_size rows are timed, and
    the training forward pass over the same pairs; each side is the best of three timings.
    Then `time_tasks` for each architecture over the config's eval.tasks.
    """
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
    # Span corruption is valid for every architecture: one cell each.
    mlm = cfg.replace(objective={**cfg.objective.model_dump(), "name": "mlm"})
    for arch, _, cell in cells(mlm, one_per_arch=True):
        model = build_model(cell.model)
        scorer = Scorer(cell, model, model.init(jax.random.key(0)))
        n_ex = max(1, steps * scorer.rows // 4)
        items = [probes[i % len(probes)] for i in range(n_ex)]
        inputs = [vocab.encode(x["context"]) for x in items for _ in x["choices"]]
        targets = [vocab.encode(" " + c) for x in items for c in x["choices"]]
        owner = np.repeat(np.arange(n_ex), 4)
        scorer(inputs[: scorer.rows], targets[: scorer.rows], owner[: scorer.rows])  # compile
        dt = best_time(scorer, inputs, targets, owner)
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
            fwd = best_time(_call_n, calls, forward, scorer.params, full)
        out[f"{arch}/eval_over_forward"] = round(dt / fwd, 2)
        out |= {f"{arch}/tasks/{k}": v for k, v in time_tasks(cell, model, rounds=1).items()}
    return out


def time_tasks(
    cfg: ExperimentConfig, model=None, *, data_dir: str | None = None, rounds: int = 2
) -> dict[str, float | int | bool]:
    """CPU seconds (every thread of this process) of scoring `cfg.eval.tasks` with
    `evaluate_params`, bucketed rows against one shape per task, in one process: a first
    round each (compiling included), then `rounds` alternating rounds (the least counts).
    Also the positions and calls of one evaluation each way, and whether the two agree: the
    largest difference of any choice's log-likelihood and whether every prediction is equal.
    """
    model = model or build_model(cfg.model)
    params = model.init(jax.random.key(0))
    tasks = load_tasks(cfg.eval, cfg.data.synthetic, None, data_dir)
    ways = {"bucketed": True, "one_shape": False}
    scorers = {w: Scorer(cfg, model, params, bucketed=b) for w, b in ways.items()}
    cpu: dict[str, list[float]] = {w: [] for w in ways}
    records: dict[str, dict[str, list[dict]]] = {}
    for _ in range(rounds + 1):
        for way, scorer in scorers.items():
            records[way] = {}
            start = time.process_time()
            evaluate_params(cfg, model, params, tasks=tasks, scorer=scorer, records=records[way])
            cpu[way].append(time.process_time() - start)
    out: dict[str, float | int | bool] = {}
    for way, scorer in scorers.items():
        out[f"{way}/cpu_s_first"] = round(cpu[way][0], 2)
        out[f"{way}/cpu_s"] = round(min(cpu[way][1:]), 2)
        out[f"{way}/calls"] = scorer.calls // (rounds + 1)
        out[f"{way}/positions"] = scorer.positions // (rounds + 1)
    out["one_shape_over_bucketed"] = round(out["one_shape/cpu_s"] / out["bucketed/cpu_s"], 2)
    a = [r for task in records["bucketed"].values() for r in task]
    b = [r for task in records["one_shape"].values() for r in task]
    out["pairs"] = sum(len(r.get("choices", [r])) for r in a)
    out["max_logprob_diff"] = max(
        (abs(x["logprob"] - y["logprob"]) for p, q in zip(a, b) for x, y in _choices(p, q)),
        default=0.0,
    )
    out["same_predictions"] = all(p.get("pred") == q.get("pred") for p, q in zip(a, b))
    return out


def _choices(p: dict, q: dict) -> zip:
    """Pairs of the per-choice records of two records of one example (a text window is its
    own single choice)."""
    return zip(p.get("choices", [p]), q.get("choices", [q]), strict=True)


def _call_n(n: int, fn, *args: object) -> None:
    """Call the jitted `fn(*args)` n times, each to completion."""
    for _ in range(n):
        jax.block_until_ready(fn(*args))
