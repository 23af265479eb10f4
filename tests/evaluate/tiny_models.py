"""The tiny configuration the scoring tests build their models from."""

from __future__ import annotations

from scalestudy.config import ExperimentConfig


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
