"""Members benchmark: what K runs cost as one program (train/members.py) against K runs alone.

Two measures, both in CPU seconds (which other jobs on the cores move far less than wall time):

- the step: the group's compiled step against one run's, on fixed batches, in alternating
  rounds (medians of `rounds`), for K = 1, 2, 4, ... up to the K asked for. `cost_ratio` is
  the group's CPU time per step over one run's (K would be no saving at all);
- the whole run (`end_to_end`): K separate `scalestudy train --eval` processes, one after
  another, against one `scalestudy train --eval --members seed=0..K-1` process, each from an
  empty compilation cache, start to finished run directories. `end_to_end_ratio` is the
  group's CPU time over the K separate runs'.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from scalestudy.config.experiment import ExperimentConfig, to_yaml
from scalestudy.data import pipeline
from scalestudy.models import counting
from scalestudy.train import members
from scalestudy.train import program as train_program


def _timer(run: Any, state: Any, batch: Any) -> tuple[Any, Any]:
    """(state, seconds of CPU for `calls` calls) as a closure over the running state."""
    box = {"state": state}

    def timed(calls: int) -> float:
        out = None
        for _ in range(2):  # the first calls allocate
            box["state"], out = run(box["state"], batch)
        jax.block_until_ready(out)
        cpu = time.process_time()
        for _ in range(calls):
            box["state"], out = run(box["state"], batch)
        jax.block_until_ready(out)
        return time.process_time() - cpu

    return timed


def step_curve(
    cfg: ExperimentConfig, most: int, steps: int, rounds: int = 5
) -> list[dict[str, Any]]:
    """CPU time per step of groups of K = 1, 2, 4, ... `most` members against one run's,
    alternating rounds of `steps` steps (rounded up to whole calls)."""
    batch = next(pipeline.make_iterator(cfg, "train"))
    single = train_program.build_program(cfg, batch)
    k = single.steps_per_call if single.multi_step is not None else 1
    if k > 1:
        one = _timer(single.steps, single.init(0), single.shard_batches([batch] * k))
    else:
        one = _timer(single.step, single.init(0), single.shard_batch(batch))
    calls = -(-steps // k)
    sizes = sorted({2**i for i in range(most.bit_length()) if 2**i <= most} | {most})
    flops = cfg.train.batch_size * counting.flops(cfg)["flops_per_example"]
    rows = []
    for size in sizes:
        cfgs = members.seeded(cfg, size)
        t = time.process_time()
        program = train_program.build_program(cfgs, batch)
        compile_cpu = time.process_time() - t
        state = program.init(range(size))
        if k > 1:
            group = _timer(
                program.steps,
                state,
                program.shard_steps([[batch] * k] * size),
            )
        else:
            group = _timer(program.step, state, program.shard([batch] * size))
        alone, together = [], []
        for _ in range(rounds):
            alone.append(one(calls) / (calls * k))
            together.append(group(calls) / (calls * k))
        a, g = statistics.median(alone), statistics.median(together)
        rows.append(
            {
                "members": size,
                "program": train_program.program_kind(cfg, program.mesh, program.member_axis),
                "cpu_ms_per_step": round(1e3 * g, 3),
                "cpu_ms_per_member_step": round(1e3 * g / size, 3),
                "run_cpu_ms_per_step": round(1e3 * a, 3),
                "cost_ratio": round(g / a, 3),
                "gflops_per_cpu_s": round(size * flops / g / 1e9, 3),
                "compile_cpu_s": round(compile_cpu, 2),
            }
        )
    return rows


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _cli(args: list[str], cwd: Path, cache: Path) -> float:
    """CPU seconds of one `scalestudy` process (it and its children)."""
    env = {**os.environ, "SCALESTUDY_JAX_CACHE": str(cache)}
    before = _children_cpu()
    done = subprocess.run(
        [sys.executable, "-m", "scalestudy.cli.main", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise RuntimeError(f"scalestudy {' '.join(args)} failed: {done.stderr[-2000:]}")
    return _children_cpu() - before


def end_to_end(cfg: ExperimentConfig, size: int) -> dict[str, Any]:
    """CPU seconds of `size` whole runs (training and evaluation), separately and as one
    group, each side from an empty compilation cache."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "cfg.yaml").write_text(to_yaml(cfg))
        start = time.perf_counter()
        separate = sum(
            _cli(
                [
                    "train",
                    "--config",
                    "cfg.yaml",
                    "--workdir",
                    f"alone/seed{s}",
                    "--eval",
                    f"train.seed={s}",
                    f"data.seed={s}",
                ],
                root,
                root / "cache-alone",
            )
            for s in range(size)
        )
        wall_separate = time.perf_counter() - start
        start = time.perf_counter()
        grid = "seed=" + ",".join(map(str, range(size)))
        grouped = _cli(
            ["train", "--config", "cfg.yaml", "--workdir", "group", "--eval", "--members", grid],
            root,
            root / "cache-group",
        )
        wall_group = time.perf_counter() - start
        for s in range(size):  # the same runs, both ways
            a = _final_loss(root / "alone" / f"seed{s}")
            g = _final_loss(root / "group" / f"seed{s}")
            if not np.isclose(a, g, rtol=1e-3):
                raise RuntimeError(f"member seed{s}: final loss {g} in the group, {a} alone")
    return {
        "members": size,
        "steps": cfg.train.steps,
        "separate_cpu_s": round(separate, 2),
        "group_cpu_s": round(grouped, 2),
        "end_to_end_ratio": round(grouped / separate, 3),
        "separate_wall_s": round(wall_separate, 2),
        "group_wall_s": round(wall_group, 2),
    }


def _final_loss(workdir: Path) -> float:
    from scalestudy.train.rundir import layout as rundir

    return float(rundir.read_summary(workdir)["final_val_loss"])


def bench(
    cfg: ExperimentConfig, most: int, steps: int, *, whole_runs: bool = True
) -> dict[str, Any]:
    """The step curve up to `most` members and, with `whole_runs`, the end-to-end ratio at
    `most` members (runs of `cfg.train.steps` steps)."""
    curve = step_curve(cfg, most, steps)
    out: dict[str, Any] = {
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "arch": cfg.model.arch,
        "objective": cfg.objective.name,
        "params": counting.count_params(cfg.model)["total"],
        "batch": cfg.train.batch_size,
        "lengths": f"{cfg.objective.inputs_length}+{cfg.objective.targets_length}",
        "steps_per_call": cfg.train.steps_per_call,
        "load_1min": round(os.getloadavg()[0], 2),
        "cost_ratio": curve[-1]["cost_ratio"],
        "curve": curve,
    }
    if whole_runs:
        out |= end_to_end(cfg, most)
    return out
