"""A run's checkpoint is plain orbax: `ocp.CheckpointManager(dir).restore(step)` in a process
that never imports scalestudy gives back every item, equal to what the package restores."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

from scalestudy.train import loop
from scalestudy.train.rundir import checkpoint_recovery, saved_run
from scalestudy.train.rundir.checkpoint import Checkpointer

from .conftest import tiny

# Run in a fresh interpreter: restores with orbax alone, proves scalestudy was never
# imported, and writes every leaf as numpy (arrays) or JSON (the JSON items).
PLAIN_RESTORE = """
import json, sys
import numpy as np
import jax
import orbax.checkpoint as ocp

directory, step, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
restored = ocp.CheckpointManager(directory).restore(step)
assert not [m for m in sys.modules if m.split(".")[0] == "scalestudy"], "scalestudy imported"
arrays = {}
for item in ("params", "train"):
    for path, leaf in jax.tree_util.tree_leaves_with_path(restored[item]):
        arrays[item + jax.tree_util.keystr(path)] = np.asarray(leaf)
np.savez(out + ".npz", **arrays)
json.dump(
    {"items": sorted(restored.keys()), "data": restored["data"], "config": restored["config"]},
    open(out + ".json", "w"),
)
"""


def test_plain_orbax_restores_every_item_without_the_package(tmp_path: Path):
    cfg = tiny("causal_decoder", None, "train.stop_after_steps=8")
    loop.train(cfg, tmp_path)
    directory = saved_run.checkpoint_dir(tmp_path)
    step = saved_run.latest_step(tmp_path)
    assert step == 8

    out = tmp_path / "plain"
    done = subprocess.run(
        [sys.executable, "-c", PLAIN_RESTORE, str(directory), str(step), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        # The devices the run trained on (8 CPU devices, conftest.py): orbax restores
        # arrays without a target only onto the topology they were saved from.
        env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": os.environ["XLA_FLAGS"]},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    plain = json.loads(out.with_suffix(".json").read_text())
    arrays = dict(np.load(out.with_suffix(".npz")))
    assert plain["items"] == ["config", "data", "params", "train"]

    # What the package restores from the same step (its newest), leaf by leaf.
    ckpt = Checkpointer(directory, read_only=True)
    assert plain["config"] == saved_run.load_config(tmp_path, step).model_dump(mode="json")
    state, data, restored_step = checkpoint_recovery.restore(
        ckpt, _abstract_from_checkpoint(ckpt, step)
    )
    ckpt.close()
    assert restored_step == step
    assert plain["data"] == data and plain["data"]["iterator"]
    leaves = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        item, path = ("params", path[1:]) if path[0].key == "params" else ("train", path)
        leaves[item + jax.tree_util.keystr(path)] = np.asarray(leaf)
    assert sorted(leaves) == sorted(arrays)
    assert any(name.startswith("train") and "opt" in name for name in leaves)
    for name, want in leaves.items():
        np.testing.assert_array_equal(arrays[name], want, err_msg=name)


def _abstract_from_checkpoint(ckpt: Checkpointer, step: int) -> dict:
    """The train state's shapes, read from the checkpoint's own metadata."""
    import orbax.checkpoint as ocp

    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    out = {}
    for item in ("params", "train"):
        tree = ocp.PyTreeCheckpointer().metadata(ckpt.directory / str(step) / item)
        tree = tree.item_metadata.tree
        abstract = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree
        )
        if item == "params":
            out["params"] = abstract
        else:
            out.update(abstract)
    return out
