"""A roofline estimate of a compiled train step: how fast it could run on a TPU slice.

From the compiled program itself: per-device FLOPs and HBM bytes from XLA's cost analysis,
and the bytes each collective (all-gather, reduce-scatter, all-reduce, all-to-all,
collective-permute) moves, read from the compiled HLO text with its replica groups. With a
chip's datasheet peaks these give three lower bounds on the step time:

- compute: FLOPs / peak FLOP/s;
- memory: bytes accessed / HBM bandwidth;
- communication: bytes sent per device / ICI bandwidth, assuming each collective runs as a
  ring over one torus axis that uses that axis's two links (one each way), a collective moving
  (n - 1) / n of the full array per device (all-gather, reduce-scatter, all-to-all) or twice
  that (all-reduce), and collective-permute its result once.

The estimate is the largest of the three (perfect overlap of the others), so it is an upper
bound on speed and on MFU: a measured MFU sits below it. XLA's cost analysis counts a loop body
once, so for scanned layers the costs are taken from the same program unrolled at one and two
layers per stack and extrapolated linearly in depth (layers are identical: exact up to
fusion choices); `aot.compile_plan` does that.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_LINE = re.compile(
    r"= (?P<shape>\([^=]*?\)|\S+) (?P<op>" + "|".join(COLLECTIVES) + r")(?P<start>-start)?\("
)
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+)\[([\d,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_ITEMSIZE |= {"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


@dataclasses.dataclass(frozen=True)
class ChipLimits:
    """Datasheet peaks of one TPU chip (one JAX device with megacore)."""

    name: str
    flops_per_s: float  # dense bfloat16
    hbm_bytes_per_s: float
    ici_link_bytes_per_s: float  # one link, one direction


# Sources: Cloud TPU system architecture pages (docs.cloud.google.com/tpu/docs/v4, .../v5e,
# .../v5p, .../v6e) for peak bf16 FLOP/s and HBM bandwidth; per-link ICI bandwidth from the
# same pages where they give it per chip (v5e: 400 GB/s bidirectional over 4 ports -> 50 GB/s
# per link and direction) and otherwise from "How to Scale Your Model", part 2, TPU
# specifications table (jax-ml.github.io/scaling-book/tpus): v4 4.5e10, v5p 9e10, v6e 9e10
# bytes/s per link and direction.
TPU_LIMITS: tuple[tuple[str, ChipLimits], ...] = (
    ("TPU v4", ChipLimits("TPU v4", 275e12, 1.2e12, 4.5e10)),
    ("TPU v5 lite", ChipLimits("TPU v5e", 197e12, 8.19e11, 5.0e10)),
    ("TPU v5e", ChipLimits("TPU v5e", 197e12, 8.19e11, 5.0e10)),
    ("TPU v5p", ChipLimits("TPU v5p", 459e12, 2.765e12, 9.0e10)),
    ("TPU v5", ChipLimits("TPU v5p", 459e12, 2.765e12, 9.0e10)),
    ("TPU v6 lite", ChipLimits("TPU v6e", 918e12, 1.64e12, 9.0e10)),
    ("TPU v6e", ChipLimits("TPU v6e", 918e12, 1.64e12, 9.0e10)),
)


def chip_limits(device_kind: str) -> ChipLimits | None:
    """The datasheet limits of a TPU device kind (first substring match), or None."""
    for key, entry in TPU_LIMITS:
        if key.lower() in device_kind.lower():
            return entry
    return None


def _bytes(shape: str) -> int:
    return sum(
        _ITEMSIZE.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in _ARRAY.findall(shape)
    )


def _group_size(line: str, n_devices: int) -> int:
    """Devices per replica group of one collective (all devices when the line says none)."""
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", line):
        sizes = {a: int(n) for a, n in re.findall(r"'(\w+)'=(\d+)", m[1])}
        return math.prod(sizes[a] for a in re.findall(r"'(\w+)'", m[2]))
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line):
        return int(m[2])
    if m := re.search(r"replica_groups=\{\{([^}]*)\}", line):
        return len(m[1].split(","))
    return n_devices


def collective_bytes(hlo_text: str, n_devices: int) -> dict[str, float]:
    """Bytes one device sends per step for each collective kind (see the module doc)."""
    out = dict.fromkeys(COLLECTIVES, 0.0)
    for line in hlo_text.splitlines():
        m = _LINE.search(line)
        if m is None:
            continue
        op, shape = m["op"], m["shape"]
        arrays = _ARRAY.findall(shape)
        if m["start"] and op in ("all-gather", "collective-permute") and len(arrays) > 1:
            # Async starts return (operands..., results...): count the results.
            half = arrays[len(arrays) // 2 :] if op == "all-gather" else arrays[1:2]
            shape = " ".join(f"{d}[{s}]" for d, s in half)
        n = _group_size(line, n_devices)
        size = _bytes(shape)
        if op == "reduce-scatter":
            size *= n  # the result is one shard of the reduced array
        share = (n - 1) / n if n > 1 else 0.0
        factor = {"all-reduce": 2 * share, "collective-permute": 1.0}.get(op, share)
        out[op] += factor * size
    return out


def program_costs(compiled: Any, n_devices: int) -> dict[str, Any]:
    """Per-device FLOPs, HBM bytes accessed and collective bytes of a compiled program."""
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list | tuple) else cost) or {}
    return {
        "flops": float(cost.get("flops", 0.0)),
        "bytes": float(cost.get("bytes accessed", 0.0)),
        "collectives": collective_bytes(compiled.as_text(), n_devices),
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

    return {
        "flops": combine(lambda c: c["flops"]),
        "bytes": combine(lambda c: c["bytes"]),
        "collectives": {k: combine(lambda c, k=k: c["collectives"][k]) for k in COLLECTIVES},
    }


def estimate(
    costs: dict[str, Any], limits: ChipLimits, counted_flops: float, n_devices: int
) -> dict[str, Any]:
    """Compute, memory and communication times per step, the dominant bound, the estimated
    step time and MFU (model FLOPs `counted_flops` of the whole step over the slice's peak)."""
    compute_s = costs["flops"] / limits.flops_per_s
    memory_s = costs["bytes"] / limits.hbm_bytes_per_s
    comm_s = sum(costs["collectives"].values()) / (2 * limits.ici_link_bytes_per_s)
    times = {"compute": compute_s, "memory": memory_s, "communication": comm_s}
    bound = max(times, key=times.get)
    # No program runs the model's FLOPs faster than the slice's peak, whatever XLA counted.
    step_s = max(times[bound], counted_flops / (n_devices * limits.flops_per_s))
    return {
        "chip": limits.name,
        "compute_s": float(f"{compute_s:.4g}"),
        "memory_s": float(f"{memory_s:.4g}"),
        "communication_s": float(f"{comm_s:.4g}"),
        "collective_gib_per_chip": {
            k: round(v / 2**30, 4) for k, v in costs["collectives"].items() if v
        },
        "bound": bound,
        "est_step_s": float(f"{step_s:.4g}"),
        "est_mfu": round(counted_flops / (step_s * n_devices * limits.flops_per_s), 4),
    }
