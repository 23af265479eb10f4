"""Scoring token pairs with `Model.score` in mesh-sharded batches of a few fixed shapes.

`data.pipeline.scoring_batch` lays each (context, continuation) pair out as the architecture
needs (causal: concatenation; non-causal: context as the bidirectional prefix; encoder-decoder:
context to the encoder), and `Model.score` returns the sum of the continuation tokens'
log-probabilities, their count, and whether greedy decoding would have produced every one.

Rows are not all padded to a task's longest pair: each pair goes to the shortest row length of
a short ladder (`bucket_length`) that holds it whole, and shorter rows are scored more to a
call, so that a call costs about as many positions whatever its rows' length. Padding is
masked, so a pair's score does not depend on its row's length or on the rows beside it
(tested against one length for every row).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import jax
import numpy as np

from scalestudy.config.errors import ScalestudyError
from scalestudy.config.experiment import ExperimentConfig
from scalestudy.data.pipeline import scoring_batch
from scalestudy.evaluate.batching import MIN_CALLS, plan_calls
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


def without_start_token(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Decoder-only rows read from their first context token on: every decoder feature one
    position to the left (the start token's position dropped, positions from 0 again), so
    that a pair (context, continuation) is the row `context + continuation[:-1]` predicting
    `context[1:] + continuation`, only the continuation scored; the non-causal decoder's
    bidirectional prefix is the context's positions. lm-evaluation-harness reads its rolling
    windows after the first so."""
    out = {}
    for key, value in batch.items():
        out[key] = value
        if key.startswith("decoder_"):
            out[key] = np.concatenate([value[:, 1:], np.zeros_like(value[:, :1])], axis=1)
    out["decoder_positions"] = np.maximum(out["decoder_positions"] - 1, 0)
    return out


