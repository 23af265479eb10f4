"""Members: K runs of one shape trained as one compiled program.

The runs of a group share everything that decides the program (architecture, objective,
sizes, lengths, batch, mesh, optimizer kind, schedule shape, steps and cadence). They may
differ in the keys of `MEMBER_KEYS`: the seeds (initialisation and data order) and the
numbers of the optimizer and its schedule. The group's program is the single run's train
step under `jax.vmap`, over a leading member axis of the train state, the batches and the
differing numbers (which the step receives as traced scalars). A member's slice of the state
is exactly the state of a run trained alone, so its checkpoints are those of a run trained
alone and either can resume the other.

The loop that trains a group, with one run directory per member, is train/group.py.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from scalestudy.config import ExperimentConfig
from scalestudy.errors import ConfigError
from scalestudy.models.api import Model, build_model
from scalestudy.train import optim, sharding, step
from scalestudy.yamlio import flatten

# Keys that members may differ in. `name` is the run's own; the seeds change the numbers of
# the initial state and the data order, not the program; the optimizer's numbers enter the
# step as traced scalars.
SEED_KEYS = ("train.seed", "data.seed")
OPTIM_KEYS = (
    "optim.learning_rate",
    "optim.warmup_steps",
    "optim.weight_decay",
    "optim.final_lr_fraction",
    "optim.b1",
    "optim.b2",
    "optim.eps",
    "optim.grad_clip_norm",
    "optim.cooldown_fraction",
    "optim.cooldown_steps",
    "optim.decay_rate",
    "optim.clipping_threshold",
)
MEMBER_KEYS = ("name", *SEED_KEYS, *OPTIM_KEYS)
_INT_KEYS = ("optim.warmup_steps", "optim.cooldown_steps")


def flat(cfg: ExperimentConfig) -> dict[str, Any]:
    """{dotted key: value} of a resolved config."""
    return flatten(cfg.model_dump(mode="json"))


def differences(cfgs: Sequence[ExperimentConfig]) -> dict[str, list[Any]]:
    """{dotted key: each member's value} for every key the configs do not share."""
    flats = [flat(c) for c in cfgs]
    keys = sorted(set().union(*flats))
    return {
        k: [f.get(k) for f in flats]
        for k in keys
        if any(f.get(k) != flats[0].get(k) for f in flats)
    }


def program_key(cfg: ExperimentConfig) -> str:
    """What a run shares with every member of its group: its config less the member keys
    (with adafactor, weight decay stays: it decides that optimizer's structure)."""
    free = set(MEMBER_KEYS)
    if cfg.optim.name == "adafactor":
        free.discard("optim.weight_decay")
    return json.dumps({k: v for k, v in flat(cfg).items() if k not in free}, sort_keys=True)


def program_difference(cfgs: Sequence[ExperimentConfig]) -> str | None:
    """Why these configs cannot train as members of one program (one line naming the
    first key), or None when they can."""
    for key, values in differences(cfgs).items():
        if key not in MEMBER_KEYS:
            return (
                f"{key} differs between members ({_values(values)}); members may differ only "
                f"in {', '.join(k for k in MEMBER_KEYS if k != 'name')}"
            )
        if None in values:  # e.g. clipping on for some members, off for others
            return (
                f"{key} is None for some members and set for others ({_values(values)}): "
                "that changes the program; give every member a value, or none"
            )
        if key == "optim.weight_decay" and cfgs[0].optim.name == "adafactor":
            return (
                "optim.weight_decay differs between adafactor members: with adafactor it "
                "decides the optimizer's structure; train those runs as separate groups"
            )
    return None


def check(cfgs: Sequence[ExperimentConfig]) -> None:
    """Raise ConfigError unless `cfgs` (at least one) can train as one group."""
    if not cfgs:
        raise ConfigError("a group needs at least one member; the member grid is empty")
    why = program_difference(cfgs)
    if why is not None:
        raise ConfigError(why)
    # Members may share a name (a learning-rate search trains one run of a study at several
    # rates); their run directories tell them apart, and no two may be the same run.
    hashes = [c.model_copy(update={"name": ""}).hash() for c in cfgs]
    if len(set(hashes)) < len(hashes):
        raise ConfigError(
            "two members have the same config (they would train the same run twice); "
            "give each member its own seed or optimizer setting"
        )


def _values(values: list[Any], most: int = 4) -> str:
    shown = ", ".join(repr(v) for v in values[:most])
    return shown + (", ..." if len(values) > most else "")


def hyperparameters(cfgs: Sequence[ExperimentConfig]) -> dict[str, np.ndarray]:
    """{optimizer field: [K] values} for the optimizer keys the members differ in."""
    diff = differences(cfgs)
    out = {}
    for key in OPTIM_KEYS:
        if key in diff:
            dtype = np.int32 if key in _INT_KEYS else np.float32
            out[key.split(".", 1)[1]] = np.asarray(diff[key], dtype)
    return out


def _with_member_axis(sh: NamedSharding) -> NamedSharding:
    return NamedSharding(sh.mesh, PartitionSpec(None, *sh.spec))


@dataclasses.dataclass
class GroupProgram:
    """Compiled functions of a group of `size` members: every array carries a leading
    member axis (state, batches, metrics); `hyper` holds the members' differing optimizer
    numbers, passed to every step."""

    model: Model
    mesh: jax.sharding.Mesh
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
        return _stack(self.mesh, [[b] for b in batches], steps=False)

    def shard_steps(self, batches: Sequence[Sequence[Mapping[str, np.ndarray]]]) -> dict:
        """`steps_per_call` host batches per member -> [K, k, B, ...] arrays."""
        return _stack(self.mesh, batches, steps=True)

    def stack(self, states: Sequence[step.State]) -> step.State:
        """Member states (each a run's state) -> the group's state."""
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
        return jax.device_put(stacked, self.state_sharding)

    @staticmethod
    def member(state: step.State, index: int) -> step.State:
        """Member `index`'s slice of the group's state: a run's state."""
        return jax.tree.map(lambda x: x[index], state)


def _stack(mesh: jax.sharding.Mesh, batches: Sequence[Sequence[Mapping]], *, steps: bool) -> dict:
    """Per member, per step host batches -> global arrays [K, (k,) B, ...]."""
    lead = 2 if steps else 1
    row_spec = sharding.batch_sharding(mesh).spec
    sh = NamedSharding(mesh, PartitionSpec(*([None] * lead), *row_spec))
    out = {}
    for name in batches[0][0]:
        local = np.stack([np.stack([np.asarray(b[name]) for b in member]) for member in batches])
        if not steps:
            local = local[:, 0]
        rows = local.shape[lead] * jax.process_count()
        global_shape = (*local.shape[:lead], rows, *local.shape[lead + 1 :])
        out[name] = jax.make_array_from_process_local_data(sh, local, global_shape)
    return out


def build_group_program(
    cfgs: Sequence[ExperimentConfig],
    example_batch: Mapping[str, Any],
    mesh: jax.sharding.Mesh | None = None,
) -> GroupProgram:
    """Compile the group program of `cfgs` (checked with `check`) for batches shaped like
    `example_batch` (one member's host rows)."""
    check(cfgs)
    cfg = cfgs[0]
    step.enable_compilation_cache()
    step.tune_host_allocator()
    if mesh is None:
        mesh = sharding.make_mesh(cfg.mesh, model=cfg.model, batch=cfg.train)
    model = build_model(cfg.model)
    axes = model.param_axes()
    masks = {
        "decay_mask": step.decay_mask(axes),
        "stacked": step.stacked_mask(axes),
        "axes": axes,
    }
    total = optim.schedule_steps(cfg.optim, cfg.train.steps)
    tx, _ = optim.make_optimizer(cfg.optim, total, **masks)

    def member_step(state: step.State, batch: step.Batch, hyper: dict) -> tuple:
        own = cfg.optim.model_copy(update=hyper)  # traced numbers: no validation here
        tx, schedule = optim.make_optimizer(own, total, **masks)
        return step.make_train_step(cfg, model, tx, schedule, mesh)(state, batch)

    def member_steps(state: step.State, batches: step.Batch, hyper: dict) -> tuple:
        return jax.lax.scan(lambda s, b: member_step(s, b, hyper), state, batches)

    param_sh = sharding.param_shardings(mesh, axes)
    seed = jax.ShapeDtypeStruct((), jnp.int32)
    abstract = jax.eval_shape(lambda s: step.init_state(model, tx, s), seed)
    member_sh = step.state_shardings(mesh, abstract, model, param_sh)
    member_abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, member_sh
    )
    k_members = len(cfgs)
    group_sh = jax.tree.map(_with_member_axis, member_sh)
    group_abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct((k_members, *a.shape), a.dtype, sharding=s),
        abstract,
        group_sh,
    )
    replicated = NamedSharding(mesh, PartitionSpec())
    hyper = {k: jax.device_put(v, replicated) for k, v in hyperparameters(cfgs).items()}
    abstract_hyper = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated) for k, v in hyper.items()
    }
    row_spec = sharding.batch_sharding(mesh).spec
    batch_sh = NamedSharding(mesh, PartitionSpec(None, *row_spec))
    shapes = {
        k: (np.shape(v)[0] * jax.process_count(), *np.shape(v)[1:])
        for k, v in example_batch.items()
    }
    dtypes = {k: np.asarray(v).dtype for k, v in example_batch.items()}
    abstract_batch = {
        k: jax.ShapeDtypeStruct((k_members, *shape), dtypes[k], sharding=batch_sh)
        for k, shape in shapes.items()
    }
    init = jax.jit(jax.vmap(lambda s: step.init_state(model, tx, s)), out_shardings=group_sh)
    train_step = jax.jit(
        jax.vmap(member_step),
        in_shardings=(group_sh, batch_sh, replicated),
        out_shardings=(group_sh, replicated),
        donate_argnums=0,
    )
    eval_step = jax.jit(
        jax.vmap(step.make_eval_step(cfg, model)),
        in_shardings=(group_sh["params"], batch_sh),
        out_shardings=replicated,
    )
    n = cfg.train.steps_per_call
    multi_step = None
    t0 = time.perf_counter()
    with sharding.axis_rules(mesh):
        init = init.lower(jax.ShapeDtypeStruct((k_members,), jnp.int32)).compile()
        if n == 1:
            train_step = train_step.lower(group_abstract, abstract_batch, abstract_hyper).compile()
        else:  # as for a run: the single step only where a log or hook step breaks a call
            train_step = step.CompiledOnFirstCall(
                train_step, mesh, group_abstract, abstract_batch, abstract_hyper
            )
        eval_step = eval_step.lower(group_abstract["params"], abstract_batch).compile()
        if n > 1:
            steps_sh = NamedSharding(mesh, PartitionSpec(None, None, *row_spec))
            abstract_steps = {
                k: jax.ShapeDtypeStruct((k_members, n, *shape), dtypes[k], sharding=steps_sh)
                for k, shape in shapes.items()
            }
            multi_step = (
                jax.jit(
                    jax.vmap(member_steps),
                    in_shardings=(group_sh, steps_sh, replicated),
                    out_shardings=(group_sh, replicated),
                    donate_argnums=0,
                )
                .lower(group_abstract, abstract_steps, abstract_hyper)
                .compile()
            )
    return GroupProgram(
        model=model,
        mesh=mesh,
        size=k_members,
        hyper=hyper,
        member_abstract_state=member_abstract,
        state_sharding=group_sh,
        init_fn=init,
        train_step=train_step,
        multi_step=multi_step,
        eval_step=eval_step,
        compile_s=time.perf_counter() - t0,
        steps_per_call=n,
    )


