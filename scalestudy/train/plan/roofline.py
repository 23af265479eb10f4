"""A roofline estimate of a compiled train step: how fast it could run on a TPU slice.

From the compiled program itself: per-device FLOPs and HBM bytes from XLA's cost analysis,
and every collective (all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute)
read from the compiled HLO text with its replica groups. With the chip's datasheet
(`chips.CHIPS`) these give three lower bounds on the step time:

- compute: FLOPs / peak FLOP/s;
- memory: bytes accessed / HBM bandwidth;
- communication: each collective moves the least a bandwidth-optimal algorithm must move
  through one device, (n - 1) / n of the array for all-gather, reduce-scatter and all-to-all
  and twice that for all-reduce, its result for collective-permute. A group of devices spread
  over k torus axes of the slice (from the chips' coordinates) receives over the 2k ports of
  those axes (both neighbours on each axis, as on a torus with wraparound), each at the
  datasheet's bandwidth per port and direction. Collectives on different axes overlap; those
  on one axis queue: the time is the busiest axis's bytes over its two ports.

An asynchronous collective appears in the compiled HLO several times (its start,
continuations and done are cloned into separate computations), so a channel id already counted
in another computation is a clone; within one computation each collective counts, as distinct
ones may share a channel id (every `all_to_all` of a `shard_map` has channel 1). The
estimate is the largest of the three times (perfect overlap of the others) and
never beats the slice's peak on the counted model FLOPs: a lower bound on step time, so an
upper bound on MFU, which a measured MFU sits below. Where the optimistic choices bite: the
ports of an axis without wraparound (small slices) are counted as if it had it, and routes
over the axes a group does not span are not used. XLA's cost analysis counts a loop body once,
so for scanned layers the costs come from the same program unrolled at one and two layers per
stack, extrapolated linearly in depth (`aot.unrolled_costs`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from scalestudy.train.datasheets import Chip

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_LINE = re.compile(
    r"= (?P<shape>\([^=]*?\)|\S+) (?P<op>" + "|".join(COLLECTIVES) + r")(?P<start>-start)?\("
)
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+)\[([\d,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_ITEMSIZE |= {"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
# Bytes through one device, in units of the collective's array (n devices per group).
_TRAFFIC = {"all-reduce": lambda n: 2 * (n - 1) / n, "collective-permute": lambda n: 1.0}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program: its kind, the bytes of the array it is defined
    over (the gathered result, the scattered operand, the reduced or exchanged array) and its
    groups of device positions (logical ids, the order of the mesh's devices)."""

    kind: str
    array_bytes: int
    groups: np.ndarray  # [groups, devices per group]

    @property
    def bytes_per_device(self) -> float:
        """The least bytes a bandwidth-optimal algorithm moves through one device."""
        n = self.groups.shape[1]
        if n <= 1:
            return 0.0
        return _TRAFFIC.get(self.kind, lambda n: (n - 1) / n)(n) * self.array_bytes


