"""Device mesh and the one table mapping logical axis names to mesh axes.

Mesh axes: "data" (pure data parallelism: parameters replicated), "fsdp" (data parallelism
with parameters and optimizer state sharded over their "embed" dimension, gathered per layer
by XLA), "expert" (expert parallelism: the routed experts of mixture-of-experts layers split
over it, tokens exchanged between its devices by the dispatch), "tensor" (Megatron-style model
parallelism over heads, feed-forward and vocabulary). The batch dimension is split over data,
fsdp and expert together. A group of members (train/program.py) may split its member
axis over "data" (`mesh.members: data`); inside a member's step the rules then leave that
axis to the members.

Models name their parameter and activation dimensions logically (`Model.param_axes()`,
`layers.constrain`); this module is the only place those names meet mesh axes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
from flax.core import spmd as flax_spmd
from flax.linen import spmd as linen_spmd
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import ExperimentConfig, MeshConfig, ModelConfig, TrainConfig
from scalestudy.data.objectives import feature_lengths

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "expert", "tensor")  # "expert" only in meshes with mesh.expert != 1
DENSE_AXES = ("data", "fsdp", "tensor")

# Logical name -> mesh axes, in order of precedence: a mesh axis already used by an earlier
# rule for the same array is skipped, so activations [batch, length, embed] shard batch over
# (data, fsdp) and leave embed whole, while parameters [embed, mlp] shard embed over fsdp.
AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp", "expert")),
    ("expert", "expert"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("embed", "fsdp"),
    ("kv", None),
    ("length", None),
    ("layers", None),
    ("relpos_buckets", None),
)


# `mesh.members` -> the mesh axis a group's leading member axis is split over (None: whole).
MEMBER_AXES: dict[str, str | None] = {"none": None, "data": "data"}


def rules(axis_names: tuple[str, ...] = DENSE_AXES, members: str | None = None) -> tuple:
    """AXIS_RULES for a mesh of `axis_names`: mesh axes it lacks are dropped (a mesh without
    an expert axis keeps experts whole). `members`, the mesh axis a group's member axis is
    split over, is dropped too: inside a member's step it is the member's, not the batch's."""
    out = []
    for name, target in AXIS_RULES:
        if isinstance(target, tuple):
            target = tuple(a for a in target if a in axis_names and a != members) or None
        elif target not in axis_names or target == members:
            target = None
        out.append((name, target))
    return tuple(out)


def member_axis(cfg: MeshConfig) -> str | None:
    """The mesh axis `cfg.members` splits a group's member axis over (None: not split)."""
    return MEMBER_AXES[cfg.members]


def check_members_fit(cfg: MeshConfig, sizes: Mapping[str, int], k: int) -> None:
    """Raise MeshError when a group of `k` members cannot be split over the member axis."""
    axis = member_axis(cfg)
    if axis is None:
        return
    if k % sizes[axis]:
        raise MeshError(
            f"mesh.members={cfg.members} splits the {k} members over mesh.{axis}={sizes[axis]} "
            f"device groups, which does not divide {k}; give a multiple of {sizes[axis]} "
            f"members, a mesh.{axis} dividing {k}, or mesh.members=none"
        )
    if jax.process_count() > 1:
        raise MeshError(
            f"mesh.members={cfg.members} needs one process (each process reads every member's "
            f"rows); this job has {jax.process_count()}: use mesh.members=none"
        )


class MeshError(ConfigError):
    """The mesh shape does not fit the devices or the model."""


DISTRIBUTED_ENV = ("SCALESTUDY_COORDINATOR", "SCALESTUDY_NUM_PROCESSES", "SCALESTUDY_PROCESS_ID")


