"""Ahead-of-time compilation: local devices, TPU topology names, memory and FSDP on a TPU."""

import importlib.util

import pytest

from scalestudy.train import aot, roofline

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


def test_planned_batch_has_the_shapes_training_feeds_for_every_cell(tiny_cfg):
    from scalestudy.config import VALID_CELLS
    from scalestudy.data import pipeline

    splits = [(a, o, "") for a, objs in VALID_CELLS.items() for o in objs]
    splits.append(("encoder_decoder", "plm", "objective.plm_split=uniform"))
    for arch, objective, extra in splits:
        cfg = tiny_cfg(arch, objective, *([extra] if extra else []))
        planned = aot.abstract_batch(cfg)
        trained = next(pipeline.make_iterator(cfg, "train"))
        shapes = {k: (v.shape, v.dtype) for k, v in trained.items()}
        assert {k: (v.shape, v.dtype) for k, v in planned.items()} == shapes, (arch, objective)


def test_a_batch_the_mesh_cannot_split_is_one_clear_error(tiny_cfg):
    from scalestudy.errors import ConfigError

    with pytest.raises(ConfigError, match=r"batch_size=12 rows cannot be split.* 8 shards"):
        aot.compile_plan(tiny_cfg("causal_decoder", None, "train.batch_size=12"), None)


def test_collective_bytes_read_each_replica_group_form():
    hlo = "\n".join(
        [
            # 4 devices per group, f32[32,64] gathered: 3/4 of 8192 bytes sent.
            "%ag = f32[32,64]{1,0} all-gather(%x), channel_id=1, replica_groups=mesh['axis_0'=4,"
            "'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}",
            # Two arrays all-reduced over groups of 2: 2 * 1/2 * (128 + 8) bytes.
            "%ar = (f32[32]{0}, bf16[4]{0}) all-reduce(%a, %b), replica_groups=[4,2]<=[8]",
            # A shard of bf16[16] per device of 8: the full array is 8 * 32 bytes.
            "%rs = bf16[16]{0} reduce-scatter(%c), replica_groups={{0,1,2,3,4,5,6,7}}",
            # Async start: (operand, result); the result counts.
            "%ags = (f32[8]{0}, f32[16]{0}) all-gather-start(%d), replica_groups={{0,1}}",
            "%agd = f32[16]{0} all-gather-done(%ags)",
        ]
    )
    got = roofline.collective_bytes(hlo, 8)
    assert got["all-gather"] == 0.75 * 32 * 64 * 4 + 0.5 * 16 * 4
    assert got["all-reduce"] == 2 * 0.5 * (32 * 4 + 4 * 2)
    assert got["reduce-scatter"] == 7 / 8 * 8 * 16 * 2
    assert got["all-to-all"] == got["collective-permute"] == 0


def test_roofline_picks_the_largest_bound_and_never_beats_the_peak():
    limits = roofline.ChipLimits("test", flops_per_s=100.0, hbm_bytes_per_s=10.0,
                                 ici_link_bytes_per_s=1.0)  # fmt: skip
    costs = {"flops": 200.0, "bytes": 50.0, "collectives": {"all-reduce": 4.0}}
    out = roofline.estimate(costs, limits, counted_flops=4 * 150.0, n_devices=4)
    assert (out["compute_s"], out["memory_s"], out["communication_s"]) == (2.0, 5.0, 2.0)
    assert out["bound"] == "memory" and out["est_step_s"] == 5.0
    assert out["est_mfu"] == pytest.approx(600 / (5.0 * 4 * 100))
    # XLA counting fewer FLOPs than the model has cannot give an MFU above 1.
    fast = roofline.estimate({**costs, "bytes": 0.0}, limits, counted_flops=4 * 1000, n_devices=4)
    assert fast["est_mfu"] == 1.0


@pytest.mark.slow
def test_scanned_costs_equal_the_unrolled_program_costs(tiny_cfg):
    import jax

    # FSDP over 4 of the 8 devices, so that the program has collectives to count.
    base = tiny_cfg("causal_decoder", None, "mesh.data=2", "mesh.fsdp=4", "model.n_layers=3")
    scan = base.replace(model={**base.model.model_dump(), "scan_layers": True})
    unrolled = base.replace(model={**base.model.model_dump(), "scan_layers": False})
    extrapolated = aot.unrolled_costs(scan, jax.devices())
    compiled, mesh, _ = aot._compile(unrolled, jax.devices())
    direct = roofline.program_costs(compiled, mesh.size)
    assert extrapolated["flops"] == pytest.approx(direct["flops"], rel=0.02)
    assert extrapolated["bytes"] == pytest.approx(direct["bytes"], rel=0.1)
    for kind, sent in direct["collectives"].items():
        assert extrapolated["collectives"][kind] == pytest.approx(sent, rel=0.05, abs=64), kind
    assert sum(direct["collectives"].values()) > 0
