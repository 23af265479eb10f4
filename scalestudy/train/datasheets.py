"""Accelerator datasheets, peak FLOP/s and model-FLOPs utilisation.

MFU = counted model FLOPs per second of train-step time / peak FLOP/s of all global devices.
The peak of one device is its datasheet peak for the compute dtype (`CHIPS`, by JAX device
kind); a CPU has no datasheet entry, so its peak is measured: the best throughput of large
matmuls on this host (float32 and bfloat16, the faster of the two), counted once per host
process since every fake CPU device shares the same cores.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from scalestudy.config.errors import ConfigError

if TYPE_CHECKING:
    from scalestudy.config.experiment import ExperimentConfig


@dataclasses.dataclass(frozen=True)
class Chip:
    """Datasheet figures of one accelerator: dense peak FLOP/s per JAX device by compute
    dtype, memory (HBM) per JAX device and its bandwidth, and (TPU) the chip's inter-chip
    interconnect: bidirectional bandwidth over all its ports, and the number of ports (two per
    torus dimension)."""

    name: str
    peak_bf16: float
    peak_fp32: float
    hbm_gib: float
    hbm_bytes_per_s: float
    ici_bytes_per_s: float | None = None  # bidirectional, all ports together
    ici_ports: int | None = None

    @property
    def ici_link_bytes_per_s(self) -> float | None:
        """One port, one direction: the bidirectional total over ports and directions."""
        if self.ici_bytes_per_s is None or not self.ici_ports:
            return None
        return self.ici_bytes_per_s / (2 * self.ici_ports)


# Matched against `jax.Device.device_kind` by substring, first match wins (so "v5 lite"
# precedes "v5"). TPU float32 matmuls run as bfloat16 passes at default precision, so the
# bfloat16 peak is the TPU's only peak; GPU float32 is the TF32 tensor-core peak, which
# JAX's default matmul precision uses. A v4/v5p JAX device is one chip (megacore).
# Sources, TPU: the Cloud TPU system architecture pages (docs.cloud.google.com/tpu/docs/v4,
# .../v5e, .../v5p, .../v6e): peak bf16, HBM capacity and bandwidth, bidirectional ICI per chip
# and ICI ports (v5e 400 GB/s over 4, v5p 1200 GB/s over 6, v6e 800 GB/s over 4). The v4 page
# gives no per-chip ICI figure, only "all-reduce bandwidth per Pod 1.1 PB/s" over 4096 chips;
# on v5e that pod figure per chip (51.2 TB/s / 256) is half the per-chip bidirectional one, so
# v4's is taken as 2 x 1.1e15 / 4096 over its 6 ports (45 GB/s per port and direction).
# GPU: the vendors' datasheets (HBM bandwidth; NVLink is not modelled).
CHIPS: tuple[tuple[str, Chip], ...] = (
    ("TPU v4", Chip("TPU v4", 275e12, 275e12, 32, 1.2e12, 2 * 1.1e15 / 4096, 6)),
    ("TPU v5 lite", Chip("TPU v5e", 197e12, 197e12, 16, 8.19e11, 4.0e11, 4)),
    ("TPU v5e", Chip("TPU v5e", 197e12, 197e12, 16, 8.19e11, 4.0e11, 4)),
    ("TPU v5p", Chip("TPU v5p", 459e12, 459e12, 95, 2.765e12, 1.2e12, 6)),
    ("TPU v5", Chip("TPU v5p", 459e12, 459e12, 95, 2.765e12, 1.2e12, 6)),
    ("TPU v6 lite", Chip("TPU v6e", 918e12, 918e12, 32, 1.638e12, 8.0e11, 4)),
    ("TPU v6e", Chip("TPU v6e", 918e12, 918e12, 32, 1.638e12, 8.0e11, 4)),
    ("A100-SXM4-40GB", Chip("A100 SXM 40GB", 312e12, 156e12, 40, 1.555e12)),
    ("A100", Chip("A100 SXM", 312e12, 156e12, 80, 2.039e12)),
    ("H100 PCIe", Chip("H100 PCIe", 756e12, 378e12, 80, 2.0e12)),
    ("H100", Chip("H100 SXM", 989e12, 495e12, 80, 3.35e12)),
    ("H200", Chip("H200 SXM", 989e12, 495e12, 141, 4.8e12)),
)


def chip(device_kind: str) -> Chip | None:
    """The datasheet entry for a JAX device kind, or None (CPU, unknown accelerators)."""
    for key, entry in CHIPS:
        if key.lower() in device_kind.lower():
            return entry
    return None


@functools.cache
def measured_peak_flops(sizes: tuple[int, ...] = (1024, 2048), repeats: int = 3) -> dict:
    """Best measured matmul FLOP/s of this host: {"flops_per_s", "dtype", "n"}.

    One device runs the matmuls: the host's cores are shared by all its (fake) devices, and
    XLA's CPU matmul uses every core. The sizes are large enough to leave the caches.
    """
    device = jax.local_devices()[0]
    best = {"flops_per_s": 0.0, "dtype": "float32", "n": 0}
    for dtype in (jnp.float32, jnp.bfloat16):
        for n in sizes:
            x = jax.device_put(jnp.ones((n, n), dtype), device)
            matmul = jax.jit(lambda a: a @ a)
            matmul(x).block_until_ready()
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                matmul(x).block_until_ready()
                times.append(time.perf_counter() - t)
            rate = 2 * n**3 / min(times)
            if rate > best["flops_per_s"]:
                best = {"flops_per_s": rate, "dtype": jnp.dtype(dtype).name, "n": n}
    return best


def peak_flops(
    device_kind: str | None = None, dtype: str = "bfloat16", n_devices: int | None = None
) -> dict[str, Any]:
    """Peak FLOP/s of `n_devices` (default: all global devices) of `device_kind` (default:
    this job's) for compute `dtype`: {"flops_per_s", "per_device", "devices", "source"}.

    A kind without a datasheet entry (CPU) uses the measured peak of this host, times the
    number of host processes.
    """
    kind = device_kind if device_kind is not None else jax.devices()[0].device_kind
    entry = chip(kind)
    if entry is not None:
        per_device = entry.peak_fp32 if dtype == "float32" else entry.peak_bf16
        n = n_devices if n_devices is not None else jax.device_count()
        source = f"datasheet {entry.name} {dtype}"
    else:
        measured = measured_peak_flops()
        per_device = measured["flops_per_s"]
        n = n_devices if n_devices is not None else jax.process_count()
        source = f"measured {measured['n']}^3 {measured['dtype']} matmul on {kind}"
    return {"flops_per_s": per_device * n, "per_device": per_device, "devices": n, "source": source}


def mfu(model_flops: float, seconds: float, peak_flops_per_s: float | None = None) -> float:
    """Model FLOPs utilisation: `model_flops` (counted, global) done in `seconds` of train-step
    time, against `peak_flops_per_s` (default: `peak_flops()` of this job)."""
    if seconds <= 0:
        return 0.0
    peak = peak_flops_per_s if peak_flops_per_s is not None else peak_flops()["flops_per_s"]
    return model_flops / seconds / peak


def program_bytes(compiled: Any) -> int | None:
    """Device memory one compiled program holds while it runs, per device: its arguments, its
    outputs (less those aliased to donated arguments), its temporaries and its code (XLA's own
    memory analysis of the compiled executable; None where the backend gives none)."""
    try:
        memory = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError, AttributeError):
        return None
    if memory is None:
        return None
    size = {
        name: getattr(memory, f"{name}_size_in_bytes", 0) or 0
        for name in ("argument", "output", "temp", "generated_code", "alias")
    }
    return size["argument"] + size["output"] - size["alias"] + size["temp"] + size["generated_code"]


def device_memory(device: Any) -> int | None:
    """Bytes one device can allocate: an accelerator's allocator limit; a CPU device's share of
    this host's memory (fake CPU devices share it); None where neither is known."""
    if device.platform == "cpu":
        import os

        try:
            host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
        return host // max(1, len(jax.local_devices(backend="cpu")))
    try:
        stats = device.memory_stats() or {}
    except (NotImplementedError, RuntimeError):
        return None
    return stats.get("bytes_limit")


class ProgramMemoryError(ConfigError):
    """A compiled train step needs more memory than a device has: refused before it runs."""


def check_params_fit(cfg: ExperimentConfig) -> None:
    """Refuse, before anything is built or written, a model whose parameters alone need more
    memory than all of this job's devices have together: what training holds is more
    (optimizer state, gradients, activations), and `check_fits` would refuse it only after
    compiling the step."""
    from scalestudy.models.counting import count_params

    device = jax.local_devices()[0]
    per_device = device_memory(device)
    if per_device is None:
        return
    have = per_device * jax.device_count()
    m = cfg.model
    n = count_params(m)["total"]
    need = n * jnp.dtype(m.param_dtype).itemsize
    if need > have:
        raise ProgramMemoryError(
            f"the model's {n:,} parameters alone need {need / 2**30:.1f} GiB in {m.param_dtype} "
            f"(model.param_dtype), more than the {have / 2**30:.1f} GiB of this job's "
            f"{jax.device_count()} {device.platform} device(s) together, before any optimizer "
            f"state or activations; lower model.d_model={m.d_model}, model.d_ff={m.d_ff}, "
            f"model.n_layers={m.n_layers} or model.vocab_size={m.vocab_size}, or add devices"
        )


def check_fits(
    cfg: ExperimentConfig, compiled: Any, mesh: jax.sharding.Mesh, members: int = 1
) -> None:
    """Refuse a compiled train step (of one run, or of a group of `members`) whose memory
    (XLA's analysis of the executable) is more than one of the mesh's devices has, before its
    first allocation fails deep in the runtime. A step not compiled yet
    (`CompiledOnFirstCall`) is not checked."""
    need = program_bytes(compiled) if hasattr(compiled, "memory_analysis") else None
    device = mesh.devices.flat[0]
    have = device_memory(device)
    if need is None or have is None or need <= have:
        return
    t, o = cfg.train, cfg.objective
    shape = f"train.batch_size={t.batch_size} over {mesh.devices.size} devices"
    shape += f", {members} members" if members > 1 else ""
    shape += f", objective.inputs_length={o.inputs_length}, targets_length={o.targets_length}"
    fewer = "train fewer members together, " if members > 1 else ""
    raise ProgramMemoryError(
        f"the train step needs about {need / 2**30:.1f} GiB per device, more than the "
        f"{have / 2**30:.1f} GiB a {device.platform} device has here ({shape}); lower the "
        "batch size (a finetune's batch_size=) or the lengths, split the batch with "
        f"train.microbatches, {fewer}or add devices"
    )
