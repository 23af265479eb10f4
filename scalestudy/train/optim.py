"""Optimizers and learning-rate schedules from `OptimConfig`.

Schedules map the 0-based update count (the number of updates already applied) to a
learning rate. `warmup_steps` W ramps linearly, `(step + 1) / W`, so the first update is
not wasted; the exception is `rsqrt`, where W is the constant phase of T5 / Wang et al.
(2022): `lr * sqrt(W / max(step, W))`, i.e. 0.01 until step 10k and `1/sqrt(step)` after
with `learning_rate=0.01, warmup_steps=10000`.

Decays run over `progress = (step - start) / length` in [0, 1] and end at
`final_lr_fraction * learning_rate`:

- linear, cosine: start = W, length = total - W;
- wsd (warmup-stable-decay, Hägele et al. 2024): stable at the peak, then a cooldown of
  `cooldown_steps` (or `cooldown_fraction * total`) steps ending at `total`, shaped
  linear `1 - p`, sqrt `1 - sqrt(p)` or cosine `(1 + cos(pi p)) / 2`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import OptimConfig

Schedule = Callable[[jax.Array | int], jax.Array]


def _concrete(*values: Any) -> bool:
    """Whether every value is a Python number. A member of a group (train/members.py) gets
    its differing hyperparameters as traced scalars, so the schedule cannot branch on them."""
    return all(isinstance(v, int | float) for v in values)


def _max(a: Any, b: Any) -> Any:
    return max(a, b) if _concrete(a, b) else jnp.maximum(a, b)


def _warmup_factor(step: jax.Array, warmup: Any) -> jax.Array:
    if not _concrete(warmup):
        ramp = jnp.minimum(1.0, (step + 1.0) / jnp.maximum(warmup, 1))
        return jnp.where(warmup > 0, ramp, 1.0)
    if warmup <= 0:
        return jnp.ones_like(step, jnp.float32)
    return jnp.minimum(1.0, (step + 1.0) / warmup)


def _progress(step: jax.Array, start: Any, length: Any) -> jax.Array:
    return jnp.clip((step - start) / _max(length, 1), 0.0, 1.0)


def _decay(p: jax.Array, shape: str, final: float) -> jax.Array:
    """Factor going from 1 at p=0 to `final` at p=1."""
    if shape == "linear":
        unit = 1.0 - p
    elif shape == "sqrt":
        unit = 1.0 - jnp.sqrt(p)
    else:  # cosine
        unit = 0.5 * (1.0 + jnp.cos(jnp.pi * p))
    return final + (1.0 - final) * unit


def cooldown_steps(cfg: OptimConfig, total_steps: int) -> int:
    """Length of the WSD cooldown for a run of `total_steps` updates."""
    if cfg.cooldown_steps is not None:
        if not _concrete(cfg.cooldown_steps):
            return jnp.minimum(cfg.cooldown_steps, total_steps)
        return min(cfg.cooldown_steps, total_steps)
    if not _concrete(cfg.cooldown_fraction):
        return jnp.maximum(1, jnp.round(cfg.cooldown_fraction * total_steps))
    return max(1, round(cfg.cooldown_fraction * total_steps))


def _check_lengths(cfg: OptimConfig, total_steps: int, warmup: int, cooldown: int) -> None:
    if cfg.schedule in ("linear", "cosine", "wsd") and warmup >= total_steps:
        raise ConfigError(
            f"optim.warmup_steps={warmup} must be smaller than train.steps={total_steps} "
            f"for schedule {cfg.schedule!r}"
        )
    if cfg.schedule == "wsd" and total_steps - cooldown < warmup:
        raise ConfigError(
            f"optim: the wsd cooldown ({cooldown} steps) overlaps the warmup "
            f"({warmup} steps) in a run of {total_steps} steps; shorten one of them"
        )


def check_schedule(cfg: OptimConfig, train_steps: int) -> None:
    """Raise ConfigError where `cfg`'s schedule cannot be laid over a run of `train_steps`
    (warmup not shorter than the run, a wsd cooldown overlapping the warmup)."""
    total = schedule_steps(cfg, train_steps)
    _check_lengths(cfg, total, cfg.warmup_steps, cooldown_steps(cfg, total))


def schedule_steps(cfg: OptimConfig, train_steps: int) -> int:
    """The updates a run's schedule is laid over: `optim.schedule_steps`, else the run's."""
    return cfg.schedule_steps if cfg.schedule_steps is not None else train_steps


def make_schedule(cfg: OptimConfig, total_steps: int) -> Schedule:
    """The learning-rate schedule of `cfg` for a run of `total_steps` updates. Its numbers
    may be traced scalars (a group's members); they are checked where they are concrete."""
    peak, warmup, final = cfg.learning_rate, cfg.warmup_steps, cfg.final_lr_fraction
    cooldown = cooldown_steps(cfg, total_steps)
    if _concrete(warmup, cooldown):  # a member's own config was checked when it was planned
        _check_lengths(cfg, total_steps, warmup, cooldown)

    def schedule(step: jax.Array | int) -> jax.Array:
        step = jnp.asarray(step, jnp.float32)
        if cfg.schedule == "constant":
            factor = _warmup_factor(step, warmup)
        elif cfg.schedule == "rsqrt":
            w = _max(warmup, 1)
            factor = jnp.sqrt(w / jnp.maximum(step, w))
        elif cfg.schedule in ("linear", "cosine"):
            p = _progress(step, warmup, total_steps - warmup)
            factor = _warmup_factor(step, warmup) * _decay(p, cfg.schedule, final)
        else:  # wsd
            p = _progress(step, total_steps - cooldown, cooldown)
            factor = _warmup_factor(step, warmup) * _decay(p, cfg.cooldown_shape, final)
        return (peak * factor).astype(jnp.float32)

    return schedule


def t5x_shape(shape: tuple[int, ...], axes: tuple[str | None, ...]) -> tuple[int, ...]:
    """The shape T5X stores a tensor of logical `axes` in: adjacent `heads` and `kv` axes are
    one joined axis. T5X's attention kernels are 2-D, [embed, heads*kv] and [heads*kv, embed]
    (its DenseGeneral reshapes them for the matmul), and Adafactor factors those matrices."""
    if len(shape) != len(axes):
        raise ValueError(f"shape {shape} and logical axes {axes} differ in rank")
    out: list[int] = []
    for i, (n, name) in enumerate(zip(shape, axes)):
        if name == "kv" and i > 0 and axes[i - 1] == "heads":
            out[-1] *= n
        else:
            out.append(n)
    return tuple(out)


def as_t5x_matrix(
    tx: optax.GradientTransformation, axes: tuple[str | None, ...]
) -> optax.GradientTransformation:
    """`tx` applied to one tensor of logical `axes` seen in T5X's shape (`t5x_shape`); the
    optimizer state keeps that shape, the updates come back in the tensor's own."""

    def init(p: jax.Array) -> Any:
        return tx.init(p.reshape(t5x_shape(p.shape, axes)))

    def update(g: jax.Array, state: Any, p: jax.Array | None = None) -> tuple[jax.Array, Any]:
        shape = t5x_shape(g.shape, axes)
        u, state = tx.update(g.reshape(shape), state, None if p is None else p.reshape(shape))
        return u.reshape(g.shape), state

    return optax.GradientTransformation(init, update)


def per_tensor(
    make: Callable[[bool], optax.GradientTransformation],
    stacked: Any,
    decay: Any,
    axes: Any = None,
) -> optax.GradientTransformation:
    """Run a per-tensor optimizer on each parameter by itself, and on each layer's slice of
    a parameter stacked along a leading `layers` axis (scanned layers).

    `make(decays)` builds the optimizer for one tensor; `stacked` and `decay` are
    params-shaped trees of bools. Adafactor's statistics (which dims to factor, the
    parameter RMS that scales updates, the update RMS it clips) are per tensor: without
    this, a scanned model would pool them over all layers, unlike T5X's per-layer tensors.
    `axes` (params-shaped tree of logical-axis tuples, or None) makes each tensor seen in
    T5X's shape (`as_t5x_matrix`), e.g. attention kernels as 2-D [embed, heads*kv].
    """
    if axes is None:
        axes = jax.tree.map(lambda _: None, stacked)

    def leaf(is_stacked: bool, decays: bool, boxed: _Axes) -> optax.GradientTransformation:
        tx = make(decays)
        if boxed.names is not None:
            names = boxed.names
            tx = as_t5x_matrix(tx, tuple(names[1:] if is_stacked else names))
        return (
            optax.GradientTransformation(jax.vmap(tx.init), jax.vmap(tx.update))
            if is_stacked
            else tx
        )

    def init(params: Any) -> Any:
        return jax.tree.map(
            lambda p, s, d, a: leaf(s, d, a).init(p), params, stacked, decay, _boxed(axes)
        )

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        if params is None:
            raise ValueError("per_tensor optimizers need the parameters in update()")
        pairs = jax.tree.map(
            lambda g, st, p, s, d, a: leaf(s, d, a).update(g, st, p),
            updates,
            state,
            params,
            stacked,
            decay,
            _boxed(axes),
        )
        return (
            jax.tree.map(lambda _, pair: pair[0], updates, pairs),
            jax.tree.map(lambda _, pair: pair[1], updates, pairs),
        )

    return optax.GradientTransformation(init, update)


class _Axes:
    """A tuple of logical axis names (or None) held as one pytree leaf."""

    def __init__(self, names: tuple[str | None, ...] | None) -> None:
        self.names = names


def _boxed(axes: Any) -> Any:
    """`axes` with each tuple of names (or None) wrapped as a single leaf."""
    return jax.tree.map(
        _Axes,
        axes,
        is_leaf=lambda x: (
            x is None or (isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x))
        ),
    )


