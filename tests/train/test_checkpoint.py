"""Checkpoints on plain pytrees: round trip, retention, corruption fallback."""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from scalestudy.config import ExperimentConfig
from scalestudy.train.checkpoint import Checkpointer, CheckpointError


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
    state, data, step = ckpt.restore(abstract(make_state(0)))
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
        state, data, step = ckpt.restore(abstract(make_state(0)))
    assert step == 5 and data == {"position": 5}
    assert_equal(state, make_state(5))
    # The bad checkpoint is kept aside, not deleted, and no longer counts as the latest.
    assert (tmp_path / "corrupt_checkpoints/10/params").is_dir()
    assert ckpt.all_steps() == [5]
    with pytest.raises(CheckpointError, match="available"):
        ckpt.restore(abstract(make_state(0)), step=10)
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
        _, _, step = ckpt.restore(abstract(make_state(0)))
    assert step == 1
    ckpt.close()