def _bytes(shape: str) -> int:
    return sum(
        _ITEMSIZE.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in _ARRAY.findall(shape)
    )


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """XLA's iota device list: arange over `dims`, transposed by `perm`."""
    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(math.prod(shape)).reshape(shape)
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def replica_groups(line: str, n_devices: int) -> np.ndarray:
    """Device positions of each replica group of one collective's HLO line, [groups, size]
    (one group of every device when the line names none)."""
    if m := re.search(r"source_target_pairs=\{(\{[\d,{}]*\})\}", line):
        return np.array([[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m[1])])
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\]", line):
        axes = re.findall(r"'(\w+)'=(\d+)", m[1])
        sizes = [int(n) for _, n in axes]
        rest = line[m.end() :]
        ids = np.arange(math.prod(sizes))
        if d := re.match(r", device_ids=\(?\[([\d,]+)\](?:T\(([\d,]+)\))?", rest):
            ids = _iota(d[1], d[2]).reshape(-1)
        ids = ids.reshape(sizes)
        named = re.match(r"(?:, device_ids=\S+)? \{([^}]*)\}", rest)
        inside = re.findall(r"'(\w+)'", named[1]) if named else [a for a, _ in axes]
        order = [i for i, (a, _) in enumerate(axes) if a not in inside]
        order += [[a for a, _ in axes].index(a) for a in inside]
        size = math.prod(sizes[[a for a, _ in axes].index(a)] for a in inside)
        return ids.transpose(order).reshape(-1, size)
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line):
        return _iota(m[3], m[4]).reshape(int(m[1]), int(m[2]))
    if m := re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", line):
        groups = [[int(i) for i in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", m[1])]
        if groups and len({len(g) for g in groups}) == 1:
            return np.array(groups)
    return np.arange(n_devices).reshape(1, n_devices)


def parse_collectives(hlo_text: str, n_devices: int) -> list[Collective]:
    """Every collective of a compiled program's HLO text, clones of one in other
    computations left out."""
    out, seen, computation = [], {}, None
    for line in hlo_text.splitlines():
        if line[:1].strip() and line.rstrip().endswith("{"):  # a computation's header
            computation = line.split("(")[0]
            continue
        m = _LINE.search(line)
        if m is None and "/*" in line:  # long tuples carry /*index=N*/ comments
            m = _LINE.search(line := re.sub(r"/\*.*?\*/", "", line))
        if m is None:
            continue
        op, shape = m["op"], m["shape"]
        channel = re.search(r"channel_id=(\d+)", line)
        if channel and seen.setdefault((op, channel[1]), computation) != computation:
            continue
        arrays = _ARRAY.findall(shape)
        if m["start"] and op in ("all-gather", "collective-permute") and len(arrays) > 1:
            # Async starts return (operands..., results...): the results count.
            half = arrays[len(arrays) // 2 :] if op == "all-gather" else arrays[1:2]
            shape = " ".join(f"{d}[{s}]" for d, s in half)
        groups = replica_groups(line, n_devices)
        size = _bytes(shape)
        if op == "reduce-scatter":
            size *= groups.shape[1]  # the result is one shard of the reduced array
        out.append(Collective(op, size, groups))
    return out


def spanned_axes(group: Sequence[int], coords: Sequence[Sequence[int]] | None, dims: int):
    """The torus axes along which the chips of one group lie (all `dims` axes when the
    devices have no coordinates)."""
    if coords is None:
        return tuple(range(dims))
    points = np.array([coords[i] for i in group])
    return tuple(int(a) for a in np.flatnonzero(points.max(axis=0) != points.min(axis=0)))


def device_coords(devices: Sequence[Any]) -> list[tuple[int, ...]] | None:
    """Torus coordinates of `devices` (logical id order), or None where they have none."""
    coords = [getattr(d, "coords", None) for d in devices]
    if any(c is None for c in coords):
        return None
    return [tuple(int(x) for x in c) for c in coords]


def communication(collectives: list[Collective], coords, dims: int) -> dict[str, Any]:
    """Bytes per device by collective kind, and by torus axis: each collective's bytes are
    spread evenly over the axes its groups span."""
    kinds = dict.fromkeys(COLLECTIVES, 0.0)
    axes: dict[str, float] = {}
    for c in collectives:
        sent = c.bytes_per_device
        if not sent:
            continue
        kinds[c.kind] += sent
        spanned = spanned_axes(c.groups[0], coords, dims) or tuple(range(dims))
        for a in spanned:
            axes[str(a)] = axes.get(str(a), 0.0) + sent / len(spanned)
    return {"collectives": kinds, "axis_bytes": axes}


def program_costs(compiled: Any, devices: Sequence[Any], chip: Chip | None) -> dict[str, Any]:
    """Per-device FLOPs, HBM bytes accessed and collective bytes (by kind and by torus axis)
    of a compiled program over `devices`, in the mesh's device order."""
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list | tuple) else cost) or {}
    dims = (chip.ici_ports or 2) // 2 if chip is not None else 1
    collectives = parse_collectives(compiled.as_text(), len(devices))
    return {
        "flops": float(cost.get("flops", 0.0)),
        "bytes": float(cost.get("bytes accessed", 0.0)),
        **communication(collectives, device_coords(devices), dims),
    }


def extrapolate(costs: list[dict[str, Any]], depths: list[tuple[int, ...]], target) -> dict:
    """Costs at per-stack depths `target`, linear in each stack's depth, from programs at
    `depths`: the first is the base, each other adds one layer to one stack."""
    base, base_depth = costs[0], depths[0]

    def combine(pick) -> float:
        total = pick(base)
        for c, d in zip(costs[1:], depths[1:], strict=True):
            stack = next(i for i, (a, b) in enumerate(zip(d, base_depth)) if a != b)
            total += (target[stack] - base_depth[stack]) * (pick(c) - pick(base))
        return total

    axes = sorted({a for c in costs for a in c["axis_bytes"]})
    return {
        "flops": combine(lambda c: c["flops"]),
        "bytes": combine(lambda c: c["bytes"]),
        "collectives": {k: combine(lambda c, k=k: c["collectives"][k]) for k in COLLECTIVES},
        "axis_bytes": {a: combine(lambda c, a=a: c["axis_bytes"].get(a, 0.0)) for a in axes},
    }


def estimate(
    costs: dict[str, Any], chip: Chip, counted_flops: float, n_devices: int
) -> dict[str, Any]:
    """Compute, memory and communication times per step, the dominant bound, the estimated
    step time and MFU (model FLOPs `counted_flops` of the whole step over the slice's peak)."""
    compute_s = costs["flops"] / chip.peak_bf16
    memory_s = costs["bytes"] / chip.hbm_bytes_per_s
    busiest = max(costs["axis_bytes"].values(), default=0.0)
    comm_s = busiest / (2 * chip.ici_link_bytes_per_s) if busiest else 0.0
    times = {"compute": compute_s, "memory": memory_s, "communication": comm_s}
    bound = max(times, key=times.get)
    # No program runs the model's FLOPs faster than the slice's peak, whatever XLA counted.
    step_s = max(times[bound], counted_flops / (n_devices * chip.peak_bf16))
    return {
        "chip": chip.name,
        "compute_s": float(f"{compute_s:.4g}"),
        "memory_s": float(f"{memory_s:.4g}"),
        "communication_s": float(f"{comm_s:.4g}"),
        "collective_gib_per_chip": {
            k: round(v / 2**30, 4) for k, v in costs["collectives"].items() if v
        },
        "bound": bound,
        "est_step_s": float(f"{step_s:.4g}"),
        "est_mfu": round(counted_flops / (step_s * n_devices * chip.peak_bf16), 4),
    }
