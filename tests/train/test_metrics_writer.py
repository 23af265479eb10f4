"""Metrics files: JSONL rows, TensorBoard events, truncation on resume, measured peak."""

import math

import jax
import pytest

from scalestudy.train import datasheets
from scalestudy.train.rundir import layout as rundir
from scalestudy.train.rundir import metrics_writer, tensorboard


def test_jsonl_and_tensorboard(tmp_path):
    writer = metrics_writer.MetricsWriter(tmp_path)
    writer.write(1, {"train/loss": 2.5, "lr": 1e-3})
    writer.write(2, {"train/loss": float("nan")})
    writer.close()
    rows = rundir.read_metrics(tmp_path)
    assert rows[0] == {"step": 1, "train/loss": 2.5, "lr": 1e-3}
    assert rows[1]["step"] == 2 and math.isnan(rows[1]["train/loss"])
    assert list((tmp_path / rundir.TENSORBOARD).glob("events.out.tfevents.*"))


def test_truncate_after(tmp_path):
    writer = metrics_writer.MetricsWriter(tmp_path, tensorboard=False)
    for step in (10, 20, 30):
        writer.write(step, {"x": step})
    writer.close()
    rundir.truncate_metrics_after(tmp_path, 20)
    assert [r["step"] for r in rundir.read_metrics(tmp_path)] == [10, 20]


def test_measured_peak_is_positive_and_mfu_is_a_fraction():
    peak = datasheets.measured_peak_flops(sizes=(128,), repeats=2)
    assert peak["flops_per_s"] > 1e6 and peak["dtype"] in ("float32", "bfloat16")
    assert 0 < datasheets.mfu(1e6, 1.0, peak["flops_per_s"]) < 1


@pytest.mark.parametrize(
    ("kind", "dtype", "per_chip"),
    [
        ("TPU v4", "bfloat16", 275e12),
        ("TPU v5 lite", "bfloat16", 197e12),
        ("TPU v5", "float32", 459e12),  # v5p's device kind; float32 runs as bf16 passes
        ("TPU v6 lite", "bfloat16", 918e12),
        ("NVIDIA A100-SXM4-80GB", "float32", 156e12),  # TF32
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12),
        ("NVIDIA H200", "bfloat16", 989e12),
    ],
)
def test_datasheet_peak_times_devices_gives_a_known_mfu(kind, dtype, per_chip):
    # 256 chips running at 40% of their datasheet peak for 10 s.
    peak = datasheets.peak_flops(kind, dtype, n_devices=256)
    assert peak["flops_per_s"] == 256 * per_chip and "datasheet" in peak["source"]
    flops = 0.4 * 256 * per_chip * 10.0
    assert datasheets.mfu(flops, 10.0, peak["flops_per_s"]) == pytest.approx(0.4)


def test_peak_counts_global_devices_but_one_per_cpu_host():
    # Accelerators: every global device (8 fake ones here) has its own peak.
    assert datasheets.peak_flops("TPU v4")["flops_per_s"] == 8 * 275e12
    # CPU: the fake devices share one host's cores, so the measured peak counts once.
    cpu = datasheets.peak_flops(jax.devices()[0].device_kind)
    assert cpu["devices"] == jax.process_count() == 1
    assert cpu["flops_per_s"] == datasheets.measured_peak_flops()["flops_per_s"]


def test_tensorboard_events_hold_the_scalars(tmp_path):
    import tensorflow as tf

    writer = metrics_writer.MetricsWriter(tmp_path)
    writer.write(3, {"train/loss": 1.25})
    writer.close()
    (events,) = (tmp_path / rundir.TENSORBOARD).glob("events.out.tfevents.*")
    # Read back with TensorFlow's own reader, which checks the record CRCs.
    events = list(tf.compat.v1.train.summary_iterator(str(events)))
    assert events[0].file_version == "brain.Event:2"
    values = [(e.step, v.tag, v.simple_value) for e in events for v in e.summary.value]
    assert values == [(3, "train/loss", 1.25)]


def test_crc32c_known_answer():
    # CRC-32C check value of "123456789" is 0xE3069283; records store it masked.
    crc = 0xE3069283
    assert (
        tensorboard._masked_crc32c(b"123456789")
        == (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    )


def test_torn_last_line_does_not_block_resume(tmp_path):
    """A row cut short by a full disk or a power cut: dropped, later rows append cleanly."""
    writer = metrics_writer.MetricsWriter(tmp_path, tensorboard=False)
    for step in (1, 2):
        writer.write(step, {"x": step})
    writer.close()
    path = tmp_path / rundir.METRICS
    with path.open("a") as f:
        f.write('{"step": 3, "x": 3.0, "to')  # no newline: the writer died here
    assert [r["step"] for r in rundir.read_metrics(tmp_path)] == [1, 2]
    rundir.truncate_metrics_after(tmp_path, 5)
    writer = metrics_writer.MetricsWriter(tmp_path, tensorboard=False)
    writer.write(3, {"x": 3})
    writer.close()
    assert [r["step"] for r in rundir.read_metrics(tmp_path)] == [1, 2, 3]
    assert path.read_text().endswith("\n") and len(path.read_text().splitlines()) == 3
