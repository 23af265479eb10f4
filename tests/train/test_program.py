"""A group's program with its member axis split over the mesh's data axis (`mesh.members:
data`): the same losses as the group with whole members, its arrays really split, and a group
the data axis does not divide refused in one line."""

import jax
import numpy as np
import pytest

from scalestudy.config.errors import ConfigError
from scalestudy.data import pipeline
from scalestudy.train import loop
from scalestudy.train import program as group_program
from scalestudy.train.rundir import layout as rundir

# 8 CPU devices as 4 data slices x 2 fsdp: split, each slice holds one whole member, its
# parameters split over fsdp as a run's are.
MESH = ("mesh.data=4", "mesh.fsdp=2")
# float32 on a CPU, dropout 0.1 on: split and whole members differ by at most 3.8e-7
# relative over 8 steps (the same sums, reduced over other devices).
RTOL_SPLIT = 1e-5


def _group(tiny_cfg, split: str, k: int = 4):
    return [
        tiny_cfg(
            "causal_decoder",
            None,
            "train.stop_after_steps=8",
            f"train.seed={s}",
            f"data.seed={s}",
            f"optim.learning_rate={(0.01, 0.003)[s % 2]}",
            f"name=m{s}",
            "model.dtype=float32",
            *MESH,
            f"mesh.members={split}",
        )
        for s in range(k)
    ]


def _losses(workdir):
    return [r["train/loss"] for r in rundir.read_metrics(workdir) if "train/loss" in r]


def test_members_split_over_data_train_as_whole_members_do(tiny_cfg, tmp_path):
    trained = {}
    for split in ("none", "data"):
        dirs = [tmp_path / f"{split}{i}" for i in range(4)]
        results = loop.train_group(_group(tiny_cfg, split), dirs)
        trained[split] = np.array([_losses(d) for d in dirs])
        trained[split + "/val"] = np.array([r["final_val_loss"] for r in results])
    assert trained["data"].shape == (4, 8)
    np.testing.assert_allclose(trained["data"], trained["none"], rtol=RTOL_SPLIT)
    np.testing.assert_allclose(trained["data/val"], trained["none/val"], rtol=RTOL_SPLIT)
    # Four different runs, not one trained four times.
    assert len({round(float(x), 4) for x in trained["data"][:, -1]}) == 4


def _member_slices(x: jax.Array) -> dict[int, set]:
    """{device id: the member indices its shard of `x` holds}."""
    return {s.device.id: set(range(*s.index[0].indices(x.shape[0]))) for s in x.addressable_shards}


def test_split_state_and_batches_lie_member_by_member_on_the_data_slices(tiny_cfg):
    cfgs = _group(tiny_cfg, "data")
    batch = next(pipeline.make_iterator(cfgs[0], "train"))
    program = group_program.build_program(cfgs, batch)
    assert program.member_axis == "data"
    state = program.init(range(4))
    batches = program.shard([batch] * 4)
    for _ in range(2):  # the step's outputs stay split as its inputs
        state, _ = program.train_step(state, batches, program.hyper)
    devices = program.mesh.devices  # [data, fsdp, tensor]
    want = {int(d.id): {i} for i in range(4) for d in devices[i].flat}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        where = jax.tree_util.keystr(path)
        assert leaf.sharding.spec[0] == "data", where
        assert _member_slices(leaf) == want, where
    wi = state["params"]["decoder"]["layer_0"]["mlp"]["wi_0"]  # [K, embed, mlp]
    assert wi.sharding.spec[:2] == ("data", "fsdp")
    assert wi.addressable_shards[0].data.shape == (1, 16, 64)
    tokens = batches["decoder_input_tokens"]  # [K, B, L]: rows over fsdp only
    assert tokens.sharding.spec[:2] == ("data", "fsdp")
    assert tokens.addressable_shards[0].data.shape[:2] == (1, 8)
    assert _member_slices(tokens) == want
    # Whole members: every device holds every member.
    whole = _group(tiny_cfg, "none")
    program = group_program.build_program(whole, batch)
    assert program.member_axis is None
    params = program.init(range(4))["params"]
    assert all(leaf.sharding.spec[0] is None for leaf in jax.tree.leaves(params))


def test_a_group_the_data_axis_does_not_divide_is_one_error(tiny_cfg, tmp_path):
    cfgs = _group(tiny_cfg, "data", k=3)
    dirs = [tmp_path / f"m{i}" for i in range(3)]
    with pytest.raises(ConfigError, match=r"the 3 members over mesh\.data=4") as err:
        loop.train_group(cfgs, dirs)
    assert "\n" not in str(err.value) and "mesh.members=none" in str(err.value)
    assert not any(tmp_path.iterdir())  # refused before anything was written
    batch = next(pipeline.make_iterator(cfgs[0], "train"))
    with pytest.raises(ConfigError, match=r"3 members over mesh\.data=4"):
        group_program.build_program(cfgs, batch)


def test_split_members_of_an_expert_parallel_moe_train_as_whole_members_do(tiny_cfg, tmp_path):
    """The all-to-all dispatch (capacity, mesh.expert=2) inside members vmapped over data.
    Capacity 4 x 4 experts drops nothing: with drops, the two would differ, as each counts
    slots per device's rows (8 devices' or 4 devices' share of a member's rows)."""
    moe = ("model.moe.enabled=true", "model.moe.routed_experts=4", "model.moe.dispatch=capacity",
           "model.moe.capacity_factor=4")  # fmt: skip
    mesh = ("mesh.data=2", "mesh.fsdp=2", "mesh.expert=2")
    losses = {}
    for split in ("none", "data"):
        cfgs = [
            tiny_cfg("causal_decoder", None, "train.stop_after_steps=3", f"train.seed={s}",
                     f"name=m{s}", "model.dtype=float32", *moe, *mesh, f"mesh.members={split}")
            for s in range(2)
        ]  # fmt: skip
        dirs = [tmp_path / f"{split}{i}" for i in range(2)]
        loop.train_group(cfgs, dirs)
        losses[split] = np.array([_losses(d) for d in dirs])
    np.testing.assert_allclose(losses["data"], losses["none"], rtol=RTOL_SPLIT)
    assert not np.allclose(losses["data"][0], losses["data"][1])
