"""Train-step benchmarks: throughput and MFU of each architecture at a preset size.

`bench(cfg, steps)` times compiled train steps on one fixed batch (the data pipeline is
benchmarked separately) and reports step time, tokens/s and MFU against `chips.peak_flops`
(the datasheet peak of the device kind for the compute dtype, or on CPU the measured matmul
peak of the host); on CPU also `mfu_cpu`, the step's counted FLOPs per CPU second against the
host's matmul FLOPs per CPU second (`cpu_peak_flops`), which the load of other jobs moves far
less than wall time. Steps run `train.steps_per_call` to a call, as in training. Presets make
a figure reproducible: `scalestudy bench train --preset 25m`.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scalestudy.bench.cells import cells
from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import ExperimentConfig, load_config
from scalestudy.data import pipeline
from scalestudy.models import counting
from scalestudy.train import datasheets
from scalestudy.train import program as train_program

# Named sizes (config overrides). "small" is quick; "25m" is the ~25M-parameter decoder at
# 512 positions (384 inputs + 128 targets; the encoder-decoder encodes 384, decodes 128).
# Both unroll the layer stack on any platform, so a figure means the same program everywhere
# (docs/performance.md); `model.scan_layers=true` measures it scanned.
# The main job's runs (configs/studies/smoke.yaml) at three of its sizes, for `--members`.
_SMOKE = (
    "model.scan_layers=false",
    "model.vocab_size=384",
    "model.dtype=float32",
    "model.dropout=0.0",
    "model.n_heads=4",
    "objective.name=plm",
    "objective.inputs_length=96",
    "objective.targets_length=32",
    "optim.learning_rate=5e-3",
    "optim.warmup_steps=30",
    "train.batch_size=16",
    "train.steps=300",
    "train.steps_per_call=10",
    "train.eval_batches=16",
    "train.checkpoint_every=300",
    "train.keep_last=1",
    "train.progress=false",
    "eval.max_examples=400",
    "eval.inputs_length=48",
    "eval.targets_length=24",
)
PRESETS: dict[str, tuple[str, ...]] = {
    "smoke10k": (*_SMOKE, "model.d_model=16", "model.n_layers=3", "model.d_ff=40"),
    "smoke40k": (*_SMOKE, "model.d_model=32", "model.n_layers=3", "model.d_ff=88"),
    "smoke300k": (*_SMOKE, "model.d_model=80", "model.n_layers=4", "model.d_ff=216"),
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


def cpu_peak_flops(sizes: tuple[int, ...] = (512, 1024), repeats: int = 3) -> float:
    """Best float32 matmul FLOPs per CPU second (every thread of this process) on this host:
    the peak a step's CPU time is measured against. Unlike FLOPs per wall second it does not
    fall when other jobs share the cores (each core-second still does the same work)."""
    best = 0.0
    for n in sizes:
        x = jnp.ones((n, n), jnp.float32)
        matmul = jax.jit(lambda a: a @ a)
        matmul(x).block_until_ready()
        for _ in range(repeats):
            start = time.process_time()
            for _ in range(4):
                matmul(x).block_until_ready()
            best = max(best, 4 * 2 * n**3 / max(time.process_time() - start, 1e-9))
    return best


def time_train_steps(cfg: ExperimentConfig, steps: int) -> dict[str, Any]:
    """Step time (wall and CPU), tokens/s and MFU of `steps` train steps of `cfg` on one fixed
    batch, `train.steps_per_call` steps to a compiled call as the training loop runs them
    (`steps` rounded up to whole calls)."""
    batch = next(pipeline.make_iterator(cfg, "train"))
    program = train_program.build_program(cfg, batch)
    state = program.init(cfg.train.seed)
    k = program.steps_per_call if program.multi_step is not None else 1
    if k > 1:
        run, device_batch = program.steps, program.shard_batches([batch] * k)
    else:
        run, device_batch = program.step, program.shard_batch(batch)
    for _ in range(2):  # warm-up: first calls allocate
        state, m = run(state, device_batch)
    jax.block_until_ready(m)
    calls = -(-steps // k)
    steps = calls * k
    t, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        state, m = run(state, device_batch)
    jax.block_until_ready(m)
    seconds, cpu_s = time.perf_counter() - t, time.process_time() - cpu
    step_tokens, step_positions = (
        float(np.mean(m[name])) for name in ("step_tokens", "step_positions")
    )
    flops = steps * cfg.train.batch_size * counting.flops(cfg)["flops_per_example"]
    peak = datasheets.peak_flops(dtype=cfg.model.dtype)
    out: dict[str, Any] = {}
    if "measured" in peak["source"]:
        # A shared CPU's speed drifts with its load: measure the peak again right after the
        # steps, and divide by the higher of the two (the lower, more honest MFU).
        again = datasheets.measured_peak_flops.__wrapped__()["flops_per_s"] * peak["devices"]
        peak["flops_per_s"] = max(peak["flops_per_s"], again)
        # Also per CPU second, which other jobs on the cores change far less than wall time.
        out["mfu_cpu"] = round(flops / cpu_s / cpu_peak_flops(), 4)
    return {
        "objective": cfg.objective.name,
        "params": counting.count_params(cfg.model)["total"],
        "steps_per_call": k,
        "compile_s": round(program.compile_s, 2),
        "step_ms": round(1e3 * seconds / steps, 2),
        "cpu_ms": round(1e3 * cpu_s / steps, 2),
        "tokens_per_s": round(steps * step_tokens / seconds),
        "positions_per_s": round(steps * step_positions / seconds),
        "mfu": round(datasheets.mfu(flops, seconds, peak["flops_per_s"]), 4),
        **out,
        "peak_gflops": round(peak["flops_per_s"] / 1e9, 1),
    }


def bench(
    cfg: ExperimentConfig | None, steps: int, archs: tuple[str, ...] | None = None
) -> dict[str, Any]:
    """Train-step throughput of each architecture (or `archs`) at `cfg`'s size (default: the
    "small" preset): one row per architecture, and the peak MFU is measured against."""
    base = cfg if cfg is not None else preset_config("small")
    rows = cells(base, archs=archs, one_per_arch=True)
    peak = datasheets.peak_flops(dtype=base.model.dtype)
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
