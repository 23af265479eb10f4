"""Checkpoints on plain pytrees: round trip, retention, corruption fallback."""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from scalestudy.config.experiment import ExperimentConfig
from scalestudy.train.rundir.checkpoint import Checkpointer, CheckpointError
from scalestudy.train.rundir.checkpoint_recovery import restore, verify


def make_state(seed: int) -> dict:
    params = {"dense": {"w": jnp.arange(6.0).reshape(2, 3) * seed, "b": jnp.ones(3) * seed}}
    tx = optax.adamw(1e-3)
    opt_state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt_state = tx.update(grads, opt_state, params)
    return {
        "params": params,
        "opt_state": opt_state,
        "step": jnp.asarray(seed, jnp.int32),
        "rng": jax.random.key_data(jax.random.key(seed)),
    }


def abstract(state: dict) -> dict:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)


def assert_equal(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_round_trip_and_latest(tmp_path):
    cfg = ExperimentConfig()
    ckpt = Checkpointer(tmp_path / "checkpoints", keep_last=2)
    for step in (1, 2, 3):
        ckpt.save(step, make_state(step), {"position": step}, cfg)
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3]  # keep_last=2
    state, data, step = restore(ckpt, abstract(make_state(0)))
    assert step == 3 and data == {"position": 3}
    assert_equal(state, make_state(3))
    saved_cfg = json.loads((tmp_path / "checkpoints/3/config/metadata").read_text())
    assert saved_cfg == cfg.model_dump(mode="json")
    ckpt.close()


def test_keep_every(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=1, keep_every=4, async_save=False)
    for step in range(1, 10):
        ckpt.save(step, make_state(step), {}, ExperimentConfig())
    ckpt.wait()
    assert ckpt.all_steps() == [4, 8, 9]
    ckpt.close()


def test_corrupt_latest_falls_back_to_previous(tmp_path):
    ckpt = Checkpointer(tmp_path / "checkpoints", keep_last=3)
    for step in (5, 10):
        ckpt.save(step, make_state(step), {"position": step}, ExperimentConfig())
    ckpt.wait()
    ckpt.close()
    for f in (tmp_path / "checkpoints/10/params").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    ckpt = Checkpointer(tmp_path / "checkpoints", keep_last=3)
    with pytest.warns(UserWarning, match="step 10 cannot be restored"):
        state, data, step = restore(ckpt, abstract(make_state(0)))
    assert step == 5 and data == {"position": 5}
    assert_equal(state, make_state(5))
    # The bad checkpoint is kept aside, not deleted, and no longer counts as the latest.
    assert (tmp_path / "corrupt_checkpoints/10/params").is_dir()
    assert ckpt.all_steps() == [5]
    with pytest.raises(CheckpointError, match="available"):
        restore(ckpt, abstract(make_state(0)), step=10)
    ckpt.close()


def test_interrupted_save_is_invisible(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=2)
    ckpt.save(1, make_state(1), {}, ExperimentConfig())
    ckpt.wait()
    ckpt.close()
    # What a save killed mid-way leaves behind: a temporary directory.
    (tmp_path / "2.orbax-checkpoint-tmp-123").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt = Checkpointer(tmp_path, keep_last=2)
        assert ckpt.latest_step() == 1
        _, _, step = restore(ckpt, abstract(make_state(0)))
    assert step == 1
    ckpt.close()


def save_steps(directory, steps, keep_last=5):
    ckpt = Checkpointer(directory, keep_last=keep_last)
    for step in steps:
        ckpt.save(step, make_state(step), {"position": step}, ExperimentConfig())
    ckpt.wait()
    ckpt.close()


def test_a_state_that_does_not_fit_is_an_error_and_moves_nothing(tmp_path):
    """Restore raising (here: shapes differ) is not corruption: the checkpoint stays."""
    save_steps(tmp_path / "checkpoints", (5, 10))
    other = abstract(make_state(0))
    other["params"]["dense"]["b"] = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=None)
    ckpt = Checkpointer(tmp_path / "checkpoints")
    with pytest.raises(CheckpointError, match=r"step 10 .* intact .*not compatible"):
        restore(ckpt, other)
    assert ckpt.all_steps() == [5, 10] and not (tmp_path / "corrupt_checkpoints").exists()
    ckpt.close()


