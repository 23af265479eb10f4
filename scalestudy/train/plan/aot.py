"""Ahead-of-time compilation of the train step for the local devices or a TPU topology.

`compile_plan(cfg, topology)` lowers and compiles the step without running it, for a batch
of the shapes training feeds it, and reports what a launch needs to know before the hardware
exists: per-chip memory against the chip's HBM (fits or not), XLA's FLOPs against the counted
model FLOPs, and on a TPU a roofline estimate of the step time and MFU (`train/plan/roofline.py`)
beside the compiler's own estimate (`optimal_seconds`, which libtpu often leaves negative).
With `members=K` it plans a group instead (train/program.py: K runs of the shape as one
vmapped step, their member axis whole or split over the data axis as `mesh.members` says):
the group's memory per chip, and FLOPs counted for K runs.

TPU topologies need the TPU compiler (the `tpu` extra: libtpu), which runs on any Linux
host; no TPU is needed. Names: "v4:4x4x8" (chips along each axis) or a Cloud TPU type
such as "v4-256" or "v5e-8" (v4 and v5p types count TensorCores, two per chip; v5e and v6e
types count chips).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from scalestudy.config.errors import ScalestudyError
from scalestudy.config.experiment import ExperimentConfig
from scalestudy.data.batches import empty_features
from scalestudy.data.objectives import feature_lengths
from scalestudy.models import counting
from scalestudy.models.api import stack_depths
from scalestudy.models.decoder import scanned
from scalestudy.train import datasheets as chips
from scalestudy.train import program as train_program
from scalestudy.train import sharding, step
from scalestudy.train.plan import roofline
from scalestudy.train.rundir import logfile

# Chip generation -> (name in libtpu's topology names, torus dimensions, cores per chip in
# the Cloud TPU type name).
_GENERATIONS = {
    "v4": ("v4", 3, 2),
    "v5p": ("v5p", 3, 2),
    "v5e": ("v5e", 2, 1),
    "v5litepod": ("v5e", 2, 1),
    "v6e": ("v6e", 2, 1),
}
# The largest slice of each generation, in chips (libtpu crashes on shapes far beyond them).
_MAX_CHIPS = {"v4": 4096, "v5p": 8960, "v5e": 256, "v6e": 256}
_TOPOLOGY = re.compile(r"^(v4|v5p|v5e|v6e):(\d+(?:x\d+)+)$")
_CLOUD_TYPE = re.compile(r"^(v4|v5p|v5e|v5litepod|v6e)-(\d+)$")
_ACCEPTED = (
    "a topology such as v4:4x4x8, v5e:2x4, v5p:2x2x2, v6e:4x4, or a Cloud TPU type such as "
    "v4-256, v5e-8, v5p-16, v6e-8"
)


class TopologyError(ScalestudyError):
    """An unknown TPU topology name, or no TPU compiler installed."""


# Standard slice shapes by chip count (Cloud TPU documentation's slice tables).
_SLICES = {
    3: {
        4: "2x2x1",
        8: "2x2x2",
        16: "2x2x4",
        32: "2x4x4",
        64: "4x4x4",
        128: "4x4x8",
        256: "4x8x8",
        512: "8x8x8",
        1024: "8x8x16",
        2048: "8x16x16",
        4096: "16x16x16",
    },
    2: {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"},
}


def resolve_topology(name: str) -> tuple[str, int]:
    """(libtpu topology name, number of chips) for a topology or Cloud TPU type name."""
    if m := _TOPOLOGY.match(name):
        gen, shape = m.groups()
        dims = _GENERATIONS[gen][1]
        sizes = [int(s) for s in shape.split("x")]
        if len(sizes) != dims:
            raise TopologyError(
                f"--topology {name!r}: {gen} chips form a {dims}-D torus, so give {dims} "
                f"sizes; accepted: {_ACCEPTED}"
            )
        if min(sizes) < 1 or math.prod(sizes) > _MAX_CHIPS[gen]:
            raise TopologyError(
                f"--topology {name!r}: {math.prod(sizes)} chips; a {gen} slice has 1 to "
                f"{_MAX_CHIPS[gen]} chips, each size at least 1"
            )
        return name, math.prod(sizes)
    if m := _CLOUD_TYPE.match(name):
        gen, count = m.group(1), int(m.group(2))
        lib_name, dims, cores = _GENERATIONS[gen]
        chips, shapes = count // cores, _SLICES[dims]
        if chips * cores != count or chips not in shapes:
            unit = "TensorCores (2 per chip)" if cores == 2 else "chips"
            sizes = ", ".join(str(n * cores) for n in shapes)
            raise TopologyError(
                f"--topology {name!r}: {gen} types count {unit}; accepted sizes: {sizes} "
                f"(or give the shape itself, {lib_name}:AxB{'xC' if dims == 3 else ''})"
            )
        return f"{lib_name}:{shapes[chips]}", chips
    raise TopologyError(f"--topology {name!r} is not a TPU topology; accepted: {_ACCEPTED}")


# libtpu emits code on fibers whose default stack is too small for the convolution emitter's
# search over window configurations on some attention shapes: Wang et al.'s finetuning step
# with dropout (the attention probabilities' dropout keeps the reference attention, whose
# [B, H, L, S] products at 1,280 positions trigger it) crashed the compiler with a stack
# overflow. A 1 MiB fiber stack compiles it. The same compiler jits the step on a TPU VM, so
# the commands that train set it too (cli_commands._join_job).
COMPILER_FLAGS = ("--fibers_default_thread_stack_size=1048576",)


def libtpu_init_args(current: str = "") -> str:
    """`LIBTPU_INIT_ARGS` with `COMPILER_FLAGS` added, each unless `current` sets it already."""
    given = {arg.split("=", 1)[0] for arg in current.split()}
    added = [flag for flag in COMPILER_FLAGS if flag.split("=", 1)[0] not in given]
    return " ".join([*added, current]).strip()


def set_compiler_flags() -> None:
    """Add `COMPILER_FLAGS` to this process's `LIBTPU_INIT_ARGS`; libtpu reads it once, when
    first loaded, so call this before anything touches a TPU backend."""
    os.environ["LIBTPU_INIT_ARGS"] = libtpu_init_args(os.environ.get("LIBTPU_INIT_ARGS", ""))


def tpu_devices(name: str) -> list:
    """Compile-only devices of a TPU topology (one per chip)."""
    topo, chips = resolve_topology(name)
    if importlib.util.find_spec("libtpu") is None:
        raise TopologyError(
            f"--topology {name!r} needs the TPU compiler, which is not installed: install the "
            "`tpu` extra (pip install -e '.[tpu]'); it runs on this machine, no TPU needed. "
            "Without --topology the step compiles for the local devices"
        )
    # Compiling needs no TPU, so no exclusive hold on one: other processes on this host may
    # have loaded libtpu too.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    set_compiler_flags()
    from jax.experimental import topologies

    try:
        # "megacore": one JAX device per v4/v5p chip (its two TensorCores), as on the hardware.
        options = {"chip_config_name": "megacore"} if topo.split(":")[0] in ("v4", "v5p") else {}
        # libtpu's search for chips and hosts (no TPU here) is held: shown only on failure.
        with logfile.native_output_held("libtpu"):
            devices = topologies.get_topology_desc(topo, "tpu", **options).devices
    except Exception as e:
        raise TopologyError(
            f"--topology {name!r} ({topo}): the TPU compiler refused it "
            f"({type(e).__name__}: {str(e)[:200]}); accepted: {_ACCEPTED}"
        ) from None
    if len(devices) != chips:
        raise TopologyError(f"--topology {name!r}: expected {chips} chips, got {len(devices)}")
    return list(devices)


# A compile time no program reaches: JAX then writes no persistent cache entry.
NEVER_CACHED_SECONDS = 1e9


@contextlib.contextmanager
def _outside_the_cache(outside: bool) -> Iterator[None]:
    """No program compiled in the block enters JAX's persistent compilation cache, when
    `outside`: a program compiled for a TPU topology cannot be loaded back from it without a
    TPU client (reading the entry only warns, then compiles again). JAX decides once per
    process whether it uses the cache, so turning it off holds only where nothing has
    compiled yet; a minimum compile time that no program reaches keeps any entry from being
    written in every case."""
    if not outside:
        yield
        return
    names = ("jax_enable_compilation_cache", "jax_persistent_cache_min_compile_time_secs")
    before = [getattr(jax.config, name) for name in names]
    jax.config.update(names[0], False)
    jax.config.update(names[1], NEVER_CACHED_SECONDS)
    try:
        yield
    finally:
        for name, value in zip(names, before, strict=True):
            jax.config.update(name, value)


def abstract_batch(cfg: ExperimentConfig) -> dict[str, np.ndarray]:
    """A global training batch of the run's feature shapes (contents irrelevant), without
    reading data: the lengths the training pipeline lays rows out at."""
    encoder, decoder = feature_lengths(cfg.objective, cfg.model.is_encoder_decoder)
    return empty_features(cfg.train.batch_size, decoder, encoder)


def state_bytes_per_device(abstract_state: step.State) -> int:
    """Bytes of parameters and optimizer state held by one device under the state sharding
    (the abstract state's leaves carry their shardings)."""
    total = 0
    for leaf in jax.tree.leaves(abstract_state):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * np.dtype(leaf.dtype).itemsize
    return total


def state_plan(cfg: ExperimentConfig, topology: str) -> tuple[int, float | None]:
    """(bytes of parameters and optimizer state per chip, the chip's HBM in bytes or None)
    of `cfg` on a TPU `topology`, from shapes and shardings alone: nothing is compiled."""
    devices = tpu_devices(topology)
    mesh = sharding.make_mesh(cfg.mesh, devices, model=cfg.model, batch=cfg.train)
    program = train_program.build_program(cfg, abstract_batch(cfg), mesh, compile=False)
    entry = chips.chip(devices[0].device_kind)
    hbm = entry.hbm_gib * 2**30 if entry is not None else None
    return state_bytes_per_device(program.abstract_state), hbm


def _describe(
    cfg: ExperimentConfig, where: str, kind: str, mesh: Any, members: int
) -> dict[str, Any]:
    group = {"members": members, "members_split": cfg.mesh.members} if members > 1 else {}
    return {
        "target": where,
        "device_kind": kind,
        "mesh": dict(mesh.shape),
        **group,
        "params": counting.count_params(cfg.model)["total"],
        "batch": cfg.train.batch_size,
        "microbatches": cfg.train.microbatches,
        "remat": cfg.model.remat,
    }


def _compile(cfg: ExperimentConfig, devices: list, members: int = 1) -> tuple[Any, Any, step.State]:
    """(compiled train step or the compiler's refusal text, mesh, abstract state) for
    `devices`: one run's step, or with `members` > 1 the step of a group of that many."""
    # The batch (and a group's size) is checked against the mesh before anything is lowered.
    mesh = sharding.make_mesh(cfg.mesh, devices, model=cfg.model, batch=cfg.train)
    cfgs = [cfg]
    if members > 1:
        from scalestudy.train import members as member_keys

        cfgs = member_keys.seeded(cfg, members)
    program = train_program.build_program(cfgs, abstract_batch(cfg), mesh, compile=False)
    lowered, abstract = program.lower_train_step(), program.abstract_group_state
    split = program.member_axis
    with sharding.axis_rules(mesh, split):
        try:
            return lowered.compile(), mesh, abstract
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            # The TPU compiler refuses a program that cannot fit: that is the answer.
            return str(e), mesh, abstract


def unrolled_costs(cfg: ExperimentConfig, devices: list, members: int = 1) -> dict[str, Any]:
    """Per-device costs (`roofline.program_costs`) of the step at `cfg`'s depth, from the same
    program unrolled at one layer per stack and at two layers in each stack in turn,
    extrapolated linearly in depth (XLA's cost analysis counts a scanned loop body once)."""
    stacks = stack_depths(cfg.model)
    target = tuple(stacks.values())
    depths = [(1,) * len(stacks)] + [
        tuple(2 if j == i else 1 for j in range(len(stacks))) for i in range(len(stacks))
    ]
    costs = []
    for depth in depths:
        layers = {**dict(zip(stacks, depth, strict=True)), "scan_layers": False}
        probe = cfg.replace(model={**cfg.model.model_dump(), **layers})
        compiled, mesh, _ = _compile(probe, devices, members)
        if isinstance(compiled, str):
            raise ScalestudyError(f"compile: a {depth}-layer probe of the step did not fit")
        costs.append(_costs(compiled, mesh))
    return roofline.extrapolate(costs, depths, target)


def _costs(compiled: Any, mesh: Any) -> dict[str, Any]:
    devices = list(mesh.devices.flat)
    return roofline.program_costs(compiled, devices, chips.chip(devices[0].device_kind))


def compile_plan(
    cfg: ExperimentConfig,
    topology: str | None = None,
    costs: bool | str = True,
    members: int = 1,
) -> dict[str, Any]:
    """Compile the train step of `cfg` (or of a group of `members` runs of its shape) for the
    local devices or a TPU `topology` and report per-chip memory, XLA and counted FLOPs, and
    (TPU) a roofline step-time estimate.

    `costs=False` reports memory and fit alone: no FLOPs, no roofline, and so none of the
    unrolled probe programs a scanned stack's costs need (one more compile per layer stack
    plus one), which is most of a plan's compile time for a deep scanned model. `costs="fits"`
    adds the costs only to a program that fits (one compile of the program either way)."""
    if topology is None:
        devices = jax.devices()
        where = f"{len(devices)} local {devices[0].platform} devices"
    else:
        devices = tpu_devices(topology)
        where = f"{topology} ({resolve_topology(topology)[0]}, {len(devices)} chips)"
    with _outside_the_cache(topology is not None):  # the step and any cost probes
        return _plan(cfg, devices, where, costs, members)


def _plan(
    cfg: ExperimentConfig, devices: list, where: str, costs: bool | str, members: int
) -> dict[str, Any]:
    kind = devices[0].device_kind
    t = time.perf_counter()
    compiled, mesh, abstract = _compile(cfg, devices, members)
    described = _describe(cfg, where, kind, mesh, members)
    if isinstance(compiled, str):
        return {**described, "fits": False, "compiler": compiled[:300]}
    seconds = time.perf_counter() - t
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list | tuple) else cost) or {}

    gib = 2**30
    out = {**described, "compile_s": round(seconds, 1)}
    sizes = {
        name: getattr(memory, f"{name}_size_in_bytes", 0) or 0
        for name in ("argument", "output", "temp", "generated_code", "alias")
    }
    for name, value in sizes.items():
        out[f"{name}_gib"] = round(value / gib, 3)
    total = chips.program_bytes(compiled) or 0  # donated state is not counted twice
    out["total_gib_per_chip"] = round(total / gib, 3)
    state = state_bytes_per_device(abstract)
    out["state_gib_per_chip"] = round(state / gib, 3)  # parameters + optimizer state
    entry = chips.chip(kind)
    if entry is not None:
        out["hbm_gib_per_chip"] = entry.hbm_gib
        out["fits"] = total <= entry.hbm_gib * gib
    out["scanned"] = scanned(cfg.model)
    if costs is True or (costs == "fits" and out.get("fits", True)):
        out.update(_cost_report(cfg, compiled, mesh, devices, entry, members))
        # The compiler's own estimate; negative or absent where it has none.
        out["compiler_optimal_s"] = float(cost.get("optimal_seconds", -1.0))
    out["bytes_per_chip"] = {"state": state, **sizes, "total": total}
    return out


def _cost_report(
    cfg: ExperimentConfig,
    compiled: Any,
    mesh: Any,
    devices: list,
    entry: chips.Chip | None,
    members: int = 1,
) -> dict[str, Any]:
    """XLA's FLOPs against the counted ones and, for a chip with ICI figures, the roofline."""
    counted = members * cfg.train.batch_size * counting.flops(cfg)["flops_per_example"]
    # XLA counts one device's share of the step, and a scanned loop body once: the costs of
    # a scanned program come from its unrolled probes.
    if scanned(cfg.model):
        costs = unrolled_costs(cfg, devices, members)
    else:
        costs = _costs(compiled, mesh)
    out: dict[str, Any] = {"xla_flops_per_step": costs["flops"] * mesh.size}
    out["counted_flops_per_step"] = counted
    out["xla_over_counted"] = round(out["xla_flops_per_step"] / counted, 3)
    if entry is not None and entry.ici_link_bytes_per_s is not None:
        out["roofline"] = roofline.estimate(costs, entry, counted, mesh.size)
    return out
