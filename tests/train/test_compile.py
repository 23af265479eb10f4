"""Ahead-of-time compilation: local devices, TPU topology names, memory and FSDP on a TPU."""

import importlib.util

import pytest

from scalestudy.train import aot

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(
    not HAS_LIBTPU, reason="the TPU compiler is not installed (pip install -e '.[tpu]')"
)


def test_compile_for_local_devices_reports_memory_and_flops(tiny_cfg):
    cfg = tiny_cfg("causal_decoder")
    out = aot.compile_plan(cfg, None)
    assert out["temp_gib"] >= 0 and out["argument_gib"] > 0
    # XLA's count skips the embedding gather and may fuse; the counted convention is exact.
    assert 0.5 < out["xla_over_counted"] < 1.5


@pytest.mark.parametrize(
    ("name", "topology", "chips"),
    [
        ("v4-8", "v4:2x2x1", 4),  # v4 types count TensorCores: 2 per chip
        ("v4-256", "v4:4x4x8", 128),
        ("v5p-16", "v5p:2x2x2", 8),
        ("v5e-8", "v5e:2x4", 8),  # v5e types count chips
        ("v5litepod-16", "v5e:4x4", 16),
        ("v6e-8", "v6e:2x4", 8),
        ("v4:8x8x4", "v4:8x8x4", 256),
    ],
)
def test_topology_names(name, topology, chips):
    assert aot.resolve_topology(name) == (topology, chips)


@pytest.mark.parametrize(
    ("name", "message"),
    [("v4-12", "accepted sizes: 8, 16"), ("v5e:2x2x2", "2 sizes"), ("gpu-8", "accepted:")],
)
def test_bad_topology_names_say_what_is_accepted(name, message):
    with pytest.raises(aot.TopologyError, match=message):
        aot.resolve_topology(name)


def test_missing_tpu_compiler_names_the_extra(tiny_cfg, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "libtpu" else real(n, *a)
    )
    with pytest.raises(aot.TopologyError, match=r"\.\[tpu\]"):
        aot.compile_plan(tiny_cfg("causal_decoder"), "v5e-8")


# Widths whose shards fill whole TPU tiles (128 lanes), so that padding does not blur sizes.
WIDE = ("model.position=rope", "model.d_model=512", "model.n_heads=4", "model.d_ff=256")


@needs_libtpu
@pytest.mark.slow
def test_fsdp_divides_state_memory_per_chip_on_a_tpu(tiny_cfg):
    # Every parameter has an "embed" axis when there is no relative bias, so FSDP over 4
    # chips holds a quarter of the parameters and Adam moments on each chip; only the step,
    # RNG and Adam's count stay replicated.
    plans = {
        fsdp: aot.compile_plan(
            tiny_cfg("causal_decoder", None, *WIDE, f"mesh.fsdp={fsdp}"),
            "v5e-8",
        )
        for fsdp in (1, 4)
    }
    one, four = plans[1], plans[4]
    assert one["device_kind"] == "TPU v5 lite" and one["hbm_gib_per_chip"] == 16
    assert one["mesh"] == {"data": 8, "fsdp": 1, "tensor": 1}
    assert four["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1}
    state1, state4 = one["bytes_per_chip"]["state"], four["bytes_per_chip"]["state"]
    assert state1 / 4 <= state4 < state1 / 4 + 64
    # The compiler's own argument buffers shrink by the same bytes (the batch share per
    # chip is equal: the batch is split over data x fsdp = 8 chips in both meshes).
    args1, args4 = one["bytes_per_chip"]["argument"], four["bytes_per_chip"]["argument"]
    assert args1 - args4 == pytest.approx(state1 - state4, rel=0.02)
    assert one["fits"] and four["fits"]
