"""Parameter and FLOP counts against the built models, XLA, and published checkpoints."""

from __future__ import annotations

import json
import math
import time

import jax
import pytest

from scalestudy.cli import main as cli
from scalestudy.config.experiment import ExperimentConfig, ModelConfig, load_config
from scalestudy.models import counting
from scalestudy.models.api import build_model

# Published T5.1.1 checkpoint sizes (the gs://t5-data/pretrained_models/t5.1.1.* releases).
T5_1_1 = {
    "small": 76_961_152,
    "base": 247_577_856,
    "large": 783_150_080,
    "xl": 2_849_757_184,
    "xxl": 11_135_332_352,
}


def _tree_size(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("arch", ["causal_decoder", "noncausal_decoder", "encoder_decoder"])
@pytest.mark.parametrize("position", ["relative_bias", "rope", "none"])
@pytest.mark.parametrize("tie", [False, True])
def test_counted_params_equal_the_model(tiny_cfg, arch, position, tie):
    cfg = tiny_cfg(arch, position=position, tie_embeddings=tie, activation="gated_silu")
    counts = counting.count_params(cfg)
    assert counts["total"] == _tree_size(build_model(cfg).abstract_params())
    assert counts["total"] == counts["embedding"] + counts["non_embedding"]
    assert counts["embedding"] == cfg.vocab_size * cfg.d_model * (1 if tie else 2)


@pytest.mark.parametrize("buckets", ["mirrored", "causal"])
def test_the_non_causal_decoders_bias_table_is_counted_as_built(tiny_cfg, buckets):
    """`rel_prefix_buckets: causal` builds one table of causal buckets, not the mirrored two."""
    cfg = tiny_cfg("noncausal_decoder", rel_prefix_buckets=buckets)
    assert counting.count_params(cfg)["total"] == _tree_size(build_model(cfg).abstract_params())


@pytest.mark.parametrize("arch", ["causal_decoder", "noncausal_decoder", "encoder_decoder"])
def test_counted_params_equal_the_initialised_tree(compiled, tiny_cfg, arch):
    _model, params, _ = compiled(tiny_cfg(arch))
    assert counting.count_params(tiny_cfg(arch))["total"] == _tree_size(params)
    plain = tiny_cfg(
        arch, activation="relu", d_kv=12, n_encoder_layers=3 if arch == "encoder_decoder" else None
    )
    assert counting.count_params(plain)["total"] == _tree_size(build_model(plain).abstract_params())
    normed = tiny_cfg(arch, qk_norm=True, d_kv=12)
    assert counting.count_params(normed)["total"] == _tree_size(
        build_model(normed).abstract_params()
    )


@pytest.mark.parametrize("size", sorted(T5_1_1))
def test_t5_1_1_presets_match_published_counts(repo, size):
    cfg = load_config(repo / "configs" / "models" / f"t5_1_1_{size}.yaml")
    assert counting.count_params(cfg.model)["total"] == T5_1_1[size]
    assert _tree_size(build_model(cfg.model).abstract_params()) == T5_1_1[size]


def test_every_preset_describes_quickly_without_weights(repo, capsys):
    for path in sorted((repo / "configs" / "models").glob("*.yaml")):
        start = time.perf_counter()
        assert cli.main(["describe", "--config", str(path), "--json"]) == 0
        elapsed = time.perf_counter() - start
        out = json.loads(capsys.readouterr().out)
        assert elapsed < 10, f"{path.name} took {elapsed:.1f}s"
        # 6N counts what a token uses: the active parameters of an MoE preset.
        n = out.get("params_active_non_embedding", out["params_non_embedding"])
        assert out["flops_per_token_6n"] == 6 * n
        assert out["flops_per_token"] * out["positions_per_example"] == pytest.approx(
            out["flops_per_example"]
        )
        assert out["shapes"]


@pytest.mark.optimized
@pytest.mark.parametrize("arch", ["causal_decoder", "noncausal_decoder", "encoder_decoder"])
def test_forward_flops_match_xla_cost_analysis(make_batch_fn, arch):
    """Counted matmul FLOPs vs XLA's count of the compiled forward pass, which also includes
    the elementwise work we leave out (norms, softmax, activations): within 3%."""
    cfg = ModelConfig(
        arch=arch, vocab_size=512, d_model=128, n_heads=4, d_ff=512, n_layers=2,
        dtype="float32", scan_layers=False,
    )  # fmt: skip
    rows, length, src, prefix = 2, 64, 48, 20
    model = build_model(cfg)
    batch = make_batch_fn(rows=rows, length=length, src=src, prefix=prefix)
    compiled = jax.jit(model.apply).lower(model.abstract_params(), batch).compile()
    xla = compiled.cost_analysis()["flops"]
    counted = rows * counting.forward_flops(
        cfg, length, src if cfg.is_encoder_decoder else 0, prefix
    )
    assert counted <= xla <= 1.03 * counted


def test_flops_by_hand_and_causal_halving():
    m = ModelConfig(
        arch="noncausal_decoder", vocab_size=100, d_model=8, n_heads=2, d_kv=3, d_ff=16,
        n_layers=2, activation="gated_gelu",
    )  # fmt: skip
    cfg = ExperimentConfig(
        model=m, objective={"name": "plm", "inputs_length": 4, "targets_length": 6}
    )
    length, hk = 10, 6
    per_layer = 2 * length * 8 * hk * 4 + 2 * 2 * hk * length**2 + 2 * length * 3 * 8 * 16
    forward = 2 * per_layer + 2 * length * 8 * 100
    f = counting.flops(cfg)
    assert f["flops_per_example"] == 3 * forward
    assert f["positions_per_example"] == length
    assert not f["causal_attention_halved"]
    halved = counting.flops(cfg.replace(model=m.replace(halve_causal_attention_flops=True)))
    # Prefix block (4 x 4) in full, the remaining 100 - 16 pairs at half.
    saved = 2 * 2 * 2 * hk * (length**2 - (16 + (100 - 16) / 2))
    assert halved["flops_per_example"] == 3 * (forward - saved)
    assert halved["causal_attention_halved"]


def test_encoder_decoder_flops_count_both_stacks_and_cross_attention():
    m = ModelConfig(
        arch="encoder_decoder", vocab_size=50, d_model=8, n_heads=2, d_ff=16, n_layers=1,
        activation="relu",
    )  # fmt: skip
    s, length, hk = 5, 3, 8
    enc = 2 * s * 8 * hk * 4 + 4 * hk * s * s + 2 * s * 2 * 8 * 16
    dec = 2 * length * 8 * hk * 4 + 4 * hk * length**2 + 2 * length * 2 * 8 * 16
    cross = 2 * length * 8 * hk * 2 + 2 * s * 8 * hk * 2 + 4 * hk * length * s
    logits = 2 * length * 8 * 50
    assert counting.forward_flops(m, length, s) == enc + dec + cross + logits