def initialize_distributed(environ: Mapping[str, str] | None = None) -> bool:
    """Join this process to a multi-process (multi-host) job, before any JAX computation.

    Explicit: SCALESTUDY_COORDINATOR=host:port, SCALESTUDY_NUM_PROCESSES and
    SCALESTUDY_PROCESS_ID (any launcher; several local processes in tests). Automatic:
    SCALESTUDY_DISTRIBUTED=auto lets JAX read the cluster (Cloud TPU pod slice, SLURM), as
    the rendered launch scripts set it. Otherwise (one process) nothing happens.
    Returns whether a multi-process job was joined.
    """
    env = os.environ if environ is None else environ
    if jax.distributed.is_initialized():
        return True
    coordinator = env.get("SCALESTUDY_COORDINATOR", "")
    if coordinator:
        host, sep, port = coordinator.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise MeshError(
                f"SCALESTUDY_COORDINATOR={coordinator!r} is not host:port; give the address of "
                "process 0 with a free port, e.g. SCALESTUDY_COORDINATOR=10.0.0.1:1234"
            )
        try:
            n, i = int(env["SCALESTUDY_NUM_PROCESSES"]), int(env["SCALESTUDY_PROCESS_ID"])
        except (KeyError, ValueError):
            got = {k: env.get(k) for k in DISTRIBUTED_ENV}
            raise MeshError(
                f"a multi-process job needs all of {', '.join(DISTRIBUTED_ENV)} (the last two "
                f"integers); got {got}"
            ) from None
        if not 0 <= i < n:
            raise MeshError(f"SCALESTUDY_PROCESS_ID={i} must lie in [0, {n})")
        jax.distributed.initialize(
            coordinator_address=env["SCALESTUDY_COORDINATOR"], num_processes=n, process_id=i
        )
        return True
    mode = env.get("SCALESTUDY_DISTRIBUTED", "")
    partial = [k for k in DISTRIBUTED_ENV[1:] if env.get(k)]
    if partial and mode != "auto":
        raise MeshError(
            f"{' and '.join(partial)} set without SCALESTUDY_COORDINATOR: a multi-process job "
            "needs all three (SCALESTUDY_COORDINATOR=host:port of process 0), or "
            "SCALESTUDY_DISTRIBUTED=auto on a cluster JAX recognises; unset them for one process"
        )
    if mode == "auto":
        try:
            jax.distributed.initialize()
        except ValueError as e:  # no cluster JAX recognises: it cannot find a coordinator
            raise MeshError(
                f"SCALESTUDY_DISTRIBUTED=auto, and JAX finds no cluster here ({e}); run it "
                "inside a SLURM job or on a Cloud TPU slice, give SCALESTUDY_COORDINATOR, "
                "SCALESTUDY_NUM_PROCESSES and SCALESTUDY_PROCESS_ID, or unset it for one process"
            ) from None
        return True
    if mode not in ("", "off"):
        raise MeshError(f"SCALESTUDY_DISTRIBUTED={mode!r}; accepted: auto, off")
    return False


def mesh_shape(cfg: MeshConfig, n_devices: int) -> dict[str, int]:
    """Resolve the -1 axis and check that the mesh uses exactly `n_devices` devices."""
    sizes = dict(cfg.shape)
    fixed = math.prod(v for v in sizes.values() if v != -1)
    rest = [k for k, v in sizes.items() if v == -1]
    if rest:
        if n_devices % fixed:
            raise MeshError(
                f"mesh {cfg.shape}: the fixed axes use {fixed} devices, which does not divide "
                f"the {n_devices} available; choose sizes whose product divides {n_devices}"
            )
        sizes[rest[0]] = n_devices // fixed
    elif fixed != n_devices:
        raise MeshError(
            f"mesh {cfg.shape} uses {fixed} devices but {n_devices} are available; make the "
            f"product of mesh.data, mesh.fsdp, mesh.expert and mesh.tensor equal {n_devices}, "
            "or set one of them to -1 ('the rest')"
        )
    return sizes


def check_model_fits(sizes: Mapping[str, int], model: ModelConfig) -> None:
    """Raise MeshError when the tensor axis does not divide heads, d_ff or the vocabulary."""
    tensor = sizes["tensor"]
    for name, value in (
        ("model.n_heads", model.n_heads),
        ("model.d_ff", model.d_ff),
        ("model.vocab_size", model.vocab_size),
        *((("model.moe.d_expert", model.moe.width(model.d_ff)),) if model.moe.enabled else ()),
    ):
        if value % tensor:
            raise MeshError(
                f"mesh.tensor={tensor} does not divide {name}={value}; choose a tensor size "
                f"that divides n_heads ({model.n_heads}), d_ff ({model.d_ff}) and vocab_size "
                f"({model.vocab_size})"
            )
    expert = sizes.get("expert", 1)
    if expert > 1 and not model.moe.enabled:
        raise MeshError(
            f"mesh.expert={expert} splits routed experts, but model.moe.enabled is false; use "
            "mesh.data for data parallelism, or enable model.moe"
        )
    if model.moe.enabled and model.moe.routed_experts % expert:
        raise MeshError(
            f"mesh.expert={expert} does not divide model.moe.routed_experts="
            f"{model.moe.routed_experts}; choose an expert axis size dividing it"
        )
    fsdp = sizes["fsdp"]
    if model.d_model % fsdp:
        raise MeshError(
            f"mesh.fsdp={fsdp} does not divide model.d_model={model.d_model}; choose an fsdp "
            "size dividing d_model"
        )


