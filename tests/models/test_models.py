"""Model properties: who may attend to whom, packing, equivalences, score and loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalestudy.models import masks
from scalestudy.models.api import build_model
from scalestudy.models.layers import relative_bucket

ATOL = 1e-5


def _with(batch: dict, key: str, index: tuple, value: int) -> dict:
    out = {k: v.copy() for k, v in batch.items()}
    out[key][index] = value
    return out


def _other_token(batch: dict, key: str, index: tuple) -> int:
    return int(batch[key][index]) % 60 + 2  # any different non-pad id


def _changed_positions(a, b) -> np.ndarray:
    """Decoder positions whose logits differ (row 0)."""
    return np.abs(np.asarray(a) - np.asarray(b))[0].max(-1) > ATOL


def _effect(apply, params, batch: dict, base, key: str, index: tuple) -> np.ndarray:
    """Decoder positions (row 0) whose logits change when token `index` of `key` changes."""
    changed = _with(batch, key, index, _other_token(batch, key, index))
    return _changed_positions(base, apply(params, changed))


def test_causal_decoder_never_sees_the_future(compiled, tiny_cfg, make_batch_fn):
    _model, params, apply = compiled(tiny_cfg("causal_decoder"))
    # A non-zero decoder_causal_attention must be ignored by the causal decoder.
    batch = make_batch_fn(prefix=8)
    base = apply(params, batch)
    for t in (3, 6, 12):
        idx = (0, t)
        diff = _effect(apply, params, batch, base, "decoder_input_tokens", idx)
        assert not diff[:t].any(), f"token {t} changed earlier logits {np.flatnonzero(diff[:t])}"
        assert diff[t:].all()


@pytest.mark.parametrize("position", ["relative_bias", "rope"])
def test_noncausal_prefix_is_bidirectional_and_blind_to_targets(
    compiled, tiny_cfg, make_batch_fn, position
):
    prefix = 7
    _model, params, apply = compiled(tiny_cfg("noncausal_decoder", position=position))
    batch = make_batch_fn(prefix=prefix)
    base = apply(params, batch)
    # A later prefix token changes every prefix position (both directions) ...
    idx = (0, 5)
    diff = _effect(apply, params, batch, base, "decoder_input_tokens", idx)
    assert diff.all()
    # ... while a target token never reaches the prefix or earlier targets.
    for t in (prefix, prefix + 4):
        idx = (0, t)
        diff = _effect(apply, params, batch, base, "decoder_input_tokens", idx)
        assert not diff[:t].any()
        assert diff[t:].all()


def test_encoder_decoder_encoder_never_sees_decoder_tokens(compiled, tiny_cfg, make_batch_fn):
    _model, params, apply = compiled(tiny_cfg("encoder_decoder"))
    batch = make_batch_fn()
    base = apply(params, batch)
    # Every decoder position reads the whole encoder, so if a decoder token leaked into the
    # encoder, positions before it would change.
    t = 5
    idx = (0, t)
    diff = _effect(apply, params, batch, base, "decoder_input_tokens", idx)
    assert not diff[:t].any() and diff[t:].all()
    # Any encoder token (even the last) reaches every decoder position.
    idx = (0, batch["encoder_input_tokens"].shape[1] - 1)
    diff = _effect(apply, params, batch, base, "encoder_input_tokens", idx)
    assert diff.all()


def _packed_rows(make_batch_fn) -> dict:
    """Row 0: example a (7 positions, 5 encoder) then example b (9, 7) packed; row 1: a alone;
    row 2: b alone (each padded to 16 / 12)."""
    a = make_batch_fn(rows=1, length=7, src=5, prefix=3, seed=1)
    b = make_batch_fn(rows=1, length=9, src=7, prefix=4, seed=2)
    out = {}
    for key in a:
        first, second = a[key][0], b[key][0]
        pad_a = np.zeros(len(second), first.dtype)
        pad_b = np.zeros(len(first), first.dtype)
        packed = np.concatenate([first, second * 2 if key.endswith("segment_ids") else second])
        out[key] = np.stack(
            [packed, np.concatenate([first, pad_a]), np.concatenate([second, pad_b])]
        )
    return out


@pytest.mark.parametrize("arch", ["causal_decoder", "noncausal_decoder", "encoder_decoder"])
def test_packed_segments_never_attend_across(compiled, tiny_cfg, make_batch_fn, arch):
    _model, params, apply = compiled(tiny_cfg(arch))
    logits = np.asarray(apply(params, _packed_rows(make_batch_fn)))
    np.testing.assert_allclose(logits[0, :7], logits[1, :7], atol=ATOL)
    np.testing.assert_allclose(logits[0, 7:], logits[2, :9], atol=ATOL)


def test_mixed_masks_are_triangular_per_head():
    heads, length = 4, 6
    seg = np.ones((1, length), np.int32)
    enc = np.asarray(masks.encoder_self(seg, heads, mixed=True))[0]
    lower = np.tril(np.ones((length, length), bool))
    for h in range(heads):
        np.testing.assert_array_equal(enc[h], lower if h < heads // 2 else lower.T)
    # Non-causal decoder, mixed: directional inside the prefix, causal elsewhere.
    prefix = 3
    ca = np.zeros((1, length), np.int32)
    ca[:, :prefix] = 1
    dec = np.asarray(masks.decoder_self(seg, ca, heads, mixed=True))[0]
    for h in range(heads):
        expected = lower.copy()
        if h >= heads // 2:
            expected[:prefix, :prefix] = lower[:prefix, :prefix].T
        np.testing.assert_array_equal(dec[h], expected)
    standard = np.asarray(masks.decoder_self(seg, ca, heads, mixed=False))[0, 0]
    expected = lower.copy()
    expected[:prefix, :prefix] = True
    np.testing.assert_array_equal(standard, expected)


def test_mixed_attention_model_runs_and_differs(compiled, tiny_cfg, make_batch_fn):
    batch = make_batch_fn()
    cfg = tiny_cfg("encoder_decoder")
    _model, params, apply = compiled(cfg)
    mixed = build_model(cfg.replace(attention="mixed"))
    a, b = apply(params, batch), jax.jit(mixed.apply)(params, batch)
    assert np.isfinite(np.asarray(b)).all() and np.abs(np.asarray(a - b)).max() > ATOL


def test_noncausal_with_empty_prefix_equals_causal(compiled, tiny_cfg, make_batch_fn):
    _nc_model, nc_params, nc_apply = compiled(tiny_cfg("noncausal_decoder"))
    _c_model, _, c_apply = compiled(tiny_cfg("causal_decoder"))
    # Same weights; the causal table is the past half of the non-causal one.
    c_params = jax.tree.map(lambda x: x, nc_params)
    c_params["decoder"]["relpos"]["table"] = nc_params["decoder"]["relpos"]["table"][:32]
    batch = make_batch_fn(prefix=0)
    np.testing.assert_array_equal(
        np.asarray(nc_apply(nc_params, batch)), np.asarray(c_apply(c_params, batch))
    )


@pytest.mark.parametrize("attention", ["standard", "mixed_layers"])
def test_scanned_and_unrolled_layers_agree(compiled, tiny_cfg, make_batch_fn, attention):
    """Also with mixed layers: a scan picks each layer's mask by `lax.switch`, the unrolled
    loop by index."""
    cfg = tiny_cfg("encoder_decoder", attention=attention)
    _model, params, apply = compiled(cfg)
    unrolled = build_model(cfg.replace(scan_layers=False))
    flat = {k: v for k, v in params.items()}
    for stack in ("encoder", "decoder"):
        layers = params[stack]["layers"]
        flat[stack] = {k: v for k, v in params[stack].items() if k != "layers"}
        for i in range(cfg.n_layers):
            flat[stack][f"layer_{i}"] = jax.tree.map(lambda x, i=i: x[i], layers)
    assert jax.tree.structure(flat) == jax.tree.structure(unrolled.abstract_params())
    # Both layouts draw the same weights from the same key.
    for a, b in zip(
        jax.tree.leaves(flat), jax.tree.leaves(jax.jit(unrolled.init)(jax.random.key(0)))
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    batch = make_batch_fn()
    np.testing.assert_allclose(
        np.asarray(apply(params, batch)),
        np.asarray(jax.jit(unrolled.apply)(flat, batch)),
        atol=ATOL,
    )


def test_score_is_sum_of_target_log_softmax(compiled, tiny_cfg, make_batch_fn):
    model, params, apply = compiled(tiny_cfg("noncausal_decoder"))
    batch = make_batch_fn(rows=3, prefix=6)
    batch["decoder_loss_weights"][:, :6] = 0  # score only the targets
    batch["decoder_loss_weights"][2, 10:] = 0
    out = jax.jit(model.score)(params, batch)
    logits = np.asarray(apply(params, batch), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    w = batch["decoder_loss_weights"] > 0
    tgt = np.take_along_axis(logp, batch["decoder_target_tokens"][..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(out["logprob"]), (tgt * w).sum(1), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(out["n_tokens"]), w.sum(1))
    argmax_ok = (logits.argmax(-1) == batch["decoder_target_tokens"]) | ~w
    np.testing.assert_array_equal(np.asarray(out["all_correct"]), argmax_ok.all(1))


def test_loss_matches_hand_computation(compiled, tiny_cfg, make_batch_fn):
    model, params, apply = compiled(tiny_cfg("encoder_decoder"))
    batch = make_batch_fn()
    batch["decoder_loss_weights"][1, 4:] = 0
    batch["decoder_segment_ids"][1, 12:] = 0  # padding
    batch["encoder_segment_ids"][0, 10:] = 0
    loss, aux = jax.jit(lambda p, b: model.loss(p, b, None, z_loss=1e-2, deterministic=True))(
        params, batch
    )
    logits = np.asarray(apply(params, batch), np.float64)
    lse = np.log(np.exp(logits).sum(-1))
    tgt = np.take_along_axis(logits, batch["decoder_target_tokens"][..., None], -1)[..., 0]
    w = batch["decoder_loss_weights"].astype(np.float64)
    ce = (w * (lse - tgt)).sum() / w.sum()
    zl = 1e-2 * (w * lse**2).sum() / w.sum()
    np.testing.assert_allclose(float(loss), ce + zl, rtol=1e-5)
    np.testing.assert_allclose(float(aux["ce"]), ce, rtol=1e-5)
    assert float(aux["tokens"]) == w.sum()
    assert float(aux["positions"]) == (16 + 12) + (12 + 10) + (16 + 12)
    acc = (w * (logits.argmax(-1) == batch["decoder_target_tokens"])).sum() / w.sum()
    np.testing.assert_allclose(float(aux["accuracy"]), acc, rtol=1e-6)


def test_dropout_is_random_only_when_training(compiled, tiny_cfg, make_batch_fn):
    cfg = tiny_cfg("causal_decoder", dropout=0.2)
    model, params, apply = compiled(cfg)
    batch = make_batch_fn()
    train = jax.jit(lambda p, b, r: model.apply(p, b, rng=r, deterministic=False))
    a, b = train(params, batch, jax.random.key(1)), train(params, batch, jax.random.key(2))
    assert np.abs(np.asarray(a - b)).max() > 1e-3
    np.testing.assert_array_equal(
        np.asarray(a), np.asarray(train(params, batch, jax.random.key(1)))
    )
    _, _, no_dropout_apply = compiled(cfg.replace(dropout=0.0))
    np.testing.assert_allclose(
        np.asarray(apply(params, batch)),
        np.asarray(no_dropout_apply(params, batch)),
        atol=ATOL,
    )


def test_remat_gives_the_same_gradients(compiled, tiny_cfg, make_batch_fn):
    cfg = tiny_cfg("causal_decoder")
    model, params, _ = compiled(cfg)
    remat = build_model(cfg.replace(remat="full"))
    batch = make_batch_fn()

    def grads(m):
        return jax.jit(jax.grad(lambda p: m.loss(p, batch, None, deterministic=True)[0]))(params)

    for g1, g2 in zip(jax.tree.leaves(grads(model)), jax.tree.leaves(grads(remat))):
        np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), atol=1e-6)


def test_tied_equals_untied_with_scaled_transposed_table(compiled, tiny_cfg, make_batch_fn):
    cfg = tiny_cfg("causal_decoder", tie_embeddings=True)
    _model, params, apply = compiled(cfg)
    assert "logits" not in params
    untied = build_model(cfg.replace(tie_embeddings=False))
    # T5X: tied logits are x @ E^T / sqrt(d_model).
    untied_params = {**params, "logits": params["embed"]["table"].T / np.sqrt(cfg.d_model)}
    batch = make_batch_fn()
    np.testing.assert_allclose(
        np.asarray(apply(params, batch)),
        np.asarray(jax.jit(untied.apply)(untied_params, batch)),
        atol=ATOL,
    )


def test_relative_buckets_match_t5_by_hand():
    rel = jnp.array([0, -3, 3, -8, -16, -1000, 1000])
    bi = relative_bucket(rel, bidirectional=True, n_buckets=32, max_distance=128)
    # 16 buckets per direction, 8 exact; 16 = 8 * 2 -> 8 + int(log 2 / log 16 * 8) = 10.
    np.testing.assert_array_equal(np.asarray(bi), [0, 3, 19, 8, 10, 15, 31])
    uni = relative_bucket(
        jnp.array([0, -3, 3, -32, -1000]), bidirectional=False, n_buckets=32, max_distance=128
    )
    # 16 exact; 32 = 16 * 2 -> 16 + int(log 2 / log 8 * 16) = 21; the future is bucket 0.
    np.testing.assert_array_equal(np.asarray(uni), [0, 3, 0, 21, 31])


def test_init_draws_independent_normals_with_the_intended_scale(compiled, tiny_cfg):
    cfg = tiny_cfg("causal_decoder", d_model=64, d_ff=128)
    model = build_model(cfg)
    params = jax.jit(model.init)(jax.random.key(3))
    again = jax.jit(model.init)(jax.random.key(3))
    other = jax.jit(model.init)(jax.random.key(4))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    table = np.asarray(params["embed"]["table"])
    assert abs(table.std() - 1.0) < 0.03 and abs(table.mean()) < 0.03
    assert not np.allclose(table, np.asarray(other["embed"]["table"]))
    wi = np.asarray(params["decoder"]["layers"]["mlp"]["wi_0"])  # [layers, D, F]
    np.testing.assert_allclose(wi.std(axis=(1, 2)), cfg.d_model**-0.5, rtol=0.05)
    # Layers, and parameters of equal shape, are not copies of each other.
    assert abs(np.corrcoef(wi[0].ravel(), wi[1].ravel())[0, 1]) < 0.05
    q, k = (np.asarray(params["decoder"]["layers"]["self_attn"][n])[0] for n in "qk")
    assert abs(np.corrcoef(q.ravel(), k.ravel())[0, 1]) < 0.05


def test_scan_layers_auto_unrolls_shallow_stacks_on_cpu_and_scans_deep_ones(tiny_cfg, monkeypatch):
    from scalestudy.models.decoder import AUTO_UNROLL_MAX_LAYERS, scanned

    assert jax.default_backend() == "cpu"
    shallow = tiny_cfg("encoder_decoder", scan_layers="auto")
    deep_encoder = shallow.replace(n_encoder_layers=AUTO_UNROLL_MAX_LAYERS + 1)
    assert not scanned(shallow) and scanned(deep_encoder)
    assert scanned(shallow.replace(scan_layers=True))
    assert not scanned(deep_encoder.replace(scan_layers=False))
    # The parameter layout follows the resolved choice.
    assert "layer_0" in build_model(shallow).abstract_params()["decoder"]
    assert "layers" in build_model(deep_encoder).abstract_params()["encoder"]
    # A GPU unrolls deeper stacks (24-layer T5.1.1 XXL stacks too); a TPU always scans.
    from scalestudy.models import decoder

    xxl = shallow.replace(n_layers=24, n_encoder_layers=24)
    for where, expected in (("gpu", False), ("tpu", True), ("cpu", True)):
        monkeypatch.setattr(decoder, "platform", lambda where=where: where)
        assert scanned(xxl) is expected, where
    monkeypatch.setattr(decoder, "platform", lambda: "gpu")
    assert scanned(xxl.replace(n_encoder_layers=decoder.AUTO_UNROLL_MAX_LAYERS_GPU + 1))


def test_t5x_prefix_buckets_make_gpt_and_unilm_differ_only_by_the_mask(tiny_cfg, make_batch_fn):
    """With `rel_prefix_buckets: causal` the non-causal decoder has the causal decoder's
    parameters and position bias (future keys in bucket 0), so the two differ only by the
    attention mask: equal logits without a prefix, different ones with it."""
    nc = build_model(tiny_cfg("noncausal_decoder", rel_prefix_buckets="causal"))
    c = build_model(tiny_cfg("causal_decoder"))
    assert jax.tree.structure(nc.abstract_params()) == jax.tree.structure(c.abstract_params())
    params = jax.jit(c.init)(jax.random.key(5))
    index = jnp.arange(40)
    bias = [m._bind(params).decoder.relpos(index, index) for m in (nc, c)]
    np.testing.assert_array_equal(np.asarray(bias[0]), np.asarray(bias[1]))
    assert float(jnp.abs(bias[0][:, 0, 1:] - bias[0][:, 0, :1]).max()) == 0.0  # future = bucket 0
    plain, prefixed = make_batch_fn(prefix=0), make_batch_fn(prefix=6)
    np.testing.assert_array_equal(np.asarray(nc.apply(params, plain)), c.apply(params, plain))
    diff = np.abs(np.asarray(nc.apply(params, prefixed)) - c.apply(params, prefixed)).max()
    assert diff > 1e-3


def test_an_adaptation_is_compatible_exactly_when_the_parameter_trees_match(tiny_cfg):
    from scalestudy.models.api import is_compatible_adaptation

    archs = ("causal_decoder", "noncausal_decoder", "encoder_decoder")

    def shapes(arch):
        params = build_model(tiny_cfg(arch, position="rope")).abstract_params()
        return jax.tree.map(lambda x: x.shape, params)

    for parent in archs:
        for arch in archs:
            same = shapes(parent) == shapes(arch)
            assert is_compatible_adaptation(tiny_cfg(parent), arch) == same, (parent, arch)


@pytest.mark.parametrize("arch", ["causal_decoder", "encoder_decoder"])
def test_qk_norm_makes_attention_blind_to_the_scale_of_queries_and_keys(
    compiled, tiny_cfg, make_batch_fn, arch
):
    """Normalised queries and keys: scaling a layer's query and key weights (self- and cross-
    attention) leaves the logits unchanged, where plain attention's logits move."""
    batch = make_batch_fn()

    def scaled(params, factor):
        def walk(tree):
            return {
                k: walk(v) if isinstance(v, dict) else v * factor if k in ("q", "k") else v
                for k, v in tree.items()
            }

        return walk(params)

    for qk_norm, moves in ((True, False), (False, True)):
        _model, params, apply = compiled(tiny_cfg(arch, qk_norm=qk_norm))
        base = np.asarray(apply(params, batch))
        other = np.asarray(apply(scaled(params, 7.0), batch))
        assert np.isfinite(other).all()
        assert (np.abs(other - base).max() > 1e-2) == moves, (qk_norm, np.abs(other - base).max())
    # The learnt scales start at one.
    attn = compiled(tiny_cfg(arch, qk_norm=True))[1]["decoder"]["layers"]["self_attn"]
    for name in ("q_scale", "k_scale"):
        np.testing.assert_array_equal(np.asarray(attn[name]), 1.0)
