"""The tiny configuration the scoring tests build their models from."""

from __future__ import annotations

import jax
import numpy as np

from scalestudy.config.experiment import ExperimentConfig


def tiny(arch: str, objective: str, batch_size: int = 8, **eval_cfg) -> ExperimentConfig:
    """A 2-layer, d_model 32 float32 model of `arch` trained with `objective`, rows of 24 + 8
    positions, scoring `batch_size` rows to a call (other `eval` keys from `eval_cfg`)."""
    return ExperimentConfig.model_validate(
        {
            "model": {
                "arch": arch,
                "d_model": 32,
                "n_layers": 2,
                "n_heads": 2,
                "d_ff": 64,
                "dtype": "float32",
            },
            "objective": {"name": objective, "inputs_length": 24, "targets_length": 8},
            "eval": {"batch_size": batch_size, **eval_cfg},
        }
    )


def reference_logprob(cfg, model, params, contexts, targets) -> np.ndarray:
    """Sums of log p(target) from Model.apply + log_softmax on a hand-made batch without
    padding (all contexts of one length, all targets of another)."""
    rows = lambda xs: np.asarray(xs, np.int32)
    if cfg.model.is_encoder_decoder:
        batch = {"encoder_input_tokens": rows(contexts), "decoder_target_tokens": rows(targets)}
        batch["decoder_input_tokens"] = rows([[0, *t[:-1]] for t in targets])
        first = 0
    else:
        full = [c + t for c, t in zip(contexts, targets)]
        batch = {"decoder_target_tokens": rows(full)}
        batch["decoder_input_tokens"] = rows([[0, *f[:-1]] for f in full])
        # seqio's prefix: every input position up to the one that reads the last context token.
        n_ctx, n_tgt = len(contexts[0]), len(targets[0])
        batch["decoder_causal_attention"] = rows(
            [[1] * (n_ctx + 1) + [0] * (n_tgt - 1)] * len(full)
        )
        first = n_ctx
    logp = jax.nn.log_softmax(jax.jit(model.apply)(params, batch), axis=-1)
    return np.array(
        [sum(logp[b, first + j, tok] for j, tok in enumerate(t)) for b, t in enumerate(targets)]
    )