# The most members one group may hold (`train --members`, a study's `members`): a group's
# state and batches are K times a run's, and past a few members on a CPU the step costs
# K times one run's anyway (README, Performance).
MAX_MEMBERS = 64
# `seed=S` in a member grid: the run's whole replicate, initialisation and data order.
SEED_SHORTHAND = "seed"


def parse_grid(items: Sequence[str]) -> list[tuple[str, list[str]]]:
    """A member grid (`seed=0,1,2 optim.learning_rate=3e-3,1e-2`: every combination) as
    (directory name, overrides) per member, in grid order. `seed=S` sets train.seed and
    data.seed; other keys are dotted config keys that members may differ in."""
    axes: list[tuple[str, list[str]]] = []
    accepted = f"{SEED_SHORTHAND}, " + ", ".join(k for k in MEMBER_KEYS if k != "name")
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--members: {item!r} is not KEY=V1,V2,...; e.g. seed=0,1,2")
        if key != SEED_SHORTHAND and key not in MEMBER_KEYS[1:]:
            raise ConfigError(
                f"--members: {key} cannot differ between members (it changes the program or "
                f"is not a key); accepted: {accepted}. Overrides shared by every member go "
                "before --members"
            )
        parts = [v.strip() for v in values.split(",")]
        if not values or "" in parts:
            raise ConfigError(f"--members: {key} has an empty value in {item!r}")
        twice = sorted({v for v in parts if parts.count(v) > 1})
        if twice:
            raise ConfigError(f"--members: {key} lists {twice} twice (duplicate members)")
        if key in (k for k, _ in axes):
            raise ConfigError(f"--members: {key} is given twice; give its values once")
        axes.append((key, parts))
    if not axes:
        raise ConfigError(f"--members: the grid is empty; give KEY=V1,V2,... ({accepted})")
    grid: list[tuple[str, list[str]]] = [("", [])]
    for key, values in axes:
        short = key.rsplit(".", 1)[-1]
        grid = [
            (f"{name}-{short}{v}".lstrip("-"), [*ov, *_overrides(key, v)])
            for name, ov in grid
            for v in values
        ]
    if len(grid) > MAX_MEMBERS:
        raise ConfigError(
            f"--members: the grid has {len(grid)} members, more than {MAX_MEMBERS} per group; "
            "split it over several commands"
        )
    return grid


def _overrides(key: str, value: str) -> list[str]:
    if key == SEED_SHORTHAND:
        return [f"train.seed={value}", f"data.seed={value}"]
    return [f"{key}={value}"]