def test_a_transient_failure_moves_nothing(tmp_path, monkeypatch):
    save_steps(tmp_path / "checkpoints", (5, 10))
    ckpt = Checkpointer(tmp_path / "checkpoints")
    real = ckpt.restore_step
    calls = []

    def flaky(step, abstract_state):
        calls.append(step)
        if len(calls) == 1:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while restoring")
        return real(step, abstract_state)

    monkeypatch.setattr(ckpt, "restore_step", flaky)
    with pytest.raises(CheckpointError, match=r"intact.*RESOURCE_EXHAUSTED"):
        restore(ckpt, abstract(make_state(0)))
    assert ckpt.all_steps() == [5, 10]
    _, _, step = restore(ckpt, abstract(make_state(0)))  # the retry restores the newest
    assert step == 10
    ckpt.close()


def test_missing_files_are_set_aside(tmp_path):
    save_steps(tmp_path / "checkpoints", (5, 10))
    for f in (tmp_path / "checkpoints/10/train").rglob("*"):
        if f.is_file() and "ocdbt" in str(f.parent) + f.name:
            f.unlink()
    ckpt = Checkpointer(tmp_path / "checkpoints")
    with pytest.warns(UserWarning, match="step 10 cannot be restored: it is unreadable"):
        _, data, step = restore(ckpt, abstract(make_state(0)))
    assert step == 5 and data == {"position": 5}
    assert (tmp_path / "corrupt_checkpoints/10/train").is_dir()
    ckpt.close()


def test_every_checkpoint_unreadable_stops_instead_of_starting_over(tmp_path):
    save_steps(tmp_path / "checkpoints", (5, 10))
    for f in (tmp_path / "checkpoints").rglob("*"):
        if f.is_file() and f.parent.name in ("params", "train"):
            f.write_bytes(b"garbage")
    for _attempt in range(2):  # the second run finds only the set-aside ones: still an error
        ckpt = Checkpointer(tmp_path / "checkpoints")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(CheckpointError, match=r"no readable checkpoint.*step 0"):
                restore(ckpt, abstract(make_state(0)))
        ckpt.close()
    assert sorted(p.name for p in (tmp_path / "corrupt_checkpoints").iterdir()) == ["10", "5"]


def test_an_unreadable_data_state_file_is_set_aside(tmp_path):
    """The data item is one JSON file per process: a garbled one makes the checkpoint
    unreadable."""
    save_steps(tmp_path / "checkpoints", (5, 10))
    (tmp_path / "checkpoints/10/data/metadata").write_text("{garbage")
    ckpt = Checkpointer(tmp_path / "checkpoints")
    assert verify(ckpt.directory, 5) is None
    assert verify(ckpt.directory, 10).startswith("data: ")
    with pytest.warns(UserWarning, match="step 10 cannot be restored: it is unreadable"):
        _, data, step = restore(ckpt, abstract(make_state(0)))
    assert step == 5 and data == {"position": 5}
    assert (tmp_path / "corrupt_checkpoints/10/data").is_dir()
    ckpt.close()


def test_small_replicated_arrays_are_written_whole_large_ones_by_every_replica(
    tmp_path, monkeypatch
):
    """On 8 devices a replicated array is written by one replica when a replica's share would
    be under REPLICA_PARALLEL_MIN_BYTES (no device slicing), by all 8 above it; both restore."""
    from orbax.checkpoint._src.serialization import replica_slices

    from scalestudy.train.rundir import checkpoint

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    big_rows = 8 * checkpoint.REPLICA_PARALLEL_MIN_BYTES // (4 * 128)  # 8 slices of the minimum
    state = {
        "params": {"small": jnp.arange(48.0).reshape(8, 6), "big": jnp.ones((big_rows, 128))},
        "step": jnp.asarray(3, jnp.int32),
    }
    state = jax.device_put(state, replicated)
    sliced = []  # the shapes of the arrays a save sliced between replicas, once a slice
    real_data = replica_slices.ReplicaSlice.data

    def data(self):
        if self.slice_args is not None:
            sliced.append(self.unsliced_data.shape)
        return real_data(self)

    monkeypatch.setattr(replica_slices.ReplicaSlice, "data", data)
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(3, state, {}, ExperimentConfig())
    ckpt.wait()
    assert len(sliced) == 8 and set(sliced) == {(big_rows, 128)}  # the big array only
    template = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), state
    )
    restored, _, step = restore(ckpt, template)
    assert step == 3
    assert_equal(restored, state)
    ckpt.close()