def make_optimizer(
    cfg: OptimConfig,
    total_steps: int,
    decay_mask: Any = None,
    stacked: Any = None,
    axes: Any = None,
) -> tuple[optax.GradientTransformation, Schedule]:
    """(optimizer, schedule) for `cfg`: global-norm clipping, then AdamW or Adafactor.

    `decay_mask` (a params-shaped tree of bools, or None for all) selects the parameters
    that receive weight decay; the loop passes "matrices only". `stacked` (a params-shaped
    tree of bools) marks parameters stacked along a leading layers axis, which Adafactor
    treats layer by layer (see `per_tensor`). `axes` (the parameters' logical axis names)
    lets Adafactor see each tensor as T5X stores it, so it factors the same matrices
    (`t5x_shape`); `stacked` defaults to "leading axis is `layers`" when `axes` is given.
    """
    schedule = make_schedule(cfg, total_steps)
    parts: list[optax.GradientTransformation] = []
    if cfg.grad_clip_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip_norm))
    if cfg.name == "adamw":
        parts.append(
            optax.adamw(
                schedule,
                b1=cfg.b1,
                b2=cfg.b2,
                eps=cfg.eps,
                weight_decay=cfg.weight_decay,
                mask=decay_mask,
            )
        )
    else:
        # Wang et al. (2022) / T5X: factored second moments with decay step^-0.8, updates
        # clipped to RMS 1 and scaled by each parameter's RMS, no momentum.
        def adafactor(decays: bool) -> optax.GradientTransformation:
            return optax.adafactor(
                schedule,
                decay_rate=cfg.decay_rate,
                factored=cfg.factored,
                multiply_by_parameter_scale=cfg.multiply_by_parameter_scale,
                clipping_threshold=cfg.clipping_threshold,
                weight_decay_rate=(cfg.weight_decay or None) if decays else None,
            )

        if axes is not None and stacked is None:
            stacked = jax.tree.map(lambda a: (a.names or ("",))[0] == "layers", _boxed(axes))
        if stacked is None:
            parts.append(
                adafactor(True) if decay_mask is None else _masked_decay(adafactor, decay_mask)
            )
        else:
            decay = decay_mask if decay_mask is not None else jax.tree.map(lambda _: True, stacked)
            parts.append(per_tensor(adafactor, stacked, decay, axes))
    return optax.chain(*parts), schedule


def _masked_decay(
    make: Callable[[bool], optax.GradientTransformation], decay_mask: Any
) -> optax.GradientTransformation:
    """`make` with weight decay only where `decay_mask` is True (no stacked layers)."""
    return per_tensor(make, jax.tree.map(lambda _: False, decay_mask), decay_mask)
