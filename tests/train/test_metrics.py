"""Metrics files: JSONL rows, TensorBoard events, truncation on resume, measured peak."""

import math

from scalestudy.train import metrics


def test_jsonl_and_tensorboard(tmp_path):
    writer = metrics.MetricsWriter(tmp_path)
    writer.write(1, {"train/loss": 2.5, "lr": 1e-3})
    writer.write(2, {"train/loss": float("nan")})
    writer.close()
    rows = metrics.read_metrics(tmp_path)
    assert rows[0] == {"step": 1, "train/loss": 2.5, "lr": 1e-3}
    assert rows[1]["step"] == 2 and math.isnan(rows[1]["train/loss"])
    assert list((tmp_path / metrics.TENSORBOARD_DIR).glob("events.out.tfevents.*"))


def test_truncate_after(tmp_path):
    writer = metrics.MetricsWriter(tmp_path, tensorboard=False)
    for step in (10, 20, 30):
        writer.write(step, {"x": step})
    writer.close()
    metrics.truncate_after(tmp_path, 20)
    assert [r["step"] for r in metrics.read_metrics(tmp_path)] == [10, 20]


def test_measured_peak_is_positive_and_mfu_is_a_fraction():
    peak = metrics.measured_peak_flops(n=128, repeats=2)
    assert peak["flops_per_s"] > 1e6 and peak["dtype"] in ("float32", "bfloat16")
    assert 0 < metrics.mfu(1e6, 1.0) < 1


def test_tensorboard_events_hold_the_scalars(tmp_path):
    import tensorflow as tf

    writer = metrics.MetricsWriter(tmp_path)
    writer.write(3, {"train/loss": 1.25})
    writer.close()
    (events,) = (tmp_path / metrics.TENSORBOARD_DIR).glob("events.out.tfevents.*")
    # Read back with TensorFlow's own reader, which checks the record CRCs.
    events = list(tf.compat.v1.train.summary_iterator(str(events)))
    assert events[0].file_version == "brain.Event:2"
    values = [(e.step, v.tag, v.simple_value) for e in events for v in e.summary.value]
    assert values == [(3, "train/loss", 1.25)]


def test_crc32c_known_answer():
    # CRC-32C check value of "123456789" is 0xE3069283; records store it masked.
    crc = 0xE3069283
    assert (
        metrics._masked_crc32c(b"123456789")
        == (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    )


def test_torn_last_line_does_not_block_resume(tmp_path):
    """A row cut short by a full disk or a power cut: dropped, later rows append cleanly."""
    writer = metrics.MetricsWriter(tmp_path, tensorboard=False)
    for step in (1, 2):
        writer.write(step, {"x": step})
    writer.close()
    path = tmp_path / metrics.METRICS_FILE
    with path.open("a") as f:
        f.write('{"step": 3, "x": 3.0, "to')  # no newline: the writer died here
    assert [r["step"] for r in metrics.read_metrics(tmp_path)] == [1, 2]
    metrics.truncate_after(tmp_path, 5)
    writer = metrics.MetricsWriter(tmp_path, tensorboard=False)
    writer.write(3, {"x": 3})
    writer.close()
    assert [r["step"] for r in metrics.read_metrics(tmp_path)] == [1, 2, 3]
    assert path.read_text().endswith("\n") and len(path.read_text().splitlines()) == 3
