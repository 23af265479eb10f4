"""The train and eval steps: pure functions, compiled ahead of time with explicit shardings.

The train state is a plain dict `{"step", "params", "opt_state", "rng"}` (`rng` holds the raw
key data of the run seed); dropout keys are derived inside the step from `(rng, step,
microbatch)`. Gradients over `k` microbatches are accumulated inside the compiled step with
`lax.scan`; each microbatch contributes `loss * tokens`, so the result is the gradient of
the mean over all loss-bearing tokens of the global batch, as with one big batch.

With `train.steps_per_call: k > 1` the program also holds `multi_step`, which runs k train
steps in one call (`lax.scan` of the same step over k stacked batches). The scan body is the
step itself, so losses and parameters equal those of k single calls
(tests/train/test_steps_per_call.py).

`build_program(cfg, example_batch)` returns a `Program` of compiled functions for one
(config, shapes, mesh); equal inputs in the same process reuse the compiled program.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from scalestudy.config.experiment import ExperimentConfig
from scalestudy.models import attention, moe
from scalestudy.models.api import Model, build_model
from scalestudy.train import datasheets, optim, sharding

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
            params, moe_metrics = moe.after_update(model, params, state["params"], sums["moe"], k)
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


class CompiledOnFirstCall:
    """A jitted step compiled, under the mesh's axis rules, when first called. With
    `steps_per_call` > 1 the single step runs only where a log, hook or stop step breaks a
    call, which many runs never meet; compiling it up front cost them a program each."""

    def __init__(self, jitted: Any, mesh: Any, *abstract_args: Any, members: Any = None) -> None:
        self.jitted, self.mesh, self.abstract_args = jitted, mesh, abstract_args
        self.members, self.compiled = members, None  # members: as sharding.axis_rules takes

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            with sharding.axis_rules(self.mesh, self.members):
                self.compiled = self.jitted.lower(*self.abstract_args).compile()
        return self.compiled(*args)


@dataclasses.dataclass
class Program:
    """Compiled functions and shardings for one (config, batch shapes, mesh)."""

    model: Model
    mesh: jax.sharding.Mesh
    schedule: optim.Schedule
    abstract_state: State
    state_sharding: State
    batch_sharding: NamedSharding
    init_fn: Any  # (seed: int32[]) -> State, created sharded
    train_step: Any  # (State, Batch) -> (State, metrics); donates the state
    eval_step: Any  # (params, Batch) -> sums
    compile_s: float
    # (State, stacked Batch [k, B, ...]) -> (State, metrics [k]); None when k is 1.
    multi_step: Any = None
    steps_per_call: int = 1

    def init(self, seed: int) -> State:
        """A fresh state: parameters from `seed`, dropout keys from `seed` too."""
        return self.init_fn(np.asarray(seed, np.int32))

    def shard_batch(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        return sharding.shard_batch(self.mesh, dict(batch))

    def shard_batches(self, batches: list[Mapping[str, np.ndarray]]) -> dict[str, jax.Array]:
        """`steps_per_call` host batches stacked into [k, B, ...] global arrays for
        `multi_step` (rows split over the mesh as `shard_batch` splits them)."""
        return _shard_stacked(self.mesh, batches)


def enable_compilation_cache() -> None:
    """Persist compiled programs across processes (a run re-launched after preemption, the
    next study), in $SCALESTUDY_JAX_CACHE or ~/.cache/scalestudy/jax, unless the user
    configured a JAX cache already."""
    if jax.config.jax_compilation_cache_dir:
        return
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "scalestudy/jax"
    path = Path(os.environ.get("SCALESTUDY_JAX_CACHE", default))
    with contextlib.suppress(OSError):
        path.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.3)


# glibc malloc settings for a CPU host (mallopt parameter numbers): keep freed memory instead of
# handing it back to the kernel after every step, which then faults it in again page by page
# (fewer page faults and less system time per run: docs/performance.md, "Allocator").
_MALLOPT = {
    "MALLOC_TRIM_THRESHOLD_": (-1, 1 << 30),
    "MALLOC_TOP_PAD_": (-2, 1 << 28),
    "MALLOC_MMAP_THRESHOLD_": (-3, 1 << 25),  # 32 MiB, glibc's largest
}


def tune_host_allocator() -> dict[str, int]:
    """On a CPU backend with glibc, raise malloc's trim, top-pad and mmap thresholds (each
    unless its MALLOC_*_ variable is set); returns the settings applied (none elsewhere)."""
    if jax.default_backend() != "cpu":
        return {}
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return {}
    applied = {}
    for name, (param, value) in _MALLOPT.items():
        if name not in os.environ and mallopt(param, value) == 1:
            applied[name] = value
    return applied


def _stacked_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(None, *sharding.batch_sharding(mesh).spec))


def _shard_stacked(
    mesh: jax.sharding.Mesh, batches: list[Mapping[str, np.ndarray]]
) -> dict[str, jax.Array]:
    stacked_sh = _stacked_sharding(mesh)
    out = {}
    for name in batches[0]:
        local = np.stack([np.asarray(b[name]) for b in batches])
        out[name] = sharding.global_rows(stacked_sh, local, 1)
    return out


_PROGRAMS: OrderedDict[str, Program] = OrderedDict()
_MAX_PROGRAMS = 8


def _program_key(cfg: ExperimentConfig, shapes: dict, mesh: jax.sharding.Mesh) -> str:
    parts = (
        cfg.model.model_dump_json(),
        cfg.optim.model_dump_json(),
        cfg.train.steps,
        cfg.train.microbatches,
        cfg.train.steps_per_call,
        cfg.train.z_loss,
        sorted(shapes.items()),
        tuple(mesh.shape.items()),
        tuple(d.id for d in mesh.devices.flat),
        attention.causal_block_rows(),  # shapes the traced attention, not in the config
    )
    return repr(parts)


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


class _Steps(NamedTuple):
    """A program's jitted functions (compiled, or not yet)."""

    init: Any
    train_step: Any
    eval_step: Any
    multi_step: Any  # None when steps_per_call is 1


