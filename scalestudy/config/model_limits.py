"""Sizes a model config may not exceed, whatever the machine: checked when the config is
read (config/experiment.py), before anything is built or written."""

from __future__ import annotations

import math
from typing import Any

from scalestudy.config.errors import ConfigError

MAX_DIM = 2**31 - 1  # a size XLA's int32 indices and positions reach on every platform
# A parameter's elements are numbered in 32 bits as it is initialised (models/layers.py
# ParamInit): one of more elements would fail to initialise, or repeat its draws.
MAX_PARAM_ELEMENTS = 2**32


def check_param_sizes(model: Any) -> None:
    """Refuse a parameter of the ModelConfig `model` of more than MAX_PARAM_ELEMENTS
    elements, naming the sizes whose product it is (before anything is built: the
    initialiser would fail on it)."""
    d, h = model.d_model, model.n_heads
    head = "model.d_kv" if model.d_kv is not None else "head width (d_model/n_heads)"
    weights = {  # what: {size: value}, whose product is its number of elements
        "the embedding": {"model.vocab_size": model.vocab_size, "model.d_model": d},
        "an attention weight": {"model.d_model": d, "model.n_heads": h, head: model.head_dim},
        "a feed-forward weight": {"model.d_model": d, "model.d_ff": model.d_ff},
        # two halves in prefix mode (models/layers.py RelativePositionBias)
        "the relative-position table": {
            "rows (2 x model.rel_buckets)": 2 * model.rel_buckets,
            "model.n_heads": h,
        },
    }
    if model.moe.enabled:
        for key in ("routed_experts", "shared_experts"):
            weights[f"the {key.replace('_', ' ')}' weight"] = {
                f"model.moe.{key}": getattr(model.moe, key),
                "model.d_model": d,
                "expert width": model.moe.width(model.d_ff),
            }
    for what, sizes in weights.items():
        if (n := math.prod(sizes.values())) > MAX_PARAM_ELEMENTS:
            named = " x ".join(f"{k}={v}" for k, v in sizes.items())
            raise ConfigError(
                f"{named} make {what} of {n:,} elements; one parameter holds at most "
                f"{MAX_PARAM_ELEMENTS:,} (its elements are numbered in 32 bits as it is "
                "initialised): lower these sizes"
            )
