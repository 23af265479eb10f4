"""Train-step benchmarks: throughput and MFU of each architecture at a preset size.

`bench(cfg, steps)` times compiled train steps on one fixed batch (the data pipeline is
benchmarked separately) and reports step time, tokens/s and MFU against `chips.peak_flops`
(the datasheet peak of the device kind for the compute dtype, or on CPU the measured matmul
peak of the host). Presets make a figure reproducible: `scalestudy bench train --preset 25m`.
"""

from __future__ import annotations

import time
from typing import Any

import jax

from scalestudy.bench.cells import cells
from scalestudy.config import ExperimentConfig, load_config
from scalestudy.data import pipeline
from scalestudy.errors import ConfigError
from scalestudy.models import counting
from scalestudy.train import chips, step

# Named sizes (config overrides). "small" is quick; "25m" is the ~25M-parameter decoder at
# 512 positions (384 inputs + 128 targets; the encoder-decoder encodes 384, decodes 128).
# Both unroll the layer stack on any platform, so a figure means the same program everywhere
# (docs/performance.md); `model.scan_layers=true` measures it scanned.
PRESETS: dict[str, tuple[str, ...]] = {
    "small": (
        "model.scan_layers=false",
        "model.d_model=128",
        "model.d_ff=512",
        "model.n_heads=4",
        "model.n_layers=2",
        "objective.name=plm",
        "objective.inputs_length=96",
        "objective.targets_length=32",
        "train.batch_size=32",
    ),
    "25m": (
        "model.scan_layers=false",
        "model.d_model=512",
        "model.d_ff=1408",
        "model.n_heads=8",
        "model.n_layers=8",
        "objective.name=plm",
        "objective.inputs_length=384",
        "objective.targets_length=128",
        "train.batch_size=8",
    ),
}


def preset_config(
    name: str = "small", seq: int | None = None, overrides: tuple[str, ...] = ()
) -> ExperimentConfig:
    """The config of preset `name`, optionally at `seq` positions (3/4 inputs, 1/4 targets),
    with `overrides` applied last."""
    if name not in PRESETS:
        raise ConfigError(f"bench preset {name!r} is not known; accepted: {', '.join(PRESETS)}")
    extra = ()
    if seq is not None:
        if seq < 4:
            raise ConfigError(f"bench --seq {seq}: give at least 4 positions")
        inputs, targets = seq - seq // 4, seq // 4
        extra = (f"objective.inputs_length={inputs}", f"objective.targets_length={targets}")
    return load_config(None, (*PRESETS[name], *extra, *overrides))


def time_train_steps(cfg: ExperimentConfig, steps: int) -> dict[str, Any]:
    """Step time, tokens/s and MFU of `steps` train steps of `cfg` on one fixed batch."""
    batch = next(pipeline.make_iterator(cfg, "train"))
    program = step.build_program(cfg, batch)
    state, device_batch = program.init(cfg.train.seed), program.shard_batch(batch)
    for _ in range(2):  # warm-up: first calls allocate
        state, m = program.train_step(state, device_batch)
    jax.block_until_ready(m)
    t = time.perf_counter()
    for _ in range(steps):
        state, m = program.train_step(state, device_batch)
    jax.block_until_ready(m)
    seconds = time.perf_counter() - t
    flops = steps * cfg.train.batch_size * counting.flops(cfg)["flops_per_example"]
    peak = chips.peak_flops(dtype=cfg.model.dtype)
    if "measured" in peak["source"]:
        # A shared CPU's speed drifts with its load: measure the peak again right after the
        # steps, and divide by the higher of the two (the lower, more honest MFU).
        again = chips.measured_peak_flops.__wrapped__()["flops_per_s"] * peak["devices"]
        peak["flops_per_s"] = max(peak["flops_per_s"], again)
    return {
        "objective": cfg.objective.name,
        "params": counting.count_params(cfg.model)["total"],
        "compile_s": round(program.compile_s, 2),
        "step_ms": round(1e3 * seconds / steps, 2),
        "tokens_per_s": round(steps * float(m["step_tokens"]) / seconds),
        "positions_per_s": round(steps * float(m["step_positions"]) / seconds),
        "mfu": round(chips.mfu(flops, seconds, peak["flops_per_s"]), 4),
        "peak_gflops": round(peak["flops_per_s"] / 1e9, 1),
    }


def bench(
    cfg: ExperimentConfig | None, steps: int, archs: tuple[str, ...] | None = None
) -> dict[str, Any]:
    """Train-step throughput of each architecture (or `archs`) at `cfg`'s size (default: the
    "small" preset): one row per architecture, and the peak MFU is measured against."""
    base = cfg if cfg is not None else preset_config("small")
    rows = cells(base, archs=archs, one_per_arch=True)
    peak = chips.peak_flops(dtype=base.model.dtype)
    out: dict[str, Any] = {
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "dtype": base.model.dtype,
        "peak_gflops": round(peak["flops_per_s"] / 1e9, 2),
        "peak_source": peak["source"],
        "batch": base.train.batch_size,
        "lengths": f"{base.objective.inputs_length}+{base.objective.targets_length}",
    }
    for arch, _, cell in rows:
        out[arch] = time_train_steps(cell, steps)
    return out
