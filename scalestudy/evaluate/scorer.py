"""Scoring token pairs with `Model.score` in fixed-shape, mesh-sharded batches.

`data.pipeline.scoring_batch` lays each (context, continuation) pair out as the architecture
needs (causal: concatenation; non-causal: context as the bidirectional prefix; encoder-decoder:
context to the encoder), and `Model.score` returns the sum of the continuation tokens'
log-probabilities, their count, and whether greedy decoding would have produced every one.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from scalestudy.config import ExperimentConfig
from scalestudy.data.pipeline import scoring_batch
from scalestudy.train import sharding

# (inputs, targets, example index per pair) -> per pair: logprob sum, target token count,
# all greedy-correct; and the number of examples whose context was truncated.
ScoreFn = Callable[[list[list[int]], list[list[int]], np.ndarray], tuple]


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
        self.cfg = scoring_config(cfg)
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
        self.params = jax.device_put(params, self._param_shardings)

    def _run(self, batch: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
        with sharding.axis_rules(self.mesh):
            out = self._score(self.params, sharding.shard_batch(self.mesh, batch))
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
            batch, n_cut = scoring_batch(self.cfg, inputs[lo:hi], targets[lo:hi])
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
