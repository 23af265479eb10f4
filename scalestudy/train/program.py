"""The compiled program of K >= 1 members: a run is a group of one.

`build_program(cfgs, example_batch)` compiles the pure steps of train/step.py for the runs
`cfgs`, which share everything that decides the program (train/members.py says which keys
may differ). One member is a run: its state, batches and metrics carry no member axis, and
its program is the single run's. K > 1 members add a leading member axis to the train
state, the batches and the metrics; the members' differing optimizer numbers (`hyper`)
enter every step as traced scalars, so members at different learning rates share a program.

The step goes over the member axis in one of two ways (`mesh.member_program`, `program_kind`):
under `jax.vmap`, every operation K members wide, or as a loop (`jax.lax.map`) running the
members' steps one after another inside the one program.

The member axis is whole on every device group by default (each member's rows split over the
batch axes as a run's are). With `mesh.members: data` it is split over the data axis instead:
each data slice of the mesh holds whole members (their state and their rows, the rows split
over the remaining batch axes), and the step's activation constraints give that mesh axis to
the member axis (`jax.vmap(..., spmd_axis_name=...)`, `sharding.rules(..., members=...)`).

Equal inputs in one process reuse the compiled program (a study trains many runs of one
shape).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from scalestudy.config.experiment import ExperimentConfig
from scalestudy.models import attention
from scalestudy.models.api import Model, build_model
from scalestudy.train import datasheets, optim, sharding, step
from scalestudy.train.members import check_group, hyperparameters
from scalestudy.train.runtime import host_setup

State = step.State


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
    """Compiled functions of `size` members (`size` 1: a run, no member axis anywhere).

    The steps take the members' differing optimizer numbers last: `train_step(state, batch,
    hyper)`; `step` and `steps` pass the program's own `hyper` (empty for a run)."""

    model: Model
    mesh: jax.sharding.Mesh
    schedule: optim.Schedule  # the first member's (a run's)
    size: int
    member_axis: str | None  # the mesh axis the member axis is split over (None: whole)
    hyper: dict[str, jax.Array]  # {optimizer field: [K] values} the members differ in
    abstract_state: State  # one member's, with its shardings: what a checkpoint restores into
    abstract_group_state: State  # the program's whole state ([K, ...] leaves; a run's for K=1)
    state_sharding: State  # the program's
    batch_sharding: NamedSharding  # one member's rows
    init_fn: Any  # (seed int32[] or seeds int32[K]) -> State, created sharded
    train_step: Any  # (State, Batch, hyper) -> (State, metrics); donates the state
    eval_step: Any  # (params, Batch) -> sums
    compile_s: float
    multi_step: Any = None  # (State, Batch [(K,) k, B, ...], hyper); None when k is 1
    steps_per_call: int = 1
    # What `train_step` is lowered for: (state, batch, hyper), abstract.
    abstract_args: tuple = ()

    @property
    def grouped(self) -> bool:
        """Whether arrays carry a member axis (more than one member)."""
        return self.size > 1

    def init(self, seeds: int | Sequence[int]) -> State:
        """A fresh state from each member's seed (parameters and dropout keys); a run's
        from its one seed."""
        seeds = np.asarray(seeds, np.int32)
        if not self.grouped and seeds.ndim:
            (seeds,) = seeds
        return self.init_fn(seeds)

    def step(self, state: State, batch: dict[str, jax.Array]) -> tuple[State, dict]:
        """One train step of every member (`batch` from `shard`)."""
        return self.train_step(state, batch, self.hyper)

    def steps(self, state: State, batches: dict[str, jax.Array]) -> tuple[State, dict]:
        """`steps_per_call` train steps of every member in one call (`batches` from
        `shard_steps`)."""
        return self.multi_step(state, batches, self.hyper)

    def shard(self, batches: Sequence[Mapping[str, np.ndarray]]) -> dict[str, jax.Array]:
        """One host batch per member -> global arrays ([K,] B, ...), rows split as a run's."""
        if not self.grouped:
            return sharding.shard_batch(self.mesh, dict(batches[0]))
        return _stack(self.mesh, self.member_axis, [[b] for b in batches], steps=False)

    def shard_steps(self, batches: Sequence[Sequence[Mapping[str, np.ndarray]]]) -> dict:
        """`steps_per_call` host batches per member -> ([K,] k, B, ...) arrays."""
        if not self.grouped:
            return _stack(self.mesh, None, batches, steps=True, lead=False)
        return _stack(self.mesh, self.member_axis, batches, steps=True)

    def shard_batch(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """A run's host batch -> its global arrays."""
        return self.shard([batch])

    def shard_batches(self, batches: Sequence[Mapping[str, np.ndarray]]) -> dict:
        """A run's `steps_per_call` host batches -> its (k, B, ...) arrays for `steps`."""
        return self.shard_steps([batches])

    def stack(self, states: Sequence[State]) -> State:
        """Member states (each a run's state) -> the program's state."""
        if not self.grouped:
            return jax.device_put(states[0], self.state_sharding)
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
        return jax.device_put(stacked, self.state_sharding)

    def member(self, state: State, index: int) -> State:
        """Member `index`'s slice of the program's state: a run's state, sharded as a run's
        (one compiled call, where slicing leaf by leaf dispatched an operation per array)."""
        if not self.grouped:
            return state
        return self._slice(state, np.int32(index))

    @functools.cached_property
    def _slice(self) -> Any:
        shardings = jax.tree.map(lambda a: a.sharding, self.abstract_state)
        return jax.jit(lambda s, i: jax.tree.map(lambda x: x[i], s), out_shardings=shardings)

    def lower_train_step(self) -> Any:
        """The train step lowered for the program's shapes, compiling nothing (for
        ahead-of-time plans, train/plan/aot.py; a program built with `compile=False`)."""
        with sharding.axis_rules(self.mesh, self.member_axis):
            return self.train_step.lower(*self.abstract_args)


def _lead(axis: str | None, grouped: bool) -> tuple:
    """The partition spec's leading entries of a member axis ((): a run has none)."""
    return (axis,) if grouped else ()


def _batch_sharding(
    mesh: jax.sharding.Mesh, axis: str | None, steps: bool, grouped: bool = True
) -> NamedSharding:
    """([K,] [k,] B, ...) batches: members over `axis`, each member's rows as a run's (less
    `axis`)."""
    row_spec = sharding.batch_sharding(mesh, axis).spec
    lead = (*_lead(axis, grouped), *([None] if steps else []))
    return NamedSharding(mesh, PartitionSpec(*lead, *row_spec))


def _stack(
    mesh: jax.sharding.Mesh,
    axis: str | None,
    batches: Sequence[Sequence[Mapping]],
    *,
    steps: bool,
    lead: bool = True,
) -> dict:
    """Per member, per step host batches -> global arrays ([K,] [k,] B, ...); `lead` False:
    one member, no member axis."""
    sh = _batch_sharding(mesh, axis, steps, grouped=lead)
    out = {}
    for name in batches[0][0]:
        local = np.stack([np.stack([np.asarray(b[name]) for b in member]) for member in batches])
        local = local if lead else local[0]
        if not steps:
            local = local[:, 0] if lead else local[0]
        out[name] = sharding.global_rows(sh, local, int(lead) + int(steps))
    return out


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


def member_map(cfg: ExperimentConfig, mesh: jax.sharding.Mesh, axis: str | None, size: int):
    """f(member's args) -> f over args with a leading member axis, as `program_kind` says
    (one member: f itself). Members split over a mesh axis are vmapped with that axis's
    name, so that the vmapped axis of every value inside the step is that mesh axis (its
    activation constraints gain it in front)."""
    if size == 1:
        return lambda f: f
    if program_kind(cfg, mesh, axis) == "vmap":
        return functools.partial(jax.vmap, spmd_axis_name=axis)

    def loop(f):
        return lambda *args: jax.lax.map(lambda member_args: f(*member_args), args)

    return loop


@dataclasses.dataclass
class _Layout:
    """Where a program's arrays live: the mesh, the member axis, the shapes and shardings."""

    mesh: jax.sharding.Mesh
    axis: str | None
    size: int
    member_abstract: State  # one member's abstract state, with shardings
    group_abstract: State
    group_sharding: State
    batch: dict[str, jax.ShapeDtypeStruct]  # ([K,] B, ...)
    steps: dict[str, jax.ShapeDtypeStruct] | None  # ([K,] k, B, ...), or None when k is 1
    hyper: dict[str, jax.Array]
    abstract_hyper: dict[str, jax.ShapeDtypeStruct]

    @property
    def grouped(self) -> bool:
        return self.size > 1

    def batch_sharding(self, steps: bool) -> NamedSharding:
        return _batch_sharding(self.mesh, self.axis, steps, self.grouped)


def _abstract_states(model: Model, tx: Any, mesh: jax.sharding.Mesh, axis: str | None, size: int):
    """(one member's abstract state, the program's shardings, the program's abstract state):
    the program's is the member's with a leading member axis of `size` (none for a run)."""
    param_sh = sharding.param_shardings(mesh, model.param_axes())
    seed = jax.ShapeDtypeStruct((), jnp.int32)
    abstract = jax.eval_shape(lambda s: step.init_state(model, tx, s), seed)
    member_sh = step.state_shardings(mesh, abstract, model, param_sh)
    member_abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, member_sh
    )
    if size == 1:
        return member_abstract, member_sh, member_abstract
    group_sh = jax.tree.map(
        lambda s: NamedSharding(s.mesh, PartitionSpec(axis, *s.spec)), member_sh
    )
    group_abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct((size, *a.shape), a.dtype, sharding=s),
        abstract,
        group_sh,
    )
    return member_abstract, group_sh, group_abstract


def _replicated_hyper(cfgs: Sequence[ExperimentConfig], mesh: jax.sharding.Mesh) -> tuple:
    """(the members' differing hyperparameters on every device, their abstract values)."""
    replicated = NamedSharding(mesh, PartitionSpec())
    hyper = {k: jax.device_put(v, replicated) for k, v in hyperparameters(cfgs).items()}
    abstract_hyper = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated) for k, v in hyper.items()
    }
    return hyper, abstract_hyper


def _global_shapes(example_batch: Mapping[str, Any]) -> dict[str, tuple[tuple, Any]]:
    """{feature: (global shape, dtype)}: this process's rows, times the process count."""
    processes = jax.process_count()
    return {
        k: ((np.shape(v)[0] * processes, *np.shape(v)[1:]), np.asarray(v).dtype)
        for k, v in example_batch.items()
    }


def _layout(cfgs, model, tx, example_batch, mesh, axis) -> _Layout:
    """The program's abstract state, batches and hyperparameters, with their shardings."""
    size, n = len(cfgs), cfgs[0].train.steps_per_call
    member_abstract, group_sh, group_abstract = _abstract_states(model, tx, mesh, axis, size)
    hyper, abstract_hyper = _replicated_hyper(cfgs, mesh)
    lead = (size,) if size > 1 else ()
    shapes = _global_shapes(example_batch)
    batch_sh = _batch_sharding(mesh, axis, steps=False, grouped=size > 1)
    batch = {
        k: jax.ShapeDtypeStruct((*lead, *shape), dtype, sharding=batch_sh)
        for k, (shape, dtype) in shapes.items()
    }
    steps = None
    if n > 1:
        steps_sh = _batch_sharding(mesh, axis, steps=True, grouped=size > 1)
        steps = {
            k: jax.ShapeDtypeStruct((*lead, n, *shape), dtype, sharding=steps_sh)
            for k, (shape, dtype) in shapes.items()
        }
    return _Layout(
        mesh=mesh,
        axis=axis,
        size=size,
        member_abstract=member_abstract,
        group_abstract=group_abstract,
        group_sharding=group_sh,
        batch=batch,
        steps=steps,
        hyper=hyper,
        abstract_hyper=abstract_hyper,
    )


@dataclasses.dataclass
class _Jitted:
    """A program's jitted (not yet compiled) functions."""

    init: Any
    train_step: Any
    eval_step: Any
    multi_step: Any  # None unless steps_per_call > 1


def _optimizer_maker(cfg: ExperimentConfig, model: Model) -> Any:
    """`make(optim_cfg) -> (optimizer, schedule)` with the model's parameter masks and the
    run's schedule length (a member's numbers may be traced)."""
    axes = model.param_axes()
    masks = {"decay_mask": step.decay_mask(axes), "stacked": step.stacked_mask(axes), "axes": axes}
    total = optim.schedule_steps(cfg.optim, cfg.train.steps)
    return lambda optim_cfg: optim.make_optimizer(optim_cfg, total, **masks)


def _jit(cfg: ExperimentConfig, model: Model, tx: Any, make_tx: Any, lay: _Layout) -> _Jitted:
    """The program's functions jitted with their shardings; the train steps donate the
    state. A member's optimizer is rebuilt inside the step from its traced numbers."""

    def member_step(state: State, batch: step.Batch, hyper: dict) -> tuple:
        own = cfg.optim.model_copy(update=hyper)  # traced numbers: no validation here
        member_tx, schedule = make_tx(own)
        return step.make_train_step(cfg, model, member_tx, schedule, lay.mesh, lay.axis)(
            state, batch
        )

    def member_steps(state: State, batches: step.Batch, hyper: dict) -> tuple:
        return jax.lax.scan(lambda s, b: member_step(s, b, hyper), state, batches)

    replicated = NamedSharding(lay.mesh, PartitionSpec())
    state_sh = lay.group_sharding
    over_members = member_map(cfg, lay.mesh, lay.axis, lay.size)

    def jit_step(fn: Any, steps: bool) -> Any:
        return jax.jit(
            over_members(fn),
            in_shardings=(state_sh, lay.batch_sharding(steps), replicated),
            out_shardings=(state_sh, replicated),
            donate_argnums=0,
        )

    # k steps to a call: a small model's step is short enough that the per-call costs
    # (dispatch, argument handling, waking the thread pool) are a visible share of it
    # (docs/performance.md#small-models-on-cpu).
    multi = jit_step(member_steps, steps=True) if cfg.train.steps_per_call > 1 else None
    # The seed is an argument, so runs that differ only in seed share one program.
    init = over_members(lambda seed: step.init_state(model, tx, seed))
    return _Jitted(
        init=jax.jit(init, out_shardings=state_sh),
        train_step=jit_step(member_step, steps=False),
        eval_step=jax.jit(
            over_members(step.make_eval_step(cfg, model)),
            in_shardings=(state_sh["params"], lay.batch_sharding(False)),
            out_shardings=replicated,
        ),
        multi_step=multi,
    )


def _compile(cfg: ExperimentConfig, j: _Jitted, lay: _Layout) -> _Jitted:
    """`j` compiled for the layout's shapes, in the order init, train step, eval step,
    multi-step; the program is then checked against the devices' memory."""
    seeds = jax.ShapeDtypeStruct((lay.size,) if lay.grouped else (), jnp.int32)
    args = (lay.group_abstract, lay.batch, lay.abstract_hyper)
    multi_step = None
    with sharding.axis_rules(lay.mesh, lay.axis):
        init = j.init.lower(seeds).compile()
        if j.multi_step is None:
            train_step = j.train_step.lower(*args).compile()
        else:  # the single step only where a log or hook step breaks a call
            train_step = CompiledOnFirstCall(j.train_step, lay.mesh, *args, members=lay.axis)
        eval_step = j.eval_step.lower(lay.group_abstract["params"], lay.batch).compile()
        if j.multi_step is not None:
            multi_step = j.multi_step.lower(
                lay.group_abstract, lay.steps, lay.abstract_hyper
            ).compile()
    datasheets.check_fits(cfg, multi_step or train_step, lay.mesh, members=lay.size)
    return _Jitted(init, train_step, eval_step, multi_step)


_PROGRAMS: OrderedDict[str, Program] = OrderedDict()
_MAX_PROGRAMS = 8


def _program_key(cfgs: Sequence[ExperimentConfig], shapes: dict, mesh: Any) -> str:
    cfg = cfgs[0]
    parts = (
        cfg.model.model_dump_json(),
        cfg.optim.model_dump_json(),
        cfg.train.steps,
        cfg.train.microbatches,
        cfg.train.steps_per_call,
        cfg.train.z_loss,
        sorted((k, str(v)) for k, v in shapes.items()),
        tuple(mesh.shape.items()),
        tuple(d.id for d in mesh.devices.flat),
        attention.causal_block_rows(),  # shapes the traced attention, not in the config
    )
    if len(cfgs) > 1:  # a group: its size, how it maps members, their numbers
        hyper = {k: v.tolist() for k, v in hyperparameters(cfgs).items()}
        parts += (len(cfgs), cfg.mesh.members, cfg.mesh.member_program, sorted(hyper.items()))
    return repr(parts)


def _remember(key: str, program: Program) -> None:
    """Keep `program` for reuse, dropping the least recently used past `_MAX_PROGRAMS`."""
    _PROGRAMS[key] = program
    while len(_PROGRAMS) > _MAX_PROGRAMS:
        _PROGRAMS.popitem(last=False)


def _mesh_of(cfgs: Sequence[ExperimentConfig], mesh: jax.sharding.Mesh | None) -> tuple:
    """(mesh, member axis) of the members `cfgs`, checked against their number (a run has
    no member axis)."""
    check_group(cfgs)
    cfg = cfgs[0]
    if mesh is None:
        mesh = sharding.make_mesh(cfg.mesh, model=cfg.model, batch=cfg.train)
    if len(cfgs) == 1:
        return mesh, None
    sharding.check_members_fit(cfg.mesh, dict(mesh.shape), len(cfgs))
    return mesh, sharding.member_axis(cfg.mesh)


def build_program(
    cfgs: ExperimentConfig | Sequence[ExperimentConfig],
    example_batch: Mapping[str, Any],
    mesh: jax.sharding.Mesh | None = None,
    *,
    compile: bool = True,
) -> Program:
    """Build (or reuse) the compiled program of the members `cfgs` (one config: a run) for
    batches shaped like `example_batch`.

    `example_batch` holds one member's rows on this process (what its data iterator yields);
    the program is compiled for the global batch, whose rows come from every process. With
    `compile=False` the functions are jitted but not compiled (`Program.lower_train_step`).
    """
    cfgs = [cfgs] if isinstance(cfgs, ExperimentConfig) else list(cfgs)
    host_setup.enable_compilation_cache()
    host_setup.tune_host_allocator()
    mesh, axis = _mesh_of(cfgs, mesh)
    key = _program_key(cfgs, _global_shapes(example_batch), mesh)
    if compile and key in _PROGRAMS:
        _PROGRAMS.move_to_end(key)
        return dataclasses.replace(_PROGRAMS[key], compile_s=0.0)
    cfg = cfgs[0]
    model = build_model(cfg.model)
    make_tx = _optimizer_maker(cfg, model)
    tx, schedule = make_tx(cfg.optim)
    lay = _layout(cfgs, model, tx, example_batch, mesh, axis)
    j = _jit(cfg, model, tx, make_tx, lay)
    t0 = time.perf_counter()
    if compile:
        j = _compile(cfg, j, lay)
    program = Program(
        model=model,
        mesh=mesh,
        schedule=schedule,
        size=len(cfgs),
        member_axis=axis,
        hyper=lay.hyper,
        abstract_state=lay.member_abstract,
        abstract_group_state=lay.group_abstract,
        state_sharding=lay.group_sharding,
        batch_sharding=lay.batch_sharding(False),
        init_fn=j.init,
        train_step=j.train_step,
        eval_step=j.eval_step,
        compile_s=time.perf_counter() - t0,
        multi_step=j.multi_step,
        steps_per_call=cfg.train.steps_per_call,
        abstract_args=(lay.group_abstract, lay.batch, lay.abstract_hyper),
    )
    if compile:
        _remember(key, program)
    return program
