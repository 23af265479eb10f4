"""Rank-classification throughput of each architecture, against its training forward pass."""

from __future__ import annotations

import jax
import numpy as np

from scalestudy.bench.cells import best_time, cells
from scalestudy.config import ExperimentConfig
from scalestudy.data.pipeline import scoring_batch
from scalestudy.data.synthetic import probe_tasks
from scalestudy.data.vocab import get_vocabulary
from scalestudy.evaluate.rank import Scorer
from scalestudy.models.api import build_model
from scalestudy.train import sharding


def bench(cfg: ExperimentConfig | None, steps: int) -> dict:
    """Examples/s of a 4-choice task (a synthetic probe) for each architecture.

    Without a config: the default model size with eval lengths 48+16. Each architecture is
    compiled once (not timed), then `steps` batches of eval.batch_size rows are timed, and
    the training forward pass over the same pairs; each side is the best of three timings.
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
    return out


def _call_n(n: int, fn, *args: object) -> None:
    """Call the jitted `fn(*args)` n times, each to completion."""
    for _ in range(n):
        jax.block_until_ready(fn(*args))