def _global_shapes(example_batch: Mapping[str, Any]) -> dict[str, tuple[tuple, str]]:
    """{feature: (global shape, dtype name)}: this process's rows, times the process count."""
    processes = jax.process_count()
    return {
        k: ((np.shape(v)[0] * processes, *np.shape(v)[1:]), str(np.asarray(v).dtype))
        for k, v in example_batch.items()
    }


def _optimizer(cfg: ExperimentConfig, model: Model) -> tuple[Any, optim.Schedule]:
    return optim.make_optimizer(
        cfg.optim,
        optim.schedule_steps(cfg.optim, cfg.train.steps),
        decay_mask=decay_mask(model.param_axes()),
        stacked=stacked_mask(model.param_axes()),
        axes=model.param_axes(),
    )


def _sharded_abstract_state(
    mesh: jax.sharding.Mesh, model: Model, tx: optax.GradientTransformation
) -> tuple[State, State, Any]:
    """(the abstract state carrying its shardings, the state's shardings, the parameters')."""
    param_sh = sharding.param_shardings(mesh, model.param_axes())
    seed = jax.ShapeDtypeStruct((), jnp.int32)
    abstract = jax.eval_shape(lambda s: init_state(model, tx, s), seed)
    state_sh = state_shardings(mesh, abstract, model, param_sh)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_sh
    )
    return abstract, state_sh, param_sh


def _jit_steps(
    cfg: ExperimentConfig,
    model: Model,
    tx: optax.GradientTransformation,
    schedule: optim.Schedule,
    mesh: jax.sharding.Mesh,
    shardings: tuple[State, Any, NamedSharding],
) -> _Steps:
    """The program's functions jitted with their shardings (`shardings`: the state's, the
    parameters' and the batch's); the train steps donate the state."""
    state_sh, param_sh, batch_sh = shardings
    replicated = NamedSharding(mesh, PartitionSpec())
    # The seed is an argument, so runs that differ only in seed share one program.
    init = jax.jit(lambda s: init_state(model, tx, s), out_shardings=state_sh)
    one_step = make_train_step(cfg, model, tx, schedule, mesh)
    train_step = jax.jit(
        one_step,
        in_shardings=(state_sh, batch_sh),
        out_shardings=(state_sh, replicated),
        donate_argnums=0,
    )
    multi_step = None
    # k steps to a call: a small model's step is short enough that the per-call costs
    # (dispatch, argument handling, waking the thread pool) are a visible share of it
    # (docs/performance.md#small-models-on-cpu).
    if cfg.train.steps_per_call > 1:
        multi_step = jax.jit(
            make_multi_step(one_step),
            in_shardings=(state_sh, _stacked_sharding(mesh)),
            out_shardings=(state_sh, replicated),
            donate_argnums=0,
        )
    eval_step = jax.jit(
        make_eval_step(cfg, model),
        in_shardings=(param_sh, batch_sh),
        out_shardings=replicated,
    )
    return _Steps(init, train_step, eval_step, multi_step)


