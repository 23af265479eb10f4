"""A group's compiled program: the single run's train step over a leading member axis of the
train state, the batches and the members' differing optimizer numbers (which the step
receives as traced scalars). Which runs may be members is train/members.py; the loop over the
members' run directories is train/group.py.

The step goes over the member axis in one of two ways (`mesh.member_program`, `program_kind`):
under `jax.vmap`, every operation K members wide, or as a loop (`jax.lax.map`) running the
members' steps one after another inside the one program.

The member axis is whole on every device group by default (each member's rows split over the
batch axes as a run's are). With `mesh.members: data` it is split over the data axis instead:
each data slice of the mesh holds whole members (their state and their rows, the rows split
over the remaining batch axes), and the step's activation constraints give that mesh axis to
the member axis (`jax.vmap(..., spmd_axis_name=...)`, `sharding.rules(..., members=...)`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from scalestudy.config.experiment import ExperimentConfig
from scalestudy.models.api import Model, build_model
from scalestudy.train import datasheets, optim, sharding, step
from scalestudy.train.members import check, hyperparameters


def _with_member_axis(sh: NamedSharding, axis: str | None) -> NamedSharding:
    return NamedSharding(sh.mesh, PartitionSpec(axis, *sh.spec))


@dataclasses.dataclass
class GroupProgram:
    """Compiled functions of a group of `size` members: every array carries a leading
    member axis (state, batches, metrics); `hyper` holds the members' differing optimizer
    numbers, passed to every step."""

    model: Model
    mesh: jax.sharding.Mesh
    member_axis: str | None  # the mesh axis the member axis is split over (None: whole)
    size: int
    hyper: dict[str, jax.Array]
    member_abstract_state: step.State  # one member's, with its shardings (for restoring)
    state_sharding: step.State  # the group's
    init_fn: Any  # (seeds int32[K]) -> State
    train_step: Any  # (State, Batch [K, B, ...], hyper) -> (State, metrics [K])
    multi_step: Any  # (State, Batch [K, k, B, ...], hyper) -> (State, metrics [K, k]) or None
    eval_step: Any  # (params, Batch [K, B, ...]) -> sums [K]
    compile_s: float
    steps_per_call: int = 1

    def init(self, seeds: Sequence[int]) -> step.State:
        return self.init_fn(np.asarray(seeds, np.int32))

    def shard(self, batches: Sequence[Mapping[str, np.ndarray]]) -> dict[str, jax.Array]:
        """One host batch per member -> [K, B, ...] arrays (rows split as a run's are)."""
        return _stack(self.mesh, self.member_axis, [[b] for b in batches], steps=False)

    def shard_steps(self, batches: Sequence[Sequence[Mapping[str, np.ndarray]]]) -> dict:
        """`steps_per_call` host batches per member -> [K, k, B, ...] arrays."""
        return _stack(self.mesh, self.member_axis, batches, steps=True)

    def stack(self, states: Sequence[step.State]) -> step.State:
        """Member states (each a run's state) -> the group's state."""
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
        return jax.device_put(stacked, self.state_sharding)

    def member(self, state: step.State, index: int) -> step.State:
        """Member `index`'s slice of the group's state: a run's state, sharded as a run's (one
        compiled call, where slicing leaf by leaf dispatched an operation per array)."""
        return self._slice(state, np.int32(index))

    @functools.cached_property
    def _slice(self) -> Any:
        shardings = jax.tree.map(lambda a: a.sharding, self.member_abstract_state)
        return jax.jit(lambda s, i: jax.tree.map(lambda x: x[i], s), out_shardings=shardings)


def _batch_sharding(mesh: jax.sharding.Mesh, axis: str | None, steps: bool) -> NamedSharding:
    """[K, (k,) B, ...] batches: members over `axis`, each member's rows as a run's (less
    `axis`)."""
    row_spec = sharding.batch_sharding(mesh, axis).spec
    return NamedSharding(mesh, PartitionSpec(axis, *([None] if steps else []), *row_spec))


def _stack(
    mesh: jax.sharding.Mesh,
    axis: str | None,
    batches: Sequence[Sequence[Mapping]],
    *,
    steps: bool,
) -> dict:
    """Per member, per step host batches -> global arrays [K, (k,) B, ...]."""
    lead = 2 if steps else 1
    sh = _batch_sharding(mesh, axis, steps)
    out = {}
    for name in batches[0][0]:
        local = np.stack([np.stack([np.asarray(b[name]) for b in member]) for member in batches])
        if not steps:
            local = local[:, 0]
        out[name] = sharding.global_rows(sh, local, lead)
    return out


@dataclasses.dataclass
class _Jitted:
    """A group's jitted (not yet compiled) functions and the abstract arguments they are
    lowered for."""

    init: Any
    train_step: Any
    eval_step: Any
    multi_step: Any  # None unless steps_per_call > 1
    group_abstract: step.State
    member_abstract: step.State
    group_sharding: step.State
    abstract_batch: dict[str, jax.ShapeDtypeStruct]
    abstract_steps: dict[str, jax.ShapeDtypeStruct] | None
    abstract_hyper: dict[str, jax.ShapeDtypeStruct]
    hyper: dict[str, jax.Array]


def program_kind(cfg: ExperimentConfig, mesh: jax.sharding.Mesh, axis: str | None) -> str:
    """ "vmap" or "loop": how this group's program runs its members (`mesh.member_program`;
    "auto" loops where whole members train on CPU devices)."""
    chosen = cfg.mesh.member_program
    if chosen == "auto":
        on_cpu = mesh.devices.flat[0].platform == "cpu"
        # Loop on CPU: small steps are memory-bound there and the vmapped step's K-wide arrays
        # outgrow the cache, so a vmapped member costs more than a run's step, a looped one
        # the same (docs/performance.md#members). Members split over a mesh axis need vmap
        # (`member_map`: its spmd_axis_name).
        chosen = "loop" if on_cpu and axis is None else "vmap"
    return chosen


def member_map(cfg: ExperimentConfig, mesh: jax.sharding.Mesh, axis: str | None):
    """f(member's args) -> f over args with a leading member axis, as `program_kind` says.
    Members split over a mesh axis are vmapped with that axis's name, so that the vmapped axis
    of every value inside the step is that mesh axis (its activation constraints gain it in
    front)."""
    if program_kind(cfg, mesh, axis) == "vmap":
        return functools.partial(jax.vmap, spmd_axis_name=axis)

    def loop(f):
        return lambda *args: jax.lax.map(lambda member_args: f(*member_args), args)

    return loop


def _optimizer_masks(model: Model) -> dict[str, Any]:
    """optim.make_optimizer's parameter masks and axes for `model`."""
    axes = model.param_axes()
    return {
        "decay_mask": step.decay_mask(axes),
        "stacked": step.stacked_mask(axes),
        "axes": axes,
    }


def _group_abstract_state(
    model: Model, tx: Any, mesh: jax.sharding.Mesh, axis: str | None, k_members: int
) -> tuple[step.State, step.State, step.State]:
    """(one member's abstract state, the group's shardings, the group's abstract state): the
    group's is the member's with a leading member axis of `k_members`."""
    param_sh = sharding.param_shardings(mesh, model.param_axes())
    seed = jax.ShapeDtypeStruct((), jnp.int32)
    abstract = jax.eval_shape(lambda s: step.init_state(model, tx, s), seed)
    member_sh = step.state_shardings(mesh, abstract, model, param_sh)
    member_abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, member_sh
    )
    group_sh = jax.tree.map(lambda s: _with_member_axis(s, axis), member_sh)
    group_abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct((k_members, *a.shape), a.dtype, sharding=s),
        abstract,
        group_sh,
    )
    return member_abstract, group_sh, group_abstract


