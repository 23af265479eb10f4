"""The train and eval steps: pure functions, compiled ahead of time with explicit shardings.

The train state is a plain dict `{"step", "params", "opt_state", "rng"}` (`rng` holds the raw
key data of the run seed); dropout keys are derived inside the step from `(rng, step,
microbatch)`. Gradients over `k` microbatches are accumulated inside the compiled step with
`lax.scan`; each microbatch contributes `loss * tokens`, so the result is the gradient of
the mean over all loss-bearing tokens of the global batch, as with one big batch.

`make_multi_step` runs k train steps in one call (`lax.scan` of the same step over k stacked
batches). The scan body is the step itself, so losses and parameters equal those of k single
calls (tests/train/test_steps_per_call.py).

train/program.py compiles these for one run or a group of members; train/loop.py calls them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from scalestudy.config.experiment import ExperimentConfig
from scalestudy.models.api import Model
from scalestudy.train import moe_balance, optim, sharding

State = dict[str, Any]
Batch = Mapping[str, jax.Array]

# Per-step sums the loop turns into means and running totals.
_SUMMED = ("loss", "ce", "z_loss", "accuracy")


def decay_mask(param_axes: Any) -> Any:
    """True for matrices (two or more axes besides a scanned `layers` axis), False otherwise."""
    return jax.tree.map(
        lambda axes: sum(a != "layers" for a in axes) >= 2, param_axes, is_leaf=sharding.is_axes
    )


def stacked_mask(param_axes: Any) -> Any:
    """True for parameters stacked along a leading `layers` axis (scanned layers)."""
    return jax.tree.map(
        lambda axes: bool(axes) and axes[0] == "layers", param_axes, is_leaf=sharding.is_axes
    )


def state_shardings(
    mesh: jax.sharding.Mesh, abstract_state: State, model: Model, param_sh: Any
) -> State:
    """Shardings of the whole state: parameters (and optimizer moments shaped like them) by
    their logical axes; step, RNG and other optimizer statistics replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_sh = sharding.optimizer_state_shardings(
        mesh, abstract_state["opt_state"], abstract_state["params"], model.param_axes()
    )
    return {"step": replicated, "params": param_sh, "opt_state": opt_sh, "rng": replicated}


