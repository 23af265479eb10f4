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
from scalestudy.errors import ScalestudyError
from scalestudy.evaluate.budget import Fitted, fit_pairs, scoring_lengths
from scalestudy.train import sharding

# Fitted pairs -> per pair: logprob sum, target token count, all greedy-correct.
ScoreFn = Callable[[Fitted], tuple[np.ndarray, np.ndarray, np.ndarray]]


def scoring_config(cfg: ExperimentConfig) -> ExperimentConfig:
    """`cfg` with the objective lengths replaced by eval.inputs_length/targets_length if set
    (the lengths eval's wang2022 rule and text windows read)."""
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

    def score(self, fitted: Fitted) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per pair of `fitted`: (logprob, n_tokens, all_correct), every pair whole."""
        cfg = scoring_lengths(self.cfg, fitted.lengths)
        n = len(fitted.inputs)
        outs: list[list[np.ndarray]] = [[], [], []]
        for start in range(0, n, self.rows):
            stop = min(start + self.rows, n)
            pad = [start] * (self.rows - (stop - start))  # fill the fixed shape: reuse a pair
            idx = [*range(start, stop), *pad]
            batch, n_cut = scoring_batch(
                cfg, [fitted.inputs[i] for i in idx], [fitted.targets[i] for i in idx]
            )
            if n_cut:  # fit_pairs sized the rows; a cut here is a bug, never a silent result
                raise ScalestudyError(f"scoring rows of {fitted.lengths} cut {n_cut} pairs")
            part = self._run(self._distinct_contexts(batch, np.arange(self.rows)))
            for acc, value in zip(outs, part, strict=True):
                acc.append(np.asarray(value)[: stop - start])
        if not n:
            return np.zeros(0), np.zeros(0, np.int32), np.zeros(0, bool)
        lp, n_tok, correct = (np.concatenate(o) for o in outs)
        return lp, n_tok, correct

    def __call__(
        self, inputs: list[list[int]], targets: list[list[int]], owner: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """Per pair: (logprob, n_tokens, all_correct) under eval's context rule; and the
        number of examples (pairs grouped by `owner`) whose context was cut."""
        fitted = fit_pairs(self.cfg, inputs, targets)
        lp, n_tok, correct = self.score(fitted)
        return lp, n_tok, correct, len(set(np.asarray(owner)[fitted.cut].tolist()))
