"""Run metrics: JSONL and TensorBoard writers, throughput and model-FLOPs utilisation.

MFU = counted model FLOPs per second / peak FLOP/s, where the peak is *measured*: the best
throughput of a large batched matmul on the same devices in the same process (max over
float32 and bfloat16). On accelerators this is close to the datasheet peak; on CPU it is the
only honest denominator.
"""

from __future__ import annotations

import functools
import json
import math
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scalestudy.config import ExperimentConfig
from scalestudy.models import counting

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _plain(value: Any) -> Any:
    """A JSON-able Python scalar from a numpy/jax scalar (NaN stays NaN)."""
    if isinstance(value, np.ndarray | np.generic | jax.Array):
        value = np.asarray(value).item()
    return value


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)
    return table


_CRC_TABLE = _crc32c_table()


def _masked_crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(step: int, wall_time: float, summary: bytes = b"", version: str = "") -> bytes:
    """A serialized tensorflow.Event (wall_time=1, step=2, file_version=3, summary=5)."""
    out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if version:
        out += _field(3, version.encode())
    if summary:
        out += _field(5, summary)
    return out


class EventWriter:
    """TensorBoard scalar events (Summary.Value.simple_value) in TFRecord framing, written
    without importing TensorFlow (seconds per process saved)."""

    def __init__(self, logdir: Path):
        logdir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self._file = (logdir / name).open("ab")
        self._record(_event(0, time.time(), version="brain.Event:2"))

    def _record(self, data: bytes) -> None:
        length = struct.pack("<Q", len(data))
        self._file.write(length + struct.pack("<I", _masked_crc32c(length)))
        self._file.write(data + struct.pack("<I", _masked_crc32c(data)))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        summary = b"".join(
            _field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", value))
            for tag, value in values.items()
        )
        self._record(_event(step, time.time(), summary))

    def close(self) -> None:
        self._file.close()


class MetricsWriter:
    """Appends one JSON object per log step to metrics.jsonl and mirrors scalars to TensorBoard.

    Appending (rather than rewriting) keeps earlier steps when a run resumes; on resume the
    loop truncates lines past the restored step so the file has no duplicates. Only process 0
    writes (`active=False` elsewhere).
    """

    def __init__(self, workdir: Path, *, tensorboard: bool = True, active: bool = True):
        self.path = Path(workdir) / METRICS_FILE
        self._file = self._tb = None
        if not active:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        if tensorboard:
            self._tb = EventWriter(Path(workdir) / TENSORBOARD_DIR)

    def write(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Record `metrics` at `step`; returns them as plain Python values."""
        row = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        if self._tb is not None:
            self._tb.scalars(
                int(step),
                {
                    k: float(v)
                    for k, v in row.items()
                    if k != "step" and isinstance(v, int | float) and math.isfinite(v)
                },
            )
        return row

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def _rows(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(line, row) for every complete row of a metrics.jsonl text.

    A line that does not parse (torn by a full disk or a power cut while it was written) is
    dropped: its step is re-run on resume, so its row is written again.
    """
    out = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            out.append((line, row))
    return out


def truncate_after(workdir: Path, step: int) -> None:
    """Drop metrics.jsonl rows after `step` (they belong to work lost at a preemption) and
    torn lines; the file is replaced atomically so a crash here loses nothing."""
    path = Path(workdir) / METRICS_FILE
    if not path.exists():
        return
    kept = [line for line, row in _rows(path.read_text(errors="replace")) if row["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


def read_metrics(workdir: Path) -> list[dict[str, Any]]:
    """All complete rows of a run's metrics.jsonl (a torn line is skipped)."""
    path = Path(workdir) / METRICS_FILE
    if not path.exists():
        return []
    return [row for _, row in _rows(path.read_text(errors="replace"))]


class Throughput:
    """Tokens/s over the steps since the last call, from wall-clock time."""

    def __init__(self) -> None:
        self._t, self._count = time.perf_counter(), 0.0

    def update(self, count: float) -> float:
        now = time.perf_counter()
        rate = (count - self._count) / max(now - self._t, 1e-9)
        self._t, self._count = now, count
        return rate


@functools.cache
def measured_peak_flops(n: int = 512, repeats: int = 5) -> dict[str, float]:
    """Best measured matmul FLOP/s over all local devices: {"flops_per_s", "dtype"}."""
    devices = jax.local_devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    best = {"flops_per_s": 0.0, "dtype": "float32"}
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jax.device_put(jnp.ones((len(devices), n, n), dtype), sharding)
        matmul = jax.jit(lambda a: jnp.einsum("bij,bjk->bik", a, a))
        matmul(x).block_until_ready()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            matmul(x).block_until_ready()
            times.append(time.perf_counter() - t)
        rate = 2 * len(devices) * n**3 / min(times)
        if rate > best["flops_per_s"]:
            best = {"flops_per_s": rate, "dtype": jnp.dtype(dtype).name}
    return best


def mfu(model_flops: float, seconds: float) -> float:
    """Model FLOPs utilisation of `model_flops` done in `seconds` against the measured peak."""
    if seconds <= 0:
        return 0.0
    return model_flops / seconds / measured_peak_flops()["flops_per_s"]


def run_summary(
    cfg: ExperimentConfig,
    done: int,
    totals: dict,
    last: dict,
    final_eval: dict,
    train_time: float,
    start: int,
    tokens0: float,
) -> dict[str, Any]:
    """summary.json of a run after `done` steps, `done - start` of them in this invocation
    (which took `train_time` seconds of training and began with `tokens0` tokens)."""
    counts = counting.flops(cfg)
    params = counting.count_params(cfg.model)
    flops = done * cfg.train.batch_size * counts["flops_per_example"]
    this_run_flops = (done - start) * cfg.train.batch_size * counts["flops_per_example"]
    this_run_tokens = totals["tokens"] - tokens0
    return {
        "name": cfg.name,
        "arch": cfg.model.arch,
        "objective": cfg.objective.name,
        "params_total": params["total"],
        "params_non_embedding": params["non_embedding"],
        "params_embedding": params["embedding"],
        "flops_per_token": counts["flops_per_token"],
        "flops_per_token_6n": counts["flops_per_token_6n"],
        "steps": done,
        "complete": done >= cfg.train.steps,
        "tokens": totals["tokens"],
        "positions": totals["positions"],
        "flops": flops,
        # 6N per position processed (D = positions: inputs and targets alike).
        "flops_6nd": counts["flops_per_token_6n"] * totals["positions"],
        "final_train_loss": last.get("train/loss"),
        "final_val_loss": final_eval.get("val/loss"),
        "best_val_loss": totals.get("best_val_loss"),
        "wall_time_s": totals["wall_time_s"],
        "tokens_per_s": this_run_tokens / max(train_time, 1e-9),
        "mfu": mfu(this_run_flops, train_time),
        "eval": {k[len("eval/") :]: v for k, v in final_eval.items() if k.startswith("eval/")},
    }