def check_batch_fits(sizes: Mapping[str, int], train: TrainConfig) -> None:
    """Raise MeshError when the global batch's rows cannot be split evenly over the mesh axes
    that shard the batch (a jitted step's inputs must divide; microbatches inside it need not)."""
    axes = dict(rules(tuple(sizes)))["batch"]
    split = math.prod(sizes[a] for a in axes)
    if train.batch_size % split:
        named = " x ".join(f"mesh.{a}={sizes[a]}" for a in axes)
        raise MeshError(
            f"train.batch_size={train.batch_size} rows cannot be split over the batch's mesh "
            f"axes ({named} = {split} shards); choose train.batch_size as a multiple of {split}, "
            f"or a mesh whose {' x '.join(axes)} divides {train.batch_size}"
        )


def device_grid(devices: list, shape: tuple[int, ...], topology: bool | None = None) -> np.ndarray:
    """`devices` arranged as an array of `shape` (data, fsdp, tensor).

    With `topology` (default: on TPU and GPU), JAX's `mesh_utils` orders them so that the
    later, busier axes (tensor, then fsdp) run over the fastest links: the physical torus on
    TPU, one host's NVLink on GPU; across TPU slices or GPU hosts only the data axis spans the
    slow network (hybrid mesh) when its size allows. Otherwise (CPU) the plain device order.
    """
    if topology is None:
        topology = devices[0].platform in ("tpu", "gpu")
    if not topology:
        return np.asarray(devices, dtype=object).reshape(shape)
    if devices[0].platform == "tpu":
        granules = {getattr(d, "slice_index", 0) for d in devices}
    else:
        granules = {d.process_index for d in devices}
    n = len(granules)
    try:
        if n > 1 and shape[0] % n == 0:
            return mesh_utils.create_hybrid_device_mesh(
                (shape[0] // n, *shape[1:]),
                (n,) + (1,) * (len(shape) - 1),
                devices,
                process_is_granule=devices[0].platform != "tpu",
                allow_split_physical_axes=True,
            )
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (AssertionError, ValueError, NotImplementedError) as err:
        # e.g. TPU v4 devices listed per core rather than per chip: no physical placement.
        log.warning("topology-aware mesh %s not possible (%s); using the plain order", shape, err)
        return np.asarray(devices, dtype=object).reshape(shape)


def make_mesh(
    cfg: MeshConfig,
    devices: list | None = None,
    *,
    model: ModelConfig | None = None,
    batch: TrainConfig | None = None,
    topology: bool | None = None,
) -> Mesh:
    """A ("data", "fsdp", "expert", "tensor") mesh over `devices` (default: all), in topology-aware
    order on TPU/GPU (`device_grid`); checks sizes, and that `model` and the training batch
    of `batch` (when given) can be split as the rules say."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_shape(cfg, len(devices))
    if model is not None:
        check_model_fits(sizes, model)
    if batch is not None:
        check_batch_fits(sizes, batch)
    axes = tuple(a for a in MESH_AXES if a in sizes)
    shape = tuple(sizes[a] for a in axes)
    return Mesh(device_grid(devices, shape, topology), axes)


def logical_to_mesh_spec(
    axes: tuple[str | None, ...], mesh: Mesh | None = None, members: str | None = None
) -> PartitionSpec:
    """The PartitionSpec of an array whose dimensions have these logical names, on `mesh`
    (default: a mesh without an expert axis), inside a member's step when `members` names
    the mesh axis of a group's member axis."""
    names = DENSE_AXES if mesh is None else tuple(mesh.axis_names)
    return linen_spmd.logical_to_mesh_axes(tuple(axes), rules(names, members))


def is_axes(x: Any) -> bool:
    """A tuple of logical axis names (None for a dimension without one): a leaf of an axes tree."""
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def param_shardings(mesh: Mesh, param_axes_tree: Any) -> Any:
    """NamedShardings for a tree of logical-axis tuples (e.g. `Model.param_axes()`)."""
    return jax.tree.map(
        lambda axes: NamedSharding(mesh, logical_to_mesh_spec(axes, mesh)),
        param_axes_tree,
        is_leaf=is_axes,
    )


def optimizer_state_shardings(
    mesh: Mesh, abstract_opt_state: Any, abstract_params: Any, param_axes_tree: Any
) -> Any:
    """Shardings for an optimizer state: a leaf shaped like a parameter (moments) is split
    like that parameter; any other leaf (counts, factored second moments) is replicated.

    Parameter-shaped leaves are matched by the parameter's path appearing at the end of the
    state leaf's path (optax states hold copies of the parameter tree).
    """
    flat_params = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    flat_axes = jax.tree.leaves(param_axes_tree, is_leaf=is_axes)
    by_path = {
        tuple(path): (leaf.shape, axes)
        for (path, leaf), axes in zip(flat_params, flat_axes, strict=True)
    }
    replicated = NamedSharding(mesh, PartitionSpec())

    def one(path: tuple, leaf: Any) -> NamedSharding:
        shape = getattr(leaf, "shape", ())
        for start in range(len(path)):
            hit = by_path.get(tuple(path[start:]))
            if hit is not None and tuple(hit[0]) == tuple(shape):
                return NamedSharding(mesh, logical_to_mesh_spec(hit[1], mesh))
        return replicated

    return jax.tree_util.tree_map_with_path(one, abstract_opt_state)


def batch_sharding(mesh: Mesh, members: str | None = None) -> NamedSharding:
    """Sharding of [B, ...] batch arrays: rows over (data, fsdp), the rest replicated (a
    member's rows leave `members`, its group's member axis, to the members)."""
    return NamedSharding(mesh, logical_to_mesh_spec(("batch",), mesh, members))


def shard_batch(mesh: Mesh, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """Assemble this process's rows of each feature into global arrays split over the mesh."""
    sharding = batch_sharding(mesh)
    axes = dict(rules(tuple(mesh.axis_names)))["batch"]
    split = math.prod(mesh.shape[a] for a in axes)
    out = {}
    for name, local in batch.items():
        local = np.asarray(local)
        rows = local.shape[0] * jax.process_count()
        if rows % split:
            raise MeshError(
                f"batch feature {name!r} has {rows} global rows, not divisible by the "
                f"{split} data-parallel shards ({' x '.join(f'mesh.{a}' for a in axes)}); choose "
                f"train.batch_size as a multiple of {split}"
            )
        out[name] = global_rows(sharding, local, 0)
    return out


def global_rows(sh: NamedSharding, local: np.ndarray, rows_axis: int) -> jax.Array:
    """One global array from this process's `local` array, whose axis `rows_axis` holds its
    batch rows (after stacked axes: members, steps); the other processes hold theirs."""
    shape = list(local.shape)
    shape[rows_axis] *= jax.process_count()
    return jax.make_array_from_process_local_data(sh, local, tuple(shape))


@contextlib.contextmanager
def axis_rules(mesh: Mesh, members: str | None = None) -> Iterator[Mesh]:
    """Activate the mesh and the logical rules, so models' activation constraints apply while
    tracing inside this block (a group's members split over the mesh axis `members`)."""
    with jax.set_mesh(mesh), flax_spmd.logical_axis_rules(rules(tuple(mesh.axis_names), members)):
        yield mesh


# int32 arrays a host holds per batch row position (tokens, targets, weights, segments,
# positions, ... of the encoder and decoder): an upper bound for the estimate below.
_ARRAYS_PER_POSITION = 8


def check_host_batch(cfg: ExperimentConfig, processes: int = 1) -> None:
    """Refuse, before anything is built or written, a batch whose host-side data alone would
    not fit this machine's memory (a typo such as train.batch_size=100000000 would otherwise
    grow for minutes while the data is built)."""
    encoder, decoder = feature_lengths(cfg.objective, cfg.model.is_encoder_decoder)
    rows = cfg.train.batch_size * cfg.train.steps_per_call / processes
    need = rows * (encoder + decoder) * 4 * _ARRAYS_PER_POSITION
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no such figure here: nothing to compare
        return
    if need > have:
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} (x steps_per_call="
            f"{cfg.train.steps_per_call}) needs about {need / 2**30:.0f} GiB of host memory "
            f"for one batch of {encoder + decoder}-position rows, more than this machine's "
            f"{have / 2**30:.0f} GiB; lower train.batch_size, or spread it over more hosts"
        )
