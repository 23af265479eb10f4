"""DeepSeek-V3's auxiliary-loss-free balancing, the train step's last word on MoE layers: each
layer's router bias moves against its experts' loads after every optimizer update (the bias
has no gradient, so the optimizer must not move it), and the per-layer load metrics.

The layer itself (routing, experts, capacity) is models/moe.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp


def keep_router_bias(params: Any, before: Any) -> Any:
    """`params` with every "router_bias" leaf taken from `before` (the balancing biases the
    optimizer must not move)."""

    def pick(path: tuple, new: jax.Array, old: jax.Array) -> jax.Array:
        return old if getattr(path[-1], "key", None) == "router_bias" else new

    return jax.tree_util.tree_map_with_path(pick, params, before)


def balance(model: Any, params: Any, load: Mapping[str, jax.Array]) -> Any:
    """`params` with each MoE layer's balancing bias (DeepSeek-V3's auxiliary-loss-free
    balancing) moved by `model.moe.bias_rate * sign(mean load - load)`, from `load`: per
    stack, the assignments each expert received [MoE layers, E] (the "load_E" of the
    `loss` measurements). Without a deepseek router, `params` unchanged."""
    m = model.cfg.moe
    if not m.enabled or m.router != "deepseek" or m.bias_rate == 0:
        return params
    params = jax.tree.map(lambda x: x, params)  # a copy of the dict structure

    def moved(bias: jax.Array, load_E: jax.Array) -> jax.Array:
        step = m.bias_rate * jnp.sign(load_E.mean(axis=-1, keepdims=True) - load_E)
        return bias + step.astype(bias.dtype)

    for name, index in model.moe_layers().items():
        stack = params[name]
        if "layers" in stack:  # scanned: every layer an MoE layer, biases stacked [N, E]
            mlp = stack["layers"]["mlp"]
            mlp["router_bias"] = moved(mlp["router_bias"], load[name])
            continue
        for j, i in enumerate(index):
            mlp = stack[f"layer_{i}"]["mlp"]
            mlp["router_bias"] = moved(mlp["router_bias"], load[name][j])
    return params


def router_biases(model: Any, params: Any) -> dict[str, jax.Array]:
    """Each MoE layer's balancing bias [E] by layer name ("<stack>_<layer>", as in
    `layer_metrics`); empty without a deepseek router."""
    if not model.cfg.moe.enabled or model.cfg.moe.router != "deepseek":
        return {}
    out = {}
    for name, index in model.moe_layers().items():
        stack = params[name]
        for j, i in enumerate(index):
            if "layers" in stack:  # scanned: biases stacked [N, E]
                out[f"{name}_{i}"] = stack["layers"]["mlp"]["router_bias"][j]
            else:
                out[f"{name}_{i}"] = stack[f"layer_{i}"]["mlp"]["router_bias"]
    return out


def layer_metrics(model: Any, moe: Mapping[str, Mapping[str, jax.Array]]) -> dict[str, jax.Array]:
    """Scalar metrics of the `loss` measurements `moe`: per MoE layer, the busiest
    expert's load over the mean load ("load_max"), the share of assignments dropped
    ("dropped") and the router's mean entropy in nats ("entropy")."""
    out = {}
    for name, index in model.moe_layers().items():
        stats = moe[name]
        load_NE = stats["load_E"]
        ratio_N = load_NE.max(axis=-1) / jnp.maximum(load_NE.mean(axis=-1), 1e-9)
        dropped_N = stats["dropped"] / jnp.maximum(stats["assignments"], 1.0)
        for j, i in enumerate(index):
            out[f"moe/{name}_{i}/load_max"] = ratio_N[j]
            out[f"moe/{name}_{i}/dropped"] = dropped_N[j]
            out[f"moe/{name}_{i}/entropy"] = stats["entropy"][j]
    return out


def rebalance(model: Any, params: Any, before: Any, sums: dict, microbatches: int) -> tuple:
    """A train step's last word on MoE layers: (params with every balancing bias moved by the
    step's loads from where it was before the update, whatever the optimizer did with it (it
    has no gradient), and the per-layer metrics as per-microbatch means, with the range of
    each layer's moved biases, "bias_min" and "bias_max")."""
    load = {name: stats["load_E"] for name, stats in sums.items()}
    params = balance(model, keep_router_bias(params, before), load)
    metrics = layer_metrics(model, jax.tree.map(lambda x: x / microbatches, sums))
    for layer, bias_E in router_biases(model, params).items():
        metrics[f"moe/{layer}/bias_min"] = bias_E.min()
        metrics[f"moe/{layer}/bias_max"] = bias_E.max()
    return params, metrics