def _replicated_hyper(cfgs: Sequence[ExperimentConfig], mesh: jax.sharding.Mesh) -> tuple:
    """(the members' hyperparameters on every device, their abstract values)."""
    replicated = NamedSharding(mesh, PartitionSpec())
    hyper = {k: jax.device_put(v, replicated) for k, v in hyperparameters(cfgs).items()}
    abstract_hyper = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated) for k, v in hyper.items()
    }
    return hyper, abstract_hyper


def _abstract_batches(
    example_batch: Mapping[str, Any],
    k_members: int,
    n_steps: int,
    mesh: jax.sharding.Mesh,
    axis: str | None,
) -> tuple[dict, dict | None]:
    """(the group's abstract batch [K, B, ...], its stacked batches [K, n, B, ...] or None
    when `n_steps` is 1), B being the global rows of every process."""
    shapes = {
        k: (np.shape(v)[0] * jax.process_count(), *np.shape(v)[1:])
        for k, v in example_batch.items()
    }
    dtypes = {k: np.asarray(v).dtype for k, v in example_batch.items()}
    batch_sh = _batch_sharding(mesh, axis, steps=False)
    abstract_batch = {
        k: jax.ShapeDtypeStruct((k_members, *shape), dtypes[k], sharding=batch_sh)
        for k, shape in shapes.items()
    }
    if n_steps == 1:
        return abstract_batch, None
    steps_sh = _batch_sharding(mesh, axis, steps=True)
    abstract_steps = {
        k: jax.ShapeDtypeStruct((k_members, n_steps, *shape), dtypes[k], sharding=steps_sh)
        for k, shape in shapes.items()
    }
    return abstract_batch, abstract_steps