def _split_microbatches(batch: Batch, k: int, rows: NamedSharding) -> Batch:
    """[B, ...] -> [k, B/k, ...] with microbatch j = rows j, j+k, ...: each device's rows
    feed every microbatch, so no data moves between devices (`rows`: the batch's rows)."""

    def split(x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
        spec = PartitionSpec(None, *rows.spec, *(None,) * (x.ndim - 2))
        return jax.lax.with_sharding_constraint(x, NamedSharding(rows.mesh, spec))

    return {name: split(x) for name, x in batch.items()}


def _microbatch_sums(
    grad_fn: Callable, params: Any, batch: Batch, rng: jax.Array, k: int, rows: NamedSharding
) -> tuple[Any, dict]:
    """(gradients, sums) of `grad_fn` added over `k` microbatches of `batch`, in one scan;
    microbatch i draws its dropout from `fold_in(rng, i)`."""

    def body(carry: tuple, xs: tuple) -> tuple[tuple, None]:
        micro, i = xs
        g, s = grad_fn(params, micro, jax.random.fold_in(rng, i))
        return jax.tree.map(jnp.add, carry, (g, s)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    micro = _split_microbatches(batch, k, rows)
    first = jax.tree.map(lambda x: x[0], micro)
    # The scan's carry needs the sums' shapes before any microbatch has run.
    shapes = jax.eval_shape(grad_fn, params, first, rng)[1]
    sums0 = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    (grads, sums), _ = jax.lax.scan(body, (zeros, sums0), (micro, jnp.arange(k)))
    return grads, sums


def make_train_step(
    cfg: ExperimentConfig,
    model: Model,
    tx: optax.GradientTransformation,
    schedule: optim.Schedule,
    mesh: jax.sharding.Mesh,
    members: str | None = None,
) -> Callable[[State, Batch], tuple[State, dict[str, jax.Array]]]:
    """The pure train step `(state, batch) -> (state, metrics)` of `cfg` (a member's: `members`)."""
    k, z_loss = cfg.train.microbatches, cfg.train.z_loss
    summed = (*_SUMMED, "moe_aux_loss") if cfg.model.moe.enabled else _SUMMED

    def weighted_loss(params: Any, batch: Batch, rng: jax.Array) -> tuple[jax.Array, dict]:
        loss, aux = model.loss(params, batch, rng, z_loss=z_loss, deterministic=False)
        tokens = jax.lax.stop_gradient(aux["tokens"])
        sums = {"loss": loss * tokens, **{m: aux[m] * tokens for m in summed[1:]}}
        if "moe" in aux:  # MoE measurements: counts, summed over microbatches
            sums["moe"] = aux["moe"]
        sums = jax.lax.stop_gradient(sums)
        # One batch: the mean loss's gradient directly, so no pass divides every gradient by
        # the token count afterwards (microbatches sum token-weighted gradients, then divide).
        objective = loss if k == 1 else loss * tokens
        return objective, {**sums, "tokens": tokens, "positions": aux["positions"]}

    grad_fn = jax.grad(weighted_loss, has_aux=True)

    def train_step(state: State, batch: Batch) -> tuple[State, dict[str, jax.Array]]:
        params = state["params"]
        rng = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
        if k == 1:
            grads, sums = grad_fn(params, batch, jax.random.fold_in(rng, 0))
        else:
            rows = sharding.batch_sharding(mesh, members)
            grads, sums = _microbatch_sums(grad_fn, params, batch, rng, k, rows)
        denom = jnp.maximum(sums["tokens"], 1.0)
        if k > 1:
            grads = jax.tree.map(lambda g: g / denom, grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        params = optax.apply_updates(params, updates)
        metrics = {f"train/{m}": sums[m] / denom for m in summed}
        if "moe" in sums:  # balancing biases follow the step's loads, not the optimizer
            before = state["params"]
            params, moe_metrics = moe_balance.rebalance(model, params, before, sums["moe"], k)
            metrics |= moe_metrics
        metrics |= {
            "train/grad_norm": optax.global_norm(grads),
            "train/param_norm": optax.global_norm(params),
            "lr": schedule(state["step"]),
            "step_tokens": sums["tokens"],
            "step_positions": sums["positions"],
        }
        new_state = {**state, "step": state["step"] + 1, "params": params, "opt_state": opt_state}
        return new_state, metrics

    return train_step


def make_multi_step(
    train_step: Callable[[State, Batch], tuple[State, dict[str, jax.Array]]],
) -> Callable[[State, Batch], tuple[State, dict[str, jax.Array]]]:
    """`(state, batches) -> (state, metrics)`: one train step per leading index of `batches`
    ([k, B, ...] features), in order; each metric gains a leading axis of k steps."""

    def multi_step(state: State, batches: Batch) -> tuple[State, dict[str, jax.Array]]:
        return jax.lax.scan(train_step, state, batches)

    return multi_step


def make_eval_step(cfg: ExperimentConfig, model: Model) -> Callable[[Any, Batch], dict]:
    """`(params, batch) -> sums` of loss, ce and accuracy weighted by tokens, and tokens."""

    def eval_step(params: Any, batch: Batch) -> dict[str, jax.Array]:
        loss, aux = model.loss(params, batch, None, z_loss=cfg.train.z_loss, deterministic=True)
        t = aux["tokens"]
        return {"loss": loss * t, "ce": aux["ce"] * t, "accuracy": aux["accuracy"] * t, "tokens": t}

    return eval_step


def init_state(model: Model, tx: optax.GradientTransformation, seed: jax.Array) -> State:
    key = jax.random.key(seed)
    init_key, dropout_key = jax.random.split(key)
    params = model.init(init_key)
    return {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt_state": tx.init(params),
        "rng": jax.random.key_data(dropout_key),
    }
