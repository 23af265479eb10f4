"""The MoE load warning: a router that sends every token to one expert is reported once per
layer (a `warning:` line and the summary), a healthy router is not, and the balancing biases'
range is logged per layer."""

import warnings

import jax.numpy as jnp
import pytest

from scalestudy.config.moe_config import MoEConfig
from scalestudy.models import moe
from scalestudy.train import expert_load, loop
from scalestudy.train.rundir import layout as rundir

MOE = (
    "model.dtype=float32",
    "model.dropout=0",
    "model.moe.enabled=true",
    "model.moe.routed_experts=4",
    "model.moe.top_k=1",
    "model.moe.router=switch",
    "model.n_layers=2",
    "model.scan_layers=false",
    "train.steps=6",
    "train.checkpoint_every=6",
)


_SWITCH = moe.route_switch


def _collapsed(logits_BLE, k, load_balance, z_loss):
    """A toy Switch router forced to collapse: every token chooses expert 0."""
    out = _SWITCH(logits_BLE, k, load_balance, z_loss)
    return out._replace(expert_TK=jnp.zeros_like(out.expert_TK))


def _train(cfg, workdir):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = loop.train(cfg, workdir)
    return summary, [str(w.message) for w in caught if "MoE layer" in str(w.message)]


@pytest.mark.slow  # trains 6 steps
def test_a_collapsed_router_is_warned_once_per_layer(tiny_cfg, tmp_path, monkeypatch):
    monkeypatch.setattr(moe, "route_switch", _collapsed)
    summary, said = _train(tiny_cfg("causal_decoder", "flm", *MOE), tmp_path)
    # Both layers collapse at every logged step (6 rows), yet one line each.
    assert len(said) == 2, said
    assert any("decoder_0 at step 1" in s for s in said)
    assert any("decoder_1 at step 1" in s for s in said)
    assert all("100% of the tokens" in s for s in said)
    seen = summary["moe_load_warnings"]
    assert set(seen) == {"decoder_0", "decoder_1"}
    assert seen["decoder_0"]["share"] == pytest.approx(1.0)
    assert seen["decoder_0"]["load_max"] == pytest.approx(4.0)  # E / K: every token, one expert
    assert rundir.read_summary(tmp_path)["moe_load_warnings"] == seen


@pytest.mark.slow  # trains 6 steps
def test_a_healthy_router_is_not_warned(tiny_cfg, tmp_path):
    cfg = tiny_cfg("causal_decoder", "flm", *MOE, "model.moe.router=deepseek")
    summary, said = _train(cfg, tmp_path)
    assert said == []
    assert summary["moe_load_warnings"] == {}
    rows = [r for r in rundir.read_metrics(tmp_path) if "train/loss" in r]
    assert max(r["moe/decoder_1/load_max"] for r in rows) < 4 * expert_load.COLLAPSE_SHARE
    # The balancing biases' range, per layer and step: apart once the loads have moved them.
    assert all(r["moe/decoder_0/bias_min"] <= r["moe/decoder_0/bias_max"] for r in rows)
    assert rows[-1]["moe/decoder_0/bias_max"] > rows[-1]["moe/decoder_0/bias_min"]


def test_the_threshold_is_a_share_of_tokens_and_wide_top_k_is_not_watched():
    m = MoEConfig(enabled=True, routed_experts=8, top_k=2)
    assert expert_load.busiest_share(4.0, m) == 1.0  # max/mean E / K: every token
    totals: dict = {}
    watch = expert_load.LoadWatch(m, totals)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch(10, {"moe/decoder_0/load_max": 3.6, "moe/decoder_1/load_max": 3.7})  # 90%, 92.5%
        watch(20, {"moe/decoder_1/load_max": 4.0})  # warned already
    assert [str(w.message).split(":")[0] for w in caught] == ["MoE layer decoder_1 at step 10"]
    assert set(totals["moe_load_warnings"]) == {"decoder_1"}
    assert not expert_load.watched(MoEConfig(enabled=True, routed_experts=4, top_k=3))
    assert expert_load.watched(MoEConfig(enabled=True, routed_experts=4, top_k=2))