def _compile_steps(
    cfg: ExperimentConfig,
    mesh: jax.sharding.Mesh,
    jitted: _Steps,
    abstract: State,
    shapes: dict[str, tuple[tuple, str]],
    batch_sh: NamedSharding,
) -> _Steps:
    """`jitted` compiled for the global batch `shapes`, in the order init, train step, eval
    step, multi-step; the program is then checked against the chips' memory."""
    abstract_batch = {
        k: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sh)
        for k, (shape, dtype) in shapes.items()
    }
    init, train_step, eval_step, multi_step = jitted
    with sharding.axis_rules(mesh):
        init = init.lower(jax.ShapeDtypeStruct((), jnp.int32)).compile()
        if multi_step is None:
            train_step = train_step.lower(abstract, abstract_batch).compile()
        else:
            train_step = CompiledOnFirstCall(train_step, mesh, abstract, abstract_batch)
        eval_step = eval_step.lower(abstract["params"], abstract_batch).compile()
        if multi_step is not None:
            stacked_sh = _stacked_sharding(mesh)
            k = cfg.train.steps_per_call
            abstract_stacked = {
                name: jax.ShapeDtypeStruct((k, *shape), dtype, sharding=stacked_sh)
                for name, (shape, dtype) in shapes.items()
            }
            multi_step = multi_step.lower(abstract, abstract_stacked).compile()
    datasheets.check_fits(cfg, multi_step or train_step, mesh)
    return _Steps(init, train_step, eval_step, multi_step)


def _remember(key: str, program: Program) -> None:
    """Keep `program` for reuse, dropping the least recently used past `_MAX_PROGRAMS`."""
    _PROGRAMS[key] = program
    while len(_PROGRAMS) > _MAX_PROGRAMS:
        _PROGRAMS.popitem(last=False)


def build_program(
    cfg: ExperimentConfig,
    example_batch: Mapping[str, Any],
    mesh: jax.sharding.Mesh | None = None,
    *,
    compile: bool = True,
) -> Program:
    """Build (or reuse) the compiled program for `cfg` and batches shaped like `example_batch`.

    `example_batch` holds this process's rows (what the data iterator yields); the program is
    compiled for the global batch, whose rows come from every process. With `compile=False`
    the functions are jitted but not compiled (for AOT inspection).
    """
    enable_compilation_cache()
    tune_host_allocator()
    mesh = (
        mesh if mesh is not None else sharding.make_mesh(cfg.mesh, model=cfg.model, batch=cfg.train)
    )
    shapes = _global_shapes(example_batch)
    key = _program_key(cfg, shapes, mesh)
    if compile and key in _PROGRAMS:
        _PROGRAMS.move_to_end(key)
        return dataclasses.replace(_PROGRAMS[key], compile_s=0.0)

    model = build_model(cfg.model)
    tx, schedule = _optimizer(cfg, model)
    abstract, state_sh, param_sh = _sharded_abstract_state(mesh, model, tx)
    batch_sh = sharding.batch_sharding(mesh)
    steps = _jit_steps(cfg, model, tx, schedule, mesh, (state_sh, param_sh, batch_sh))
    t0 = time.perf_counter()
    if compile:
        steps = _compile_steps(cfg, mesh, steps, abstract, shapes, batch_sh)
    program = Program(
        model=model,
        mesh=mesh,
        schedule=schedule,
        abstract_state=abstract,
        state_sharding=state_sh,
        batch_sharding=batch_sh,
        init_fn=steps.init,
        train_step=steps.train_step,
        eval_step=steps.eval_step,
        compile_s=time.perf_counter() - t0,
        multi_step=steps.multi_step,
        steps_per_call=cfg.train.steps_per_call,
    )
    if compile:
        _remember(key, program)
    return program
