"""`scalestudy bench gpu`: the accelerator table, in one process, within a few minutes.

What it measures, in order of what matters most (each row is written to `--out` as one JSON
line the moment it is measured, so a run cut short keeps what it finished, and no new row
starts after `budget_s`):

1. agreement: cuDNN against the XLA reference on one bfloat16 batch for the three
   architectures with the relative bias and with RoPE: the largest logit difference (and the
   logits' scale), and the gradients' relative difference (norm of the difference over the
   norm of the reference's);
2. the package's default model (relative bias, gated GELU, z-loss) at 350M (d 1024, 16
   heads, 24 layers, d_ff 4096, 1024 positions, batch 16), causal FLM, non-causal PLM and
   encoder-decoder PLM (512 + 512), unrolled, `attention_impl` auto and xla;
3. the peer's shapes (nanodo: GELU MLP, no position table, tied embeddings) at 125M and
   350M: nanodo, ours unrolled with cuDNN, ours scanned with cuDNN, and ours on the XLA
   fallback as one full product with float32 logits (the old path), in causal blocks, and in
   causal blocks with compute-dtype logits;
4. members: K = 1 and 8 of a 10M-parameter decoder, wall time per step.

Step time: 2 warm-up steps, then the median of 3 rounds of 10 steps by wall clock (the
accelerator is not shared). MFU: counted FLOPs per second over the datasheet bfloat16 peak
of the device kind (`train/datasheets.py`). Compile time is the first call's.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scalestudy.config.experiment import ExperimentConfig, load_config
from scalestudy.data import pipeline
from scalestudy.models import attention, counting
from scalestudy.train import datasheets
from scalestudy.train import program as train_program

SIZE_350M = ("model.d_model=1024", "model.n_heads=16", "model.n_layers=24", "model.d_ff=4096")
SIZE_125M = ("model.d_model=768", "model.n_heads=12", "model.n_layers=12", "model.d_ff=3072")
LENGTH = ("objective.inputs_length=512", "objective.targets_length=512")
# nanodo's model and optimiser settings: the peer rows train the same model in both codes.
PEER = (
    "model.activation=gelu",
    "model.position=none",
    "model.tie_embeddings=true",
    "model.arch=causal_decoder",
    "objective.name=flm",
    "optim.schedule=constant",
    "optim.warmup_steps=0",
    "optim.grad_clip_norm=null",
    *LENGTH,
)
COMMON = (
    "model.dtype=bfloat16",
    "model.param_dtype=float32",
    "model.dropout=0.0",
    "model.vocab_size=32128",
    "model.scan_layers=false",
    "data.synthetic.n_train_documents=4000",
    "data.synthetic.n_validation_documents=16",
    "optim.name=adamw",
)
CELLS = (
    ("causal_decoder", "flm"),
    ("noncausal_decoder", "plm"),
    ("encoder_decoder", "plm"),
)


def _config(*overrides: str) -> ExperimentConfig:
    return load_config(None, (*COMMON, *overrides))


def _time(run: Callable, state: Any, batch: Any, steps: int = 10, rounds: int = 3) -> tuple:
    """(state, compile + first call s, median ms per step) of `run(state, batch)`."""
    t = time.perf_counter()
    state, out = run(state, batch)
    jax.block_until_ready(out)
    first_s = time.perf_counter() - t
    state, out = run(state, batch)  # the second call allocates its last buffers
    jax.block_until_ready(out)
    per_round = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(steps):
            state, out = run(state, batch)
        jax.block_until_ready(out)
        per_round.append((time.perf_counter() - t) / steps)
    return state, first_s, 1e3 * statistics.median(per_round)


def ours(cfg: ExperimentConfig, *, blocks: int | None = None) -> dict[str, Any]:
    """Step time and MFU of the package's train step at `cfg` (`blocks`: the reference's
    causal block rows, 0 for one full product; None leaves the default)."""
    batch = next(pipeline.make_iterator(cfg, "train"))
    context = attention.causal_block(blocks) if blocks is not None else contextlib.nullcontext()
    with context:
        program = train_program.build_program(cfg, batch)
        state = program.init(cfg.train.seed)
        _, first_s, ms = _time(program.step, state, program.shard_batch(batch))
    flops = cfg.train.batch_size * counting.flops(cfg)["flops_per_example"]
    return _row(cfg, ms, flops, program.compile_s + first_s)


def _row(cfg: ExperimentConfig, ms: float, flops: float, first_s: float) -> dict[str, Any]:
    peak = datasheets.peak_flops(dtype=cfg.model.dtype)["flops_per_s"]
    return {
        "params": counting.count_params(cfg.model)["total"],
        "step_ms": round(ms, 2),
        "mfu": round(datasheets.mfu(flops, ms / 1e3, peak), 4),
        "compile_s": round(first_s, 1),  # compile and first call
    }


def nanodo(cfg: ExperimentConfig) -> dict[str, Any]:
    """The peer's train step (its model in our loss and AdamW step) at `cfg`'s shape."""
    from scalestudy.bench.peer import PEER_FEATURES, make_peer

    batch = next(pipeline.make_iterator(cfg, "train"))
    peer_step, state, flops_per_example = make_peer(cfg, "nanodo")
    device_batch = {k: jnp.asarray(batch[k]) for k in PEER_FEATURES}
    _, first_s, ms = _time(peer_step, state, device_batch)
    return _row(cfg, ms, cfg.train.batch_size * flops_per_example, first_s)


def agreement(arch: str, objective: str, position: str) -> dict[str, Any]:
    """cuDNN against the XLA reference: logits and gradients on one bfloat16 batch."""
    from scalestudy.models.api import build_model

    cfg = _config(
        f"model.arch={arch}",
        f"objective.name={objective}",
        f"model.position={position}",
        "model.d_model=512",
        "model.n_heads=8",
        "model.n_layers=2",
        "model.d_ff=1024",
        "objective.inputs_length=128",
        "objective.targets_length=128",
        "train.batch_size=8",
    )
    batch = {k: jnp.asarray(v) for k, v in next(pipeline.make_iterator(cfg, "train")).items()}
    out = {}
    for impl in ("xla", "cudnn"):
        model = build_model(cfg.model.replace(attention_impl=impl))
        params = jax.jit(model.init)(jax.random.key(0))

        def loss(p, model=model):
            return model.loss(p, batch, None, deterministic=True)[0]

        logits = jax.jit(model.apply)(params, batch).astype(jnp.float32)
        grads = jax.jit(jax.grad(loss))(params)
        out[impl] = (
            np.asarray(logits),
            np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)]),
        )
    (lx, gx), (lc, gc) = out["xla"], out["cudnn"]
    real = np.asarray(batch["decoder_loss_weights"]) > 0
    return {
        "logits_max_diff": round(float(np.max(np.abs(lc - lx)[real])), 4),
        "logits_scale": round(float(np.max(np.abs(lx[real]))), 2),
        "grad_rel_diff": round(float(np.linalg.norm(gc - gx) / np.linalg.norm(gx)), 5),
    }


def member_steps(k: int) -> dict[str, Any]:
    """Wall time per step of K members of a 10M-parameter causal decoder in one program."""
    from scalestudy.train import members

    cfg = _config(
        "model.d_model=384",
        "model.n_heads=6",
        "model.n_layers=6",
        "model.d_ff=1536",
        "model.vocab_size=384",
        "objective.name=flm",
        "objective.inputs_length=128",
        "objective.targets_length=128",
        "train.batch_size=16",
    )
    batch = next(pipeline.make_iterator(cfg, "train"))
    if k == 1:
        program = train_program.build_program(cfg, batch)
        run, state, device_batch = program.step, program.init(0), program.shard_batch(batch)
    else:
        group = train_program.build_program(members.seeded(cfg, k), batch)
        state, device_batch = group.init(range(k)), group.shard([batch] * k)

        def run(state, batch_):
            return group.step(state, batch_)

    _, first_s, ms = _time(run, state, device_batch)
    flops = k * cfg.train.batch_size * counting.flops(cfg)["flops_per_example"]
    return {"members": k, **_row(cfg, ms, flops, first_s)}


def plan_rows() -> Iterator[tuple[str, Callable[[], dict[str, Any]]]]:
    """(row name, measurement) in the order they run."""
    for arch, obj in CELLS:
        for position in ("relative_bias", "rope"):
            yield f"agree/{arch}/{position}", lambda a=arch, o=obj, p=position: agreement(a, o, p)
    default = (*SIZE_350M, *LENGTH, "train.batch_size=16")
    yield (
        "default350m/causal_decoder/auto",
        lambda: ours(_config(*default, "model.arch=causal_decoder", "objective.name=flm")),
    )
    p125 = (*PEER, *SIZE_125M, "train.batch_size=32")
    yield from _peer125m_rows(p125)
    yield "members/1", lambda: member_steps(1)
    yield "members/8", lambda: member_steps(8)
    for arch, obj in CELLS[1:]:
        yield (
            f"default350m/{arch}/auto",
            lambda a=arch, o=obj: ours(_config(*default, f"model.arch={a}", f"objective.name={o}")),
        )
    yield "peer125m/ours_cudnn_scanned", lambda: ours(_config(*p125, "model.scan_layers=true"))
    yield from _peer350m_rows(default)


def _peer125m_rows(p125: tuple[str, ...]) -> Iterator[tuple[str, Callable[[], dict[str, Any]]]]:
    """The 125M peer shape: nanodo, then ours with cuDNN and on each XLA attention path."""
    yield "peer125m/nanodo", lambda: nanodo(_config(*p125))
    yield "peer125m/ours_cudnn", lambda: ours(_config(*p125))
    yield (
        "peer125m/ours_xla_full_f32",
        lambda: ours(_config(*p125, "model.attention_impl=xla"), blocks=0),
    )
    yield "peer125m/ours_xla_blocks_f32", lambda: ours(_config(*p125, "model.attention_impl=xla"))
    yield (
        "peer125m/ours_xla_blocks_compute",
        lambda: ours(_config(*p125, "model.attention_impl=xla", "model.attention_logits=compute")),
    )
    yield (
        "peer125m/ours_xla_full_compute",
        lambda: ours(
            _config(*p125, "model.attention_impl=xla", "model.attention_logits=compute"), blocks=0
        ),
    )


def _peer350m_rows(default: tuple[str, ...]) -> Iterator[tuple[str, Callable[[], dict[str, Any]]]]:
    """The 350M peer shape and the default model on XLA attention: the rows measured last,
    as the first to give way when the time budget runs out."""
    p350 = (*PEER, *SIZE_350M, "train.batch_size=16")
    yield "peer350m/nanodo", lambda: nanodo(_config(*p350))
    yield "peer350m/ours_cudnn", lambda: ours(_config(*p350))
    yield (
        "peer350m/ours_xla_blocks_compute",
        lambda: ours(_config(*p350, "model.attention_impl=xla", "model.attention_logits=compute")),
    )
    yield (
        "peer350m/ours_xla_full_f32",
        lambda: ours(_config(*p350, "model.attention_impl=xla"), blocks=0),
    )
    yield (
        "default350m/causal_decoder/xla",
        lambda: ours(
            _config(
                *default,
                "model.arch=causal_decoder",
                "objective.name=flm",
                "model.attention_impl=xla",
            )
        ),
    )
    yield "peer350m/ours_cudnn_scanned", lambda: ours(_config(*p350, "model.scan_layers=true"))


def bench(out: Path | None, budget_s: float = 420.0, only: str | None = None) -> dict[str, Any]:
    """Run `plan_rows()` (rows whose name contains `only`) until `budget_s` has passed; each row
    is printed and appended to `out` (JSON lines) as soon as it is measured. A row that fails
    records its error and the rest go on."""
    t0 = time.perf_counter()
    device = jax.devices()[0]
    head = {
        "row": "device",
        "device": f"{jax.device_count()} x {device.device_kind}",
        "jax": jax.__version__,
        "peak_tflops": round(datasheets.peak_flops(dtype="bfloat16")["per_device"] / 1e12, 1),
    }
    rows = {"device": head}
    _emit(head, out)
    for name, measure in plan_rows():
        if only and only not in name:
            continue
        if time.perf_counter() - t0 > budget_s:
            _emit({"row": name, "skipped": f"budget of {budget_s:.0f} s spent"}, out)
            continue
        try:
            row = {"row": name, **measure()}
        except Exception as e:  # one failing row must not cost the others
            row = {"row": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        row["elapsed_s"] = round(time.perf_counter() - t0, 1)
        rows[name] = row
        _emit(row, out)
    return rows


def main(out: str | None, budget_s: float, only: str | None) -> int:
    """`scalestudy bench gpu`: refuse a host without a GPU in one line, else run `bench`."""
    from scalestudy.config.errors import ScalestudyError

    if jax.default_backend() != "gpu":
        raise ScalestudyError(
            "bench gpu times the GPU table and this host's JAX backend is "
            f"{jax.default_backend()!r}; run it on a CUDA host (`pip install -e '.[gpu]'`)"
        )
    bench(Path(out) if out else None, budget_s, only)
    return 0


def _emit(row: dict[str, Any], out: Path | None) -> None:
    print(json.dumps(row), flush=True)
    if out is not None:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
