"""Mesh construction, the logical rules table, and sharded forward passes on 8 CPU devices."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from jax.experimental import mesh_utils
from jax.sharding import PartitionSpec as P

from scalestudy.config.experiment import MeshConfig, ModelConfig, TrainConfig
from scalestudy.models.api import build_model
from scalestudy.train import sharding

CFG = ModelConfig(
    arch="encoder_decoder", vocab_size=64, d_model=32, n_heads=4, d_ff=64, n_layers=2,
    dtype="float32", scan_layers=True,
)  # fmt: skip


def _batch(rows: int = 8, length: int = 16, src: int = 12) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    targets = rng.integers(1, 64, (rows, length)).astype(np.int32)
    seg = np.ones((rows, length), np.int32)
    seg[:, 10:] = 2  # two packed examples per row
    pos = np.concatenate([np.arange(10), np.arange(length - 10)]).astype(np.int32)
    return {
        "decoder_input_tokens": np.roll(targets, 1, axis=1),
        "decoder_target_tokens": targets,
        "decoder_loss_weights": np.ones((rows, length), np.int32),
        "decoder_segment_ids": seg,
        "decoder_positions": np.tile(pos, (rows, 1)),
        "encoder_input_tokens": rng.integers(1, 64, (rows, src)).astype(np.int32),
        "encoder_segment_ids": np.repeat([[1] * 6 + [2] * 6], rows, 0).astype(np.int32),
        "encoder_positions": np.tile(np.r_[np.arange(6), np.arange(6)], (rows, 1)).astype(np.int32),
    }


def test_mesh_sizes_resolve_and_mismatches_are_clear_errors():
    assert dict(sharding.make_mesh(MeshConfig(data=-1, fsdp=2)).shape) == {
        "data": 4, "fsdp": 2, "tensor": 1,
    }  # fmt: skip
    assert dict(sharding.make_mesh(MeshConfig(data=1, fsdp=-1, tensor=2)).shape)["fsdp"] == 4
    with pytest.raises(sharding.MeshError, match="uses 4 devices but 8"):
        sharding.make_mesh(MeshConfig(data=2, fsdp=2))
    with pytest.raises(sharding.MeshError, match="does not divide the 8"):
        sharding.make_mesh(MeshConfig(data=-1, fsdp=3))
    with pytest.raises(sharding.MeshError, match=r"mesh.tensor=8 does not divide model.n_heads=4"):
        sharding.make_mesh(MeshConfig(data=1, tensor=8), model=CFG)
    one = sharding.make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
    assert one.devices.size == 1


def test_rules_table_maps_logical_names():
    spec = sharding.logical_to_mesh_spec
    assert spec(("embed", "mlp")) == P("fsdp", "tensor")
    assert spec(("layers", "embed", "heads", "kv")) == P(None, "fsdp", "tensor", None)
    assert spec(("vocab", "embed")) == P("tensor", "fsdp")
    # Activations: batch takes (data, fsdp), so embed stays whole.
    assert spec(("batch", "length", "embed")) == P(("data", "fsdp"), None, None)
    assert spec(("batch", "length", "vocab")) == P(("data", "fsdp"), None, "tensor")


@pytest.fixture(scope="module")
def reference():
    model = build_model(CFG)
    params = jax.jit(model.init)(jax.random.key(0))
    single = jax.devices()[:1]
    with jax.default_device(single[0]):
        logits = np.asarray(jax.jit(model.apply)(params, _batch()))
    return model, logits


@pytest.mark.parametrize(
    "shape, topology", [((8, 1, 1), None), ((1, 8, 1), None), ((2, 2, 2), None), ((2, 2, 2), True)]
)
def test_sharded_forward_matches_one_device(reference, shape, topology):
    model, expected = reference
    mesh_cfg = MeshConfig(data=shape[0], fsdp=shape[1], tensor=shape[2])
    mesh = sharding.make_mesh(mesh_cfg, model=CFG, topology=topology)
    shardings = sharding.param_shardings(mesh, model.param_axes())
    with sharding.axis_rules(mesh):
        params = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0))
        batch = sharding.shard_batch(mesh, _batch())
        logits = jax.jit(model.apply)(params, batch)
    np.testing.assert_allclose(np.asarray(logits), expected, atol=2e-5)

    # Parameters are really split as the rules say.
    wi = params["decoder"]["layers"]["mlp"]["wi_0"]  # [layers, embed, mlp]
    assert wi.sharding.spec == P(None, "fsdp", "tensor")
    _, fsdp, tensor = shape
    assert wi.addressable_shards[0].data.shape == (2, 32 // fsdp, 64 // tensor)
    table = params["embed"]["table"]  # [vocab, embed]
    assert table.addressable_shards[0].data.shape == (64 // tensor, 32 // fsdp)
    data_shards = shape[0] * shape[1]
    assert batch["decoder_input_tokens"].addressable_shards[0].data.shape == (8 // data_shards, 16)
    assert logits.sharding.spec[0] in ("data", "fsdp", ("data", "fsdp"))


def test_shard_batch_rejects_indivisible_rows():
    mesh = sharding.make_mesh(MeshConfig(data=4, fsdp=2))
    with pytest.raises(sharding.MeshError, match="multiple of 8"):
        sharding.shard_batch(mesh, _batch(rows=6))


def test_optimizer_state_follows_parameter_shardings():
    model = build_model(CFG)
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    abstract = model.abstract_params()
    opt_state = jax.eval_shape(optax.adamw(1e-3).init, abstract)
    out = sharding.optimizer_state_shardings(mesh, opt_state, abstract, model.param_axes())
    mu = out[0].mu
    assert mu["decoder"]["layers"]["mlp"]["wo"].spec == P(None, "tensor", "fsdp")
    assert mu["embed"]["table"].spec == P("tensor", "fsdp")
    assert out[0].count.spec == P()


def test_device_grid_is_plain_on_cpu_and_a_permutation_when_topology_aware():
    devices = jax.devices()
    plain = sharding.device_grid(devices, (2, 2, 2))
    np.testing.assert_array_equal(plain, np.asarray(devices, dtype=object).reshape(2, 2, 2))
    aware = sharding.device_grid(devices, (2, 2, 2), topology=True)
    assert aware.shape == (2, 2, 2) and sorted(d.id for d in aware.flat) == list(range(8))


def _tpu_devices(name: str) -> list:
    topologies = pytest.importorskip("jax.experimental.topologies")
    pytest.importorskip("libtpu", reason="libtpu is not installed (describes TPU topologies)")
    try:
        return list(topologies.get_topology_desc(name, "tpu").devices)
    except Exception as err:  # libtpu set-up errors vary: lockfile, versions
        pytest.skip(f"no TPU topology from libtpu here: {err}")


def test_tpu_mesh_takes_the_physical_order(caplog):
    """TPU devices described by libtpu (no TPU needed): the mesh is mesh_utils' physical
    order (v5e 2x4, not the id order); per-core v4 devices, which mesh_utils cannot place,
    fall back to the plain order with a warning."""
    devices = _tpu_devices("v5e:2x4")
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2), devices, model=CFG)
    expected = mesh_utils.create_device_mesh((2, 2, 2), devices, allow_split_physical_axes=True)
    np.testing.assert_array_equal(mesh.devices, expected)
    assert [d.id for d in mesh.devices.flat] != sorted(d.id for d in devices)
    per_core = _tpu_devices("v4:2x2x1")
    with caplog.at_level("WARNING"):
        grid = sharding.device_grid(per_core, (4, 2, 1))
    np.testing.assert_array_equal(grid, np.asarray(per_core, dtype=object).reshape(4, 2, 1))
    assert "topology-aware mesh (4, 2, 1) not possible" in caplog.text


def test_batch_must_split_over_the_batch_axes():
    """The global batch divides mesh.data x mesh.fsdp; microbatches inside the step may split
    unevenly (XLA pads them), so only the batch itself is checked."""
    sizes = {"data": 4, "fsdp": 2, "tensor": 1}
    sharding.check_batch_fits(sizes, TrainConfig(batch_size=16))
    sharding.check_batch_fits(sizes, TrainConfig(batch_size=8, microbatches=2))
    with pytest.raises(sharding.MeshError) as err:
        sharding.check_batch_fits(sizes, TrainConfig(batch_size=12))
    assert "train.batch_size=12" in str(err.value)
    assert "mesh.data=4 x mesh.fsdp=2 = 8 shards" in str(err.value)
    assert "multiple of 8" in str(err.value)
    with pytest.raises(sharding.MeshError, match="batch_size=4"):
        sharding.make_mesh(MeshConfig(), model=ModelConfig(), batch=TrainConfig(batch_size=4))


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"SCALESTUDY_COORDINATOR": "localhost", "SCALESTUDY_NUM_PROCESSES": "2"}, "host:port"),
        ({"SCALESTUDY_COORDINATOR": "h:port", "SCALESTUDY_NUM_PROCESSES": "2"}, "host:port"),
        ({"SCALESTUDY_NUM_PROCESSES": "2", "SCALESTUDY_PROCESS_ID": "0"}, "without"),
        ({"SCALESTUDY_PROCESS_ID": "1"}, "SCALESTUDY_PROCESS_ID set without"),
    ],
)
def test_incomplete_multiprocess_settings_are_refused(env, words):
    """Never a silent one-process run, never JAX's own traceback on a malformed address."""
    with pytest.raises(sharding.MeshError, match=words):
        sharding.initialize_distributed(env)


def test_no_multiprocess_settings_is_one_process():
    assert sharding.initialize_distributed({}) is False
    assert sharding.initialize_distributed({"SCALESTUDY_DISTRIBUTED": "off"}) is False