class Scorer:
    """Scores token pairs with `Model.score` in mesh-sharded batches of a few fixed shapes
    (`batching.plan_calls`; `bucketed=False`: every row at the task's full lengths)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        model,
        params,
        *,
        mesh=None,
        bucketed: bool = True,
        min_calls: int = MIN_CALLS,
    ) -> None:
        self.cfg = scoring_config(cfg)
        self.encdec = cfg.model.is_encoder_decoder
        self.bucketed, self.min_calls = bucketed, min_calls
        self.mesh = mesh if mesh is not None else sharding.make_mesh(cfg.mesh)
        # Rows per call: eval.batch_size rounded up to a multiple of the batch shards.
        probe = self.mesh.devices.size
        self.shards = probe // sharding.batch_sharding(self.mesh).shard_shape((probe, 1))[0]
        self.rows = -(-cfg.eval.batch_size // self.shards) * self.shards
        self._param_shardings = sharding.param_shardings(self.mesh, model.param_axes())
        self.set_params(params)
        self._score = jax.jit(model.score)
        self._configs: dict[tuple[int, int], ExperimentConfig] = {}
        self.calls = 0  # scoring calls made, and the positions (rows x length) they computed
        self.positions = 0

    def set_params(self, params) -> None:
        """Score with `params` from now on (placed as the mesh's rules say; no recompile)."""
        self.params = jax.device_put(params, self._param_shardings)

    def _run(self, batch: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
        with sharding.axis_rules(self.mesh):
            out = self._score(self.params, sharding.shard_batch(self.mesh, batch))
        self.calls += 1
        self.positions += sum(v.size for k, v in batch.items() if k.endswith("_input_tokens"))
        out = jax.device_get(out)
        return out["logprob"], out["n_tokens"], out["all_correct"]

    def _distinct_contexts(self, batch: dict[str, np.ndarray]) -> dict:
        """`batch` with its encoder features (where it has them) only once per distinct
        context, and `pair_context` pointing each pair at its context.

        Distinct contexts are padded (repeating the first) to the batch shards times a power
        of two, at least a quarter of the batch's rows and at most all of them, so that a
        handful of compiled shapes serve every task: a call of few contexts (a run of one
        long context's choices, a task's last pairs) takes the shape of a four-choice
        task's calls instead of one of its own (15 compiled shapes to 11 for the smoke
        study's encoder-decoder probes), and encodes at most a quarter of its rows more.
        """
        out = {k: v for k, v in batch.items() if not k.startswith("encoder_")}
        encoder = sorted(k for k in batch if k.startswith("encoder_"))
        if not encoder:
            return out
        rows = len(batch["decoder_input_tokens"])
        contexts = np.concatenate([batch[k] for k in encoder], axis=1)
        _, first, pair_context = np.unique(contexts, axis=0, return_index=True, return_inverse=True)
        size = self.shards
        while size < max(len(first), rows // 4):
            size *= 2
        keep = np.concatenate([first, np.full(min(size, rows) - len(first), first[0])])
        out |= {k: batch[k][keep] for k in encoder}
        out["pair_context"] = pair_context.reshape(-1).astype(np.int32)
        return out

    def _lengths_config(self, lengths: tuple[int, int]) -> ExperimentConfig:
        if lengths not in self._configs:
            self._configs[lengths] = scoring_lengths(self.cfg, lengths)
        return self._configs[lengths]

    def score(
        self, fitted: Fitted, *, start_token: bool = True
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per pair of `fitted`: (logprob, n_tokens, all_correct), every pair whole.
        `start_token=False` (decoder-only): rows without the start token
        (`without_start_token`)."""
        return self.score_parts([fitted], start_token=start_token)[0]

    def score_parts(
        self, parts: list[Fitted], *, start_token: bool = True
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """`score` of each part, all parts' pairs laid out by one plan (they share shapes)."""
        inputs = [x for part in parts for x in part.inputs]
        targets = [t for part in parts for t in part.targets]
        if not start_token and (self.encdec or not all(inputs)):
            raise ScalestudyError(
                "rows without the start token: decoder-only pairs with a context each (the "
                "first context token takes the start token's place)"
            )
        unscored = {part.unscored for part in parts}
        if len(unscored) > 1:  # one objective's form: every part starts its targets alike
            raise ScalestudyError(f"parts fitted with different target prefixes: {unscored}")
        skip = next(iter(unscored), 0)
        n = len(inputs)
        lp, n_tok, correct = np.zeros(n), np.zeros(n, np.int32), np.zeros(n, bool)
        plan = plan_calls(
            parts,
            encdec=self.encdec,
            rows=self.rows,
            bucketed=self.bucketed,
            min_calls=self.min_calls,
        )
        for call in plan:
            pad = np.full(
                call.rows - len(call.pairs), call.pairs[0]
            )  # fill the shape: reuse a pair
            idx = np.concatenate([call.pairs, pad])
            batch, n_cut = scoring_batch(
                self._lengths_config(call.lengths),
                [inputs[i] for i in idx],
                [targets[i] for i in idx],
                unscored=skip,
            )
            if n_cut:  # fit_pairs sized the rows; a cut here is a bug, never a silent result
                raise ScalestudyError(f"scoring rows of {call.lengths} cut {n_cut} pairs")
            if not start_token:
                batch = without_start_token(batch)
            part = self._run(self._distinct_contexts(batch))
            k = len(call.pairs)
            for acc, value in zip((lp, n_tok, correct), part, strict=True):
                acc[call.pairs] = np.asarray(value)[:k]
        bounds = np.cumsum([0, *(len(part.inputs) for part in parts)])
        return [(lp[a:b], n_tok[a:b], correct[a:b]) for a, b in itertools.pairwise(bounds)]

    def __call__(
        self, inputs: list[list[int]], targets: list[list[int]], owner: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """Per pair: (logprob, n_tokens, all_correct) under eval's context rule; and the
        number of examples (pairs grouped by `owner`) whose context was cut."""
        fitted = fit_pairs(self.cfg, inputs, targets)
        lp, n_tok, correct = self.score(fitted)
        return lp, n_tok, correct, len(set(np.asarray(owner)[fitted.cut].tolist()))
