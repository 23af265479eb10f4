"""Ahead-of-time compilation: local devices, TPU topology names, memory and FSDP on a TPU."""

import importlib.util

import numpy as np
import pytest

from scalestudy.train import datasheets as chips
from scalestudy.train.plan import aot, roofline

pytestmark = pytest.mark.optimized  # the compiler's memory and cost analysis

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


# A process whose JAX cache is already in use (it wrote a CPU program there) plans a scanned
# model for a slice: the step and its cost probes are compiled, and none of them is written.
_CACHED_THEN_PLANNED = """
import sys
from pathlib import Path

import jax

sys.path.insert(0, sys.argv[2])
from conftest import tiny
from scalestudy.train.plan import aot
from scalestudy.train.runtime import host_setup

host_setup.enable_compilation_cache()
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.jit(lambda x: x * 3 + 1)(jax.numpy.ones(5)).block_until_ready()  # a CPU program, cached
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.3)
plan = aot.compile_plan(tiny("causal_decoder", None, "model.scan_layers=true"), "v5e-4")
assert plan["scanned"] and plan["xla_flops_per_step"] > 0
print(" ".join(sorted(p.name for p in Path(sys.argv[1]).iterdir())))
"""


@needs_libtpu
def test_a_slices_step_and_cost_probes_stay_out_of_the_persistent_cache(tmp_path):
    """Without a TPU client a program compiled for a slice cannot be loaded back from JAX's
    persistent cache (reading it warns, then compiles again), so none is written there, even
    in a process that uses the cache already: neither the step nor a scanned stack's probes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    cache = tmp_path / "cache"
    env = {**os.environ, "SCALESTUDY_JAX_CACHE": str(cache)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    here = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, "-c", _CACHED_THEN_PLANNED, str(cache), here],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-800:]
    entries = done.stdout.split()
    assert any(e.startswith("jit__lambda") for e in entries), entries  # the cache was in use
    assert not any("train_step" in e for e in entries), entries
    assert "Error reading persistent compilation cache" not in done.stderr


def test_planned_batch_has_the_shapes_training_feeds_for_every_cell(tiny_cfg):
    from scalestudy.config.experiment import VALID_CELLS
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
    from scalestudy.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"batch_size=12 rows cannot be split.* 8 shards"):
        aot.compile_plan(tiny_cfg("causal_decoder", None, "train.batch_size=12"), None)


def test_collectives_read_each_replica_group_form_and_count_each_channel_once():
    hlo = "\n".join(
        [
            "ENTRY %main.1_spmd (p: f32[8]) -> f32[8] {",
            # Mesh form: axes [4, 2] over devices iota [2,4]^T, grouped along the first axis.
            "%ag = f32[32,64]{1,0} all-gather(%x), channel_id=1, replica_groups=mesh['axis_0'=4,"
            "'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}",
            "}",
            "%async_collective_fusion.2 (p: f32[8]) -> f32[32,64] {",
            # The same channel cloned into an async continuation: not a second collective.
            "%ag.2 = f32[32,64]{1,0} all-gather(%y), channel_id=1, replica_groups=mesh['axis_0'=4,"
            "'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}",
            "}",
            "%body.3 (p: f32[8]) -> f32[8] {",
            # A long tuple, whose /*index=N*/ comments hold '=': groups of 2 in iota form.
            "%ar = (f32[32]{0}, bf16[4]{0}, /*index=2*/f32[2]{0}) all-reduce(%a, %b, %c), "
            "channel_id=2, replica_groups=[4,2]<=[8]",
            # A shard of bf16[16] per device of 8: the reduced array is 8 * 32 bytes.
            "%rs = bf16[16]{0} reduce-scatter(%c), channel_id=3, "
            "replica_groups={{0,1,2,3,4,5,6,7}}",
            # Async start: (operand, result); the result counts; done is not counted.
            "%ags = (f32[8]{0}, f32[16]{0}) all-gather-start(%d), replica_groups={{0,2},{1,3}}",
            "%agd = f32[16]{0} all-gather-done(%ags)",
            # Two exchanges of one computation on one channel (shard_map's all_to_all): both.
            "%a2a = bf16[8,2,64]{2,1,0} all-to-all(%e), channel_id=1, replica_groups={{0,1}}",
            "%a2a.1 = bf16[8,2,64]{2,1,0} all-to-all(%f), channel_id=1, replica_groups={{0,1}}",
            "}",
        ]
    )
    got = roofline.parse_collectives(hlo, 8)
    kinds = ["all-gather", "all-reduce", "reduce-scatter", "all-gather", "all-to-all"]
    assert [c.kind for c in got] == [*kinds, "all-to-all"]
    gather, reduce, scatter, start, *exchanges = got
    assert [c.bytes_per_device for c in exchanges] == [0.5 * 8 * 2 * 64 * 2] * 2
    assert gather.groups.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert gather.bytes_per_device == 0.75 * 32 * 64 * 4
    assert reduce.groups.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert reduce.bytes_per_device == 2 * 0.5 * (32 * 4 + 4 * 2 + 2 * 4)
    assert scatter.bytes_per_device == 7 / 8 * 8 * 16 * 2
    assert start.groups.tolist() == [[0, 2], [1, 3]] and start.bytes_per_device == 0.5 * 64
    # Mesh form grouped along the second axis: pairs 4 apart.
    pairs = roofline.replica_groups(
        "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) "
        "{'axis_2'}, use_global_device_ids=true",
        8,
    )
    assert pairs.tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_communication_spreads_each_collective_over_the_torus_axes_its_group_spans():
    # A 2 x 4 torus, device i at (i % 2, i // 2): groups {0,1} span x only, {0,2,4,6} y only,
    # and all 8 both axes.
    coords = [(i % 2, i // 2, 0) for i in range(8)]
    x_pairs = roofline.Collective("all-reduce", 100, np.array([[0, 1], [2, 3], [4, 5], [6, 7]]))
    y_rows = roofline.Collective("all-gather", 400, np.array([[0, 2, 4, 6], [1, 3, 5, 7]]))
    both = roofline.Collective("all-to-all", 800, np.arange(8).reshape(1, 8))
    out = roofline.communication([x_pairs, y_rows, both], coords, dims=2)
    assert out["collectives"]["all-reduce"] == 100  # 2 * 1/2 of the array
    assert out["axis_bytes"] == {"0": 100 + 350, "1": 300 + 350}
    # Without coordinates a group may use every axis.
    flat = roofline.communication([y_rows], None, dims=3)
    assert flat["axis_bytes"] == {str(a): 100.0 for a in range(3)}


def _chip(**kw) -> chips.Chip:
    base = {"name": "test", "peak_bf16": 100.0, "peak_fp32": 100.0, "hbm_gib": 1}
    return chips.Chip(**{**base, "hbm_bytes_per_s": 10.0, "ici_bytes_per_s": 8.0, **kw})


def test_roofline_picks_the_largest_bound_and_never_beats_the_peak():
    chip = _chip(ici_ports=4)  # 1 byte/s per port and direction
    costs = {"flops": 200.0, "bytes": 50.0, "axis_bytes": {"0": 4.0, "1": 2.0}}
    out = roofline.estimate({**costs, "collectives": {}}, chip, 4 * 150.0, n_devices=4)
    # The busiest axis (4 bytes) over its two ports.
    assert (out["compute_s"], out["memory_s"], out["communication_s"]) == (2.0, 5.0, 2.0)
    assert out["bound"] == "memory" and out["est_step_s"] == 5.0
    assert out["est_mfu"] == pytest.approx(600 / (5.0 * 4 * 100))
    # XLA counting fewer FLOPs than the model has cannot give an MFU above 1.
    fast = roofline.estimate(
        {**costs, "bytes": 0.0, "collectives": {}}, chip, 4 * 1000.0, n_devices=4
    )
    assert fast["est_mfu"] == 1.0


def test_one_datasheet_table_gives_every_tpu_its_roofline_figures():
    for key, chip in chips.CHIPS:
        assert chips.chip(key) is chip and chip.hbm_bytes_per_s > 0
        if key.startswith("TPU"):
            # Two ports per torus dimension: 3-D (v4, v5p) or 2-D (v5e, v6e).
            assert chip.ici_ports in (4, 6) and chip.ici_link_bytes_per_s > 0
            assert chip.ici_link_bytes_per_s * 2 * chip.ici_ports == chip.ici_bytes_per_s


@pytest.mark.slow
def test_scanned_costs_equal_the_unrolled_program_costs(tiny_cfg):
    import jax

    # FSDP over 4 of the 8 devices, so that the program has collectives to count.
    base = tiny_cfg("causal_decoder", None, "mesh.data=2", "mesh.fsdp=4", "model.n_layers=3")
    scan = base.replace(model={**base.model.model_dump(), "scan_layers": True})
    unrolled = base.replace(model={**base.model.model_dump(), "scan_layers": False})
    extrapolated = aot.unrolled_costs(scan, jax.devices())
    compiled, mesh, _ = aot._compile(unrolled, jax.devices())
    direct = roofline.program_costs(compiled, list(mesh.devices.flat), None)
    assert extrapolated["flops"] == pytest.approx(direct["flops"], rel=0.02)
    assert extrapolated["bytes"] == pytest.approx(direct["bytes"], rel=0.1)
    for kind, sent in direct["collectives"].items():
        assert extrapolated["collectives"][kind] == pytest.approx(sent, rel=0.05, abs=64), kind
    assert sum(direct["collectives"].values()) > 0
    assert extrapolated["axis_bytes"] == pytest.approx(direct["axis_bytes"], rel=0.05, abs=64)


@pytest.mark.parametrize(
    ("arch", "layers", "depth"),
    [("causal_decoder", ("model.n_layers=5",), {"n_layers": 5}),
     ("encoder_decoder", ("model.n_layers=3", "model.n_encoder_layers=7"),
      {"n_layers": 3, "n_encoder_layers": 7})],
)  # fmt: skip
def test_cost_probes_vary_each_stack_of_the_model_in_turn(
    tiny_cfg, monkeypatch, arch, layers, depth
):
    # Fake programs whose costs are linear in each stack's depth (3 per decoder layer, 10 per
    # encoder layer, 1 fixed): the extrapolation must recover the full depth's costs.
    probes = []

    def fake_compile(cfg, devices, members=1):
        m = cfg.model
        probes.append((m.n_layers, m.n_encoder_layers, m.scan_layers))
        return object(), None, None

    def fake_costs(compiled, mesh):
        n, e, _ = probes[-1]
        value = 1.0 + 3 * n + 10 * (e or 0)
        return {"flops": value, "bytes": 2 * value,
                "collectives": dict.fromkeys(roofline.COLLECTIVES, value),
                "axis_bytes": {"0": value}}  # fmt: skip

    monkeypatch.setattr(aot, "_compile", fake_compile)
    monkeypatch.setattr(aot, "_costs", fake_costs)
    cfg = tiny_cfg(arch, None, *layers)
    out = aot.unrolled_costs(cfg, [])
    assert all(scan is False for *_, scan in probes) and len(probes) == 1 + len(depth)
    want = 1.0 + 3 * depth["n_layers"] + 10 * depth.get("n_encoder_layers", 0)
    assert out["flops"] == want and out["bytes"] == 2 * want and out["axis_bytes"] == {"0": want}


# Published measured MFUs, each with the configuration it was measured at, as our config.
# MaxText's TPU v4 22B model on one v4-128 slice (64 chips): 56.7% MFU, from the table in
# MaxText/configs/v4/README.md of github.com/AI-Hypercomputer/maxtext; its shape from
# MaxText/configs/v4/22b.sh there (ici_fsdp_parallelism=64, per_device_batch_size=13,
# remat_policy=full, base_emb_dim=6144, 24 query and key/value heads, base_mlp_dim=24576, 48
# decoder layers) and base.yml's defaults (head_dim 128, gated SiLU MLP, vocabulary 32000,
# untied output layer, 2048 positions). Which version of the code measured it is not said.
PUBLISHED = {
    "maxtext_v4_22b": (
        "v4-128",
        0.567,
        ("model.vocab_size=32000", "model.d_model=6144", "model.n_heads=24", "model.d_kv=128",
         "model.d_ff=24576", "model.n_layers=48", "model.activation=gated_silu",
         "model.position=rope", "model.tie_embeddings=false", "model.remat=full",
         "model.dropout=0.0", "objective.name=flm", "objective.inputs_length=1536",
         "objective.targets_length=512", "train.batch_size=832", "mesh.data=1",
         "mesh.fsdp=64"),
    ),
}  # fmt: skip


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_roofline_sits_above_a_published_measured_mfu(name):
    import os

    from scalestudy.config.experiment import load_config
    from scalestudy.models import counting

    if os.environ.get("SCALESTUDY_HEAVY_TESTS") != "1":
        # 3-5 CPU minutes of libtpu compiling the 22B probes: the suite's slowest test by far.
        pytest.skip("a 4-minute TPU compile: set SCALESTUDY_HEAVY_TESTS=1 to run it")
    topology, measured, overrides = PUBLISHED[name]
    cfg = load_config(None, ["model.arch=causal_decoder", *overrides])
    devices = aot.tpu_devices(topology)
    # The roofline needs only the probes' costs (one and two layers, unrolled), not the
    # full program.
    costs = aot.unrolled_costs(cfg, devices)
    counted = cfg.train.batch_size * counting.flops(cfg)["flops_per_example"]
    out = roofline.estimate(costs, chips.chip(devices[0].device_kind), counted, len(devices))
    assert measured <= out["est_mfu"] <= 1.0, out


def test_memory_only_plan_reports_the_same_memory_without_the_cost_probes(monkeypatch, capsys):
    import json
    from pathlib import Path

    from scalestudy.cli.main import main
    from scalestudy.config.experiment import load_config

    path = str(Path(__file__).parents[2] / "configs" / "models" / "tiny.yaml")
    overrides = ["model.scan_layers=true", "model.n_layers=3", "mesh.fsdp=2"]
    probed = []

    def stand_in_probes(cfg, devices, members=1):
        probed.append(cfg.model.n_layers)
        return {"flops": 1.0}

    monkeypatch.setattr(aot, "unrolled_costs", stand_in_probes)
    full = aot.compile_plan(load_config(path, overrides), None)
    assert probed == [3] and "xla_over_counted" in full  # a scanned plan's costs are probed
    assert main(["compile", "--config", path, "--memory-only", "--json", *overrides]) == 0
    out = json.loads(capsys.readouterr().out)
    assert probed == [3]  # no probe this time
    assert not {"xla_flops_per_step", "xla_over_counted", "roofline"} & out.keys()
    assert out["scanned"] and out["mesh"] == full["mesh"]
    assert out["bytes_per_chip"] == full["bytes_per_chip"]


@pytest.mark.slow  # three CPU compiles: about 8 s of CPU on the loaded 2-core machine
def test_a_lighter_remat_policy_compiles_to_temporaries_between_none_and_full(tiny_cfg):
    # What XLA keeps after compiling, not only what the trace saves
    # (tests/models/test_attention.py): a scanned stack, whose loop carries the saved
    # residuals from the forward to the backward pass. (Unrolled on a CPU, XLA schedules the
    # recomputation as it likes and the temporaries of all policies come out about equal.)
    import jax

    from scalestudy.models.api import build_model

    cfg = tiny_cfg("causal_decoder", None, "model.scan_layers=true", "model.dropout=0.0")
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in aot.abstract_batch(cfg).items()}
    temp = {}
    for policy in ("none", "save_attention", "full"):
        model = build_model(cfg.model.model_copy(update={"remat": policy}))
        grad = jax.jit(jax.grad(lambda p, b, m=model: m.loss(p, b, None, deterministic=True)[0]))
        compiled = grad.lower(model.abstract_params(), batch).compile()
        temp[policy] = compiled.memory_analysis().temp_size_in_bytes
    assert temp["none"] > temp["save_attention"] > temp["full"], temp


@needs_libtpu
def test_a_group_plan_holds_k_members_state_whole_or_one_per_data_slice(tiny_cfg):
    # v5e-8: 8 chips, mesh data=8. Whole members: every chip holds all 4 members' parameters
    # and Adam moments (4x a run's, to the byte: the step, RNG and count gain a member axis
    # too). Split over data, 8 members: each chip holds one member, a run's bytes.
    cfg = tiny_cfg("causal_decoder", None, "model.dropout=0.0", "model.n_layers=1")
    plans = {
        name: aot.compile_plan(cfg.replace(mesh=cfg.mesh.replace(members=split)), "v5e-8", False, k)
        for name, split, k in (("run", "none", 1), ("whole", "none", 4), ("split", "data", 8))
    }
    run, whole, split = plans["run"], plans["whole"], plans["split"]
    assert "members" not in run and whole["members"] == 4 and split["members"] == 8
    assert whole["members_split"] == "none" and split["members_split"] == "data"
    state = run["bytes_per_chip"]["state"]
    assert whole["bytes_per_chip"]["state"] == 4 * state
    assert split["bytes_per_chip"]["state"] == state
    # The compiler's own argument buffers (state and a chip's rows) follow: whole members'
    # rows are 4 members x 2 rows per chip, a split member's all 16 of its rows.
    assert whole["bytes_per_chip"]["argument"] > 3.5 * run["bytes_per_chip"]["argument"]
    assert split["bytes_per_chip"]["argument"] < 1.5 * run["bytes_per_chip"]["argument"]
    assert all(p["fits"] and p["device_kind"] == "TPU v5 lite" for p in plans.values())


@needs_libtpu
def test_an_expert_parallel_moe_plans_for_a_tpu_slice_quietly(tmp_path):
    """`compile --topology` plans a 16-expert MoE split over an 8-chip expert axis: the
    routed experts' state is divided over the chips (against the same model with the batch
    split instead), and the command says nothing but its plan, also when it compiles the
    same program again (JAX's persistent cache cannot load a topology's program back)."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "SCALESTUDY_JAX_CACHE": str(tmp_path / "cache")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    moe = ["model.moe.enabled=true", "model.moe.routed_experts=16", "model.d_ff=256"]
    base = ["compile", "--config", "configs/models/tiny.yaml", "--topology", "v5e-8"]
    base += ["--memory-only", "--json", "train.batch_size=64", *moe]

    def plan(*mesh: str) -> dict:
        done = subprocess.run(
            [sys.executable, "-m", "scalestudy.cli.main", *base, *mesh],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0 and done.stderr == "", done.stderr[-800:]
        return json.loads(done.stdout)

    experts = plan("mesh.expert=8", "mesh.data=1")
    assert experts["mesh"] == {"data": 1, "fsdp": 1, "expert": 8, "tensor": 1} and experts["fits"]
    again = plan("mesh.expert=8", "mesh.data=1")
    assert {**again, "compile_s": 0} == {**experts, "compile_s": 0}
    batch = plan()
    assert batch["mesh"]["data"] == 8
    # 2 layers x 16 experts x 3 matrices (gated GELU) of 32 x 256, float32 with two Adam
    # moments: each chip holds an eighth of them.
    expert_state = 2 * 16 * 3 * 32 * 256 * 4 * 3
    saved = batch["bytes_per_chip"]["state"] - experts["bytes_per_chip"]["state"]
    assert saved == pytest.approx(expert_state * 7 / 8, rel=0.05)