def _jit_group(
    cfgs: Sequence[ExperimentConfig],
    model: Model,
    example_batch: Mapping[str, Any],
    mesh: jax.sharding.Mesh,
    axis: str | None,
) -> _Jitted:
    cfg = cfgs[0]
    masks = _optimizer_masks(model)
    total = optim.schedule_steps(cfg.optim, cfg.train.steps)
    tx, _ = optim.make_optimizer(cfg.optim, total, **masks)

    def member_step(state: step.State, batch: step.Batch, hyper: dict) -> tuple:
        own = cfg.optim.model_copy(update=hyper)  # traced numbers: no validation here
        tx, schedule = optim.make_optimizer(own, total, **masks)
        return step.make_train_step(cfg, model, tx, schedule, mesh, axis)(state, batch)

    def member_steps(state: step.State, batches: step.Batch, hyper: dict) -> tuple:
        return jax.lax.scan(lambda s, b: member_step(s, b, hyper), state, batches)

    k_members, n = len(cfgs), cfg.train.steps_per_call
    member_abstract, group_sh, group_abstract = _group_abstract_state(
        model, tx, mesh, axis, k_members
    )
    hyper, abstract_hyper = _replicated_hyper(cfgs, mesh)
    abstract_batch, abstract_steps = _abstract_batches(example_batch, k_members, n, mesh, axis)
    replicated = NamedSharding(mesh, PartitionSpec())
    batch_sh = _batch_sharding(mesh, axis, steps=False)
    over_members = member_map(cfg, mesh, axis)
    multi_step = None
    if n > 1:
        multi_step = jax.jit(
            over_members(member_steps),
            in_shardings=(group_sh, _batch_sharding(mesh, axis, steps=True), replicated),
            out_shardings=(group_sh, replicated),
            donate_argnums=0,
        )
    return _Jitted(
        init=jax.jit(over_members(lambda s: step.init_state(model, tx, s)), out_shardings=group_sh),
        train_step=jax.jit(
            over_members(member_step),
            in_shardings=(group_sh, batch_sh, replicated),
            out_shardings=(group_sh, replicated),
            donate_argnums=0,
        ),
        eval_step=jax.jit(
            over_members(step.make_eval_step(cfg, model)),
            in_shardings=(group_sh["params"], batch_sh),
            out_shardings=replicated,
        ),
        multi_step=multi_step,
        group_abstract=group_abstract,
        member_abstract=member_abstract,
        group_sharding=group_sh,
        abstract_batch=abstract_batch,
        abstract_steps=abstract_steps,
        abstract_hyper=abstract_hyper,
        hyper=hyper,
    )


def _mesh_of(cfgs: Sequence[ExperimentConfig], mesh: jax.sharding.Mesh | None) -> tuple:
    """(mesh, member axis) of a group, checked against its size."""
    check(cfgs)
    cfg = cfgs[0]
    if mesh is None:
        mesh = sharding.make_mesh(cfg.mesh, model=cfg.model, batch=cfg.train)
    sharding.check_members_fit(cfg.mesh, dict(mesh.shape), len(cfgs))
    return mesh, sharding.member_axis(cfg.mesh)


def lower_group_step(
    cfgs: Sequence[ExperimentConfig],
    example_batch: Mapping[str, Any],
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[Any, step.State]:
    """(the group's train step lowered for `example_batch`'s shapes, the group's abstract
    state with its shardings), compiling nothing: for ahead-of-time plans (train/plan/aot.py)."""
    mesh, axis = _mesh_of(cfgs, mesh)
    jitted = _jit_group(cfgs, build_model(cfgs[0].model), example_batch, mesh, axis)
    with sharding.axis_rules(mesh, axis):
        lowered = jitted.train_step.lower(
            jitted.group_abstract, jitted.abstract_batch, jitted.abstract_hyper
        )
    return lowered, jitted.group_abstract


def build_group_program(
    cfgs: Sequence[ExperimentConfig],
    example_batch: Mapping[str, Any],
    mesh: jax.sharding.Mesh | None = None,
) -> GroupProgram:
    """Compile the group program of `cfgs` (checked with `check`) for batches shaped like
    `example_batch` (one member's host rows)."""
    mesh, axis = _mesh_of(cfgs, mesh)
    step.enable_compilation_cache()
    step.tune_host_allocator()
    model = build_model(cfgs[0].model)
    j = _jit_group(cfgs, model, example_batch, mesh, axis)
    k_members = len(cfgs)
    multi_step = None
    t0 = time.perf_counter()
    with sharding.axis_rules(mesh, axis):
        init = j.init.lower(jax.ShapeDtypeStruct((k_members,), jnp.int32)).compile()
        args = (j.group_abstract, j.abstract_batch, j.abstract_hyper)
        if j.multi_step is None:
            train_step = j.train_step.lower(*args).compile()
        else:  # as for a run: the single step only where a log or hook step breaks a call
            train_step = step.CompiledOnFirstCall(j.train_step, mesh, *args, members=axis)
        eval_step = j.eval_step.lower(j.group_abstract["params"], j.abstract_batch).compile()
        if j.multi_step is not None:
            multi_step = j.multi_step.lower(
                j.group_abstract, j.abstract_steps, j.abstract_hyper
            ).compile()
    datasheets.check_fits(cfgs[0], multi_step or train_step, mesh, members=k_members)
    return GroupProgram(
        model=model,
        mesh=mesh,
        member_axis=axis,
        size=k_members,
        hyper=j.hyper,
        member_abstract_state=j.member_abstract,
        state_sharding=j.group_sharding,
        init_fn=init,
        train_step=train_step,
        multi_step=multi_step,
        eval_step=eval_step,
        compile_s=time.perf_counter() - t0,
        steps_per_call=cfgs[0].train.steps_per_call,
    )
