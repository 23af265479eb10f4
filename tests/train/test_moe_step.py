"""The train step with mixture-of-experts layers: the balancing bias follows the step's loads
(not the optimizer), auxiliary losses and per-layer metrics are reported."""

import jax
import numpy as np

from scalestudy.data import pipeline
from scalestudy.train import program as train_program

MOE = (
    "model.dtype=float32",
    "model.dropout=0",  # the loads measured outside the step must be the step's own
    "model.moe.enabled=true",
    "model.moe.routed_experts=4",
    "model.moe.shared_experts=1",
    "model.moe.bias_rate=0.01",
    "model.moe.every=2",
    "model.n_layers=2",
    "model.scan_layers=false",
    "train.microbatches=2",
)


def test_balancing_bias_moves_by_the_steps_loads_and_nothing_else(tiny_cfg):
    cfg = tiny_cfg("causal_decoder", "flm", *MOE)
    batch = next(pipeline.make_iterator(cfg, "train"))
    program = train_program.build_program(cfg, batch)
    model, state = program.model, program.init(cfg.train.seed)
    measure = jax.jit(lambda p, b: model.loss(p, b, None, deterministic=True)[1]["moe"])
    for _ in range(3):
        bias = np.asarray(state["params"]["decoder"]["layer_1"]["mlp"]["router_bias"])
        load = np.asarray(measure(state["params"], batch)["decoder"]["load_E"][0])
        state, metrics = program.step(state, program.shard_batch(batch))
        moved = np.asarray(state["params"]["decoder"]["layer_1"]["mlp"]["router_bias"])
        # Exactly the rule: the optimizer (AdamW with weight decay) left the bias alone.
        np.testing.assert_array_equal(moved, bias + np.float32(0.01) * np.sign(load.mean() - load))
        np.testing.assert_allclose(
            float(metrics["moe/decoder_1/load_max"]), load.max() / load.mean(), rtol=1e-6
        )
    assert float(metrics["moe/decoder_1/dropped"]) == 0.0
    assert float(metrics["train/moe_aux_loss"]) > 0
    assert "layer_0" in state["params"]["decoder"]  # a dense layer: no router there
    assert "router" not in state["params"]["decoder"]["layer_0"]["mlp"]
