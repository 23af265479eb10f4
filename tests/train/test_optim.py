"""Schedules against hand-computed values; optimizers make progress on a quadratic."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import OptimConfig
from scalestudy.train.optim import make_optimizer, make_schedule


def lrs(cfg: OptimConfig, total: int, steps: list[int]) -> list[float]:
    schedule = make_schedule(cfg, total)
    return [float(schedule(s)) for s in steps]


def test_constant_with_linear_warmup():
    cfg = OptimConfig(schedule="constant", learning_rate=0.1, warmup_steps=4)
    np.testing.assert_allclose(
        lrs(cfg, 100, [0, 1, 3, 4, 99]), [0.025, 0.05, 0.1, 0.1, 0.1], rtol=1e-6
    )


def test_rsqrt_is_wang_et_al():
    # lr 0.01 until step 10k, then 1/sqrt(step).
    cfg = OptimConfig(schedule="rsqrt", learning_rate=0.01, warmup_steps=10_000)
    got = lrs(cfg, 200_000, [0, 5_000, 10_000, 40_000, 160_000])
    np.testing.assert_allclose(got, [0.01, 0.01, 0.01, 0.005, 0.0025], rtol=1e-6)


def test_linear_decay():
    cfg = OptimConfig(schedule="linear", learning_rate=1.0, warmup_steps=10, final_lr_fraction=0.1)
    # warmup (s+1)/10; decay over [10, 110]: 1 - 0.9 * (s - 10) / 100
    got = lrs(cfg, 110, [0, 9, 10, 60, 110, 500])
    np.testing.assert_allclose(got, [0.1, 1.0, 1.0, 0.55, 0.1, 0.1], rtol=1e-6)


def test_cosine_decay():
    cfg = OptimConfig(schedule="cosine", learning_rate=2.0, warmup_steps=0, final_lr_fraction=0.0)
    got = lrs(cfg, 100, [0, 25, 50, 100])
    want = [2.0, 2.0 * 0.5 * (1 + math.cos(math.pi / 4)), 1.0, 0.0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "shape,mid",  # value at half the cooldown, final fraction 0
    [("linear", 0.5), ("sqrt", 1 - math.sqrt(0.5)), ("cosine", 0.5)],
)
def test_wsd_shapes(shape, mid):
    cfg = OptimConfig(
        schedule="wsd",
        learning_rate=1.0,
        warmup_steps=10,
        cooldown_fraction=0.2,
        cooldown_shape=shape,
        final_lr_fraction=0.0,
    )
    # 100 steps: warmup 0..9, stable to 79, cooldown over [80, 100].
    got = lrs(cfg, 100, [4, 50, 79, 80, 90, 100])
    np.testing.assert_allclose(got, [0.5, 1.0, 1.0, 1.0, mid, 0.0], rtol=1e-6, atol=1e-7)


def test_wsd_cooldown_steps_overrides_fraction_and_shares_the_stable_phase():
    base = OptimConfig(schedule="wsd", learning_rate=1.0, warmup_steps=5, cooldown_steps=20)
    long, short = make_schedule(base, 1000), make_schedule(base, 200)
    # A branch that cools down at 200 follows the long run exactly until its cooldown.
    for s in [0, 3, 50, 179]:
        assert float(long(s)) == float(short(s))
    assert float(short(190)) < 1.0 and float(long(190)) == 1.0


def test_bad_warmup_is_a_config_error():
    with pytest.raises(ConfigError, match="warmup_steps"):
        make_schedule(OptimConfig(schedule="cosine", warmup_steps=100), 50)


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_optimizers_minimise_a_quadratic(name):
    cfg = OptimConfig(name=name, schedule="constant", learning_rate=0.05, grad_clip_norm=1.0)
    tx, _ = make_optimizer(cfg, 100)
    target = jnp.arange(12.0).reshape(3, 4) / 10
    # Nonzero start: Adafactor scales updates by each parameter's RMS.
    params = {"w": jnp.full((3, 4), 0.5), "b": jnp.ones((4,))}
    loss = lambda p: jnp.sum((p["w"] - target) ** 2) + jnp.sum(p["b"] ** 2)
    state = tx.init(params)
    start = loss(params)
    for _ in range(100):
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        params = jax.tree.map(jnp.add, params, updates)
    assert loss(params) < 0.05 * start


def test_weight_decay_mask_spares_vectors():
    cfg = OptimConfig(name="adamw", schedule="constant", learning_rate=0.1, weight_decay=0.5)
    params = {"w": jnp.ones((2, 2)), "b": jnp.ones((2,))}
    tx, _ = make_optimizer(cfg, 10, decay_mask={"w": True, "b": False})
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zero, tx.init(params), params)
    np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * np.ones((2, 2)), rtol=1e-6)
    np.testing.assert_allclose(updates["b"], 0.0)


def _run(tx, params, grads_seq):
    state = tx.init(params)
    out = []
    for grads in grads_seq:
        updates, state = tx.update(grads, state, params)
        params = jax.tree.map(jnp.add, params, updates)
        out.append(params)
    return out


def test_adafactor_treats_stacked_layers_as_separate_tensors():
    # A scanned model stores two layers' [8, 6] matrices as one [2, 8, 6] array, with layer 0
    # ten times larger. Adafactor on the stack must equal Adafactor on each layer alone (the
    # unscanned T5X model), and must differ from treating the stack as one tensor.
    cfg = OptimConfig(name="adafactor", schedule="constant", learning_rate=0.01, weight_decay=0.1)
    rng = np.random.default_rng(0)
    stack = jnp.asarray(rng.normal(size=(2, 8, 6)) * np.array([10.0, 1.0])[:, None, None])
    grads = [jnp.asarray(rng.normal(size=(2, 8, 6))) for _ in range(3)]
    stacked_tx, _ = make_optimizer(cfg, 10, decay_mask={"w": True}, stacked={"w": True})
    got = _run(stacked_tx, {"w": stack}, [{"w": g} for g in grads])[-1]["w"]
    per_layer_tx, _ = make_optimizer(cfg, 10, decay_mask={"a": True, "b": True})
    want = _run(
        per_layer_tx, {"a": stack[0], "b": stack[1]}, [{"a": g[0], "b": g[1]} for g in grads]
    )[-1]
    np.testing.assert_allclose(got, np.stack([want["a"], want["b"]]), rtol=1e-6, atol=1e-7)
    pooled_tx, _ = make_optimizer(cfg, 10, decay_mask={"w": True}, stacked={"w": False})
    pooled = _run(pooled_tx, {"w": stack}, [{"w": g} for g in grads])[-1]["w"]
    assert not np.allclose(pooled, got, rtol=1e-3)


def _state_bytes(state) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def test_adafactor_factors_attention_kernels_as_t5x_2d_matrices():
    # T5X stores attention kernels as [embed, heads*kv] and [heads*kv, embed] and factors
    # them; ours are [D, H, K] and [H, K, D]. With D = H*K = 128 (>= optax's and T5X's
    # min_dim_size_to_factor) Adafactor must give the updates, and keep the state, of the
    # reshaped 2-D kernels, not the full second moments of K = 32 < 128.
    cfg = OptimConfig(name="adafactor", schedule="constant", learning_rate=0.01, weight_decay=0.1)
    rng = np.random.default_rng(1)
    D, H, K = 128, 4, 32
    q = jnp.asarray(rng.normal(size=(D, H, K)))
    o = jnp.asarray(rng.normal(size=(H, K, D)) * 0.5)
    grads = [
        {"q": jnp.asarray(rng.normal(size=(D, H, K))), "o": jnp.asarray(rng.normal(size=(H, K, D)))}
        for _ in range(3)
    ]
    axes = {"q": ("embed", "heads", "kv"), "o": ("heads", "kv", "embed")}
    tx, _ = make_optimizer(cfg, 10, decay_mask={"q": True, "o": True}, axes=axes)
    got = _run(tx, {"q": q, "o": o}, grads)[-1]
    ref_tx, _ = make_optimizer(cfg, 10, decay_mask={"q": True, "o": True})
    want = _run(
        ref_tx,
        {"q": q.reshape(D, H * K), "o": o.reshape(H * K, D)},
        [{"q": g["q"].reshape(D, H * K), "o": g["o"].reshape(H * K, D)} for g in grads],
    )[-1]
    np.testing.assert_allclose(got["q"], want["q"].reshape(D, H, K), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got["o"], want["o"].reshape(H, K, D), rtol=1e-6, atol=1e-7)
    state = tx.init({"q": q, "o": o})
    ref_state = ref_tx.init({"q": q.reshape(D, H * K), "o": o.reshape(H * K, D)})
    assert _state_bytes(state) == _state_bytes(ref_state) < q.size * 4  # factored: D + H*K
    # Treating [D, H, K] as is (factoring D x H, K kept) gives different updates.
    naive_tx, _ = make_optimizer(cfg, 10, decay_mask={"q": True, "o": True})
    naive = _run(naive_tx, {"q": q, "o": o}, grads)[-1]
    assert not np.allclose(naive["q"], got["q"], rtol=1e-3)


def test_adafactor_t5x_matrices_per_layer_when_stacked():
    # Scanned [layers, D, H, K] kernels: each layer's slice is factored as the 2-D [D, H*K].
    cfg = OptimConfig(name="adafactor", schedule="constant", learning_rate=0.01)
    rng = np.random.default_rng(2)
    L, D, H, K = 2, 128, 2, 64
    stack = jnp.asarray(rng.normal(size=(L, D, H, K)) * np.array([3.0, 1.0])[:, None, None, None])
    grads = [jnp.asarray(rng.normal(size=(L, D, H, K))) for _ in range(3)]
    tx, _ = make_optimizer(cfg, 10, axes={"w": ("layers", "embed", "heads", "kv")})
    got = _run(tx, {"w": stack}, [{"w": g} for g in grads])[-1]["w"]
    ref_tx, _ = make_optimizer(cfg, 10, decay_mask={"a": True, "b": True})
    two_d = lambda x: x.reshape(D, H * K)
    want = _run(
        ref_tx,
        {"a": two_d(stack[0]), "b": two_d(stack[1])},
        [{"a": two_d(g[0]), "b": two_d(g[1])} for g in grads],
    )[-1]
    np.testing.assert_allclose(
        got, np.stack([want["a"], want["b"]]).reshape(L, D, H, K), rtol=1e-6, atol=1e-7
    )


def test_adafactor_state_of_a_model_is_t5x_sized():
    # The optimizer state of a whole model (abstractly evaluated) equals T5X's: every
    # [D, H*K] attention kernel and every >= 128 x 128 matrix factored, per layer.
    from scalestudy.config.experiment import ModelConfig
    from scalestudy.models.api import build_model
    from scalestudy.train.step import decay_mask, stacked_mask

    m = ModelConfig(
        arch="causal_decoder",
        vocab_size=256,
        d_model=128,
        d_ff=256,
        n_heads=4,
        d_kv=32,
        n_layers=2,
        scan_layers=True,
    )
    model = build_model(m)
    axes = model.param_axes()
    cfg = OptimConfig(name="adafactor", schedule="constant", grad_clip_norm=None)
    tx, _ = make_optimizer(
        cfg, 10, decay_mask=decay_mask(axes), stacked=stacked_mask(axes), axes=axes
    )
    state = jax.eval_shape(tx.init, model.abstract_params())
    big = [x for x in jax.tree.leaves(state) if x.size >= 128 * 128]
    assert big == []  # nothing stores a full second moment of a matrix
