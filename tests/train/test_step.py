"""The compiled train step: gradient accumulation, mesh invariance, every cell learns."""

import jax
import numpy as np
import pytest

from scalestudy.config.experiment import VALID_CELLS, MeshConfig
from scalestudy.data import pipeline
from scalestudy.train import program as train_program
from scalestudy.train import sharding

CELLS = [(arch, obj) for arch, objs in VALID_CELLS.items() for obj in objs]


def first_batch(cfg):
    return next(pipeline.make_iterator(cfg, "train"))


def run_steps(cfg, batch, n, mesh=None):
    program = train_program.build_program(cfg, batch, mesh)
    state = program.init(cfg.train.seed)
    losses = []
    for _ in range(n):
        state, m = program.step(state, program.shard_batch(batch))
        losses.append(m["train/loss"])
    return [float(x) for x in jax.device_get(losses)], state


def test_microbatches_equal_one_big_batch(tiny_cfg):
    # Without dropout: each microbatch draws its own dropout mask.
    cfg = tiny_cfg("causal_decoder", "plm", "model.dtype=float32", "model.dropout=0")
    batch = first_batch(cfg)
    results = []
    for k in (1, 2):
        program = train_program.build_program(
            cfg.replace(train={**cfg.train.model_dump(), "microbatches": k}), batch
        )
        state, rows = program.init(cfg.train.seed), []
        for _ in range(2):
            state, m = program.step(state, program.shard_batch(batch))
            rows.append([m["train/loss"], m["train/grad_norm"], m["step_tokens"]])
        results.append(np.asarray(jax.device_get(rows), np.float64))
    # Microbatches hold different numbers of loss-bearing tokens, so a mean of per-microbatch
    # means would be off by about 1%; in float32 only the summation order differs here.
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5)


def test_same_losses_on_any_mesh(tiny_cfg):
    # float32 compute: bf16 partial sums split over the tensor axis round differently.
    cfg = tiny_cfg("causal_decoder", "plm", "model.dtype=float32", "model.dropout=0")
    batch = first_batch(cfg)
    results = {}
    for shape, n_dev in [((8, 1, 1), 8), ((2, 2, 2), 8), ((1, 1, 1), 1)]:
        mesh_cfg = MeshConfig(data=shape[0], fsdp=shape[1], tensor=shape[2])
        mesh = sharding.make_mesh(mesh_cfg, jax.devices()[:n_dev], model=cfg.model)
        results[shape], _ = run_steps(cfg, batch, 3, mesh)
    # Different meshes sum in different orders: equal up to float32 rounding.
    np.testing.assert_allclose(results[(2, 2, 2)], results[(8, 1, 1)], rtol=1e-5)
    np.testing.assert_allclose(results[(1, 1, 1)], results[(8, 1, 1)], rtol=1e-5)


@pytest.mark.parametrize("arch,objective", CELLS)
def test_every_cell_overfits_a_batch(tiny_cfg, arch, objective):
    cfg = tiny_cfg(arch, objective)
    losses, _ = run_steps(cfg, first_batch(cfg), 40)  # the whole wsd schedule, peak 0.01
    # From ~6.4 (uniform over 384 ids) to under a third, despite dropout 0.1.
    assert losses[-1] < 0.3 * losses[0], losses


def test_state_and_metrics_contents(tiny_cfg):
    cfg = tiny_cfg("encoder_decoder", "plm")
    batch = first_batch(cfg)
    program = train_program.build_program(cfg, batch)
    state = program.init(cfg.train.seed)
    assert int(state["step"]) == 0
    state, m = program.step(state, program.shard_batch(batch))
    m = jax.device_get(m)
    assert int(state["step"]) == 1
    assert float(m["step_tokens"]) == batch["decoder_loss_weights"].sum()
    positions = (batch["decoder_segment_ids"] > 0).sum() + (batch["encoder_segment_ids"] > 0).sum()
    assert float(m["step_positions"]) == positions
    assert float(m["lr"]) == pytest.approx(0.01 / 2)  # warmup step 1 of 2
    assert m["train/loss"] == pytest.approx(m["train/ce"] + m["train/z_loss"], rel=1e-6)
    assert 0 < m["train/z_loss"] < 0.01 * m["train/ce"]
    # The sharded state keeps the parameter shardings the rules give.
    sh = program.state_sharding["params"]
    for leaf, want in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(sh)):
        assert leaf.sharding == want
