"""Mixture-of-experts layers: router maths against numpy, dispatch equivalences, dropped
tokens, balancing, and the model contracts (causality, decoding) with MoE layers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scalestudy.models import counting as counting_
from scalestudy.models import moe, moe_dispatch
from scalestudy.models.api import build_model
from scalestudy.models.layers import ParamInit
from scalestudy.train import moe_balance

from .conftest import make_batch, tiny
from .test_decode import _chunked
from .test_models import _effect

E, K = 4, 2


def moe_cfg(arch: str = "causal_decoder", **kw):
    """A tiny model with MoE layers; `kw` go to model.moe, except `scan_layers`, `n_layers`
    and `d_ff`."""
    model = {k: kw.pop(k) for k in ("scan_layers", "n_layers", "d_ff") if k in kw}
    spec = {"enabled": True, "routed_experts": E, "top_k": K, "shared_experts": 1, **kw}
    return tiny(arch, **{"scan_layers": True, **model}, moe=spec)


# The configs of the model-contract tests, shared so that each compiles once.
CAUSAL = moe_cfg()
CAUSAL_CAPACITY = moe_cfg(
    dispatch="capacity", capacity_factor=float(E), scan_layers=False, every=2, router="switch"
)
NONCAUSAL = moe_cfg("noncausal_decoder", scan_layers=False)
ENCDEC = moe_cfg("encoder_decoder", scan_layers=False, encoder_every=1, every=2)


def _layer(seed: int = 0, **kw) -> moe.MoE:
    cfg = moe_cfg(**kw)
    with nnx.use_eager_sharding(False):
        return nnx.jit(lambda: moe.MoE(cfg, ParamInit.from_key(jax.random.key(seed))))()


def _x(rows: int = 3, length: int = 16, seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (rows, length, 32), jnp.float32)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _topk_sets(scores_TE, k):
    return np.sort(np.argsort(-scores_TE, axis=-1, kind="stable")[:, :k], axis=-1)


def _by_expert(expert_TK, gate_TK):
    order = np.argsort(expert_TK, axis=-1)
    return np.take_along_axis(expert_TK, order, -1), np.take_along_axis(gate_TK, order, -1)


def test_deepseek_router_matches_numpy():
    rng = np.random.default_rng(0)
    b, length, e, k, alpha = 3, 10, 6, 2, 0.3
    logits = rng.normal(size=(b, length, e)).astype(np.float32)
    bias = rng.normal(size=e).astype(np.float32)
    out = moe.route_deepseek(jnp.asarray(logits), jnp.asarray(bias), k, alpha)
    s = _sigmoid(logits.astype(np.float64)).reshape(-1, e)
    chosen = _topk_sets(s + bias, k)  # selection on affinity + bias ...
    gates = np.take_along_axis(s, chosen, -1)
    gates /= gates.sum(-1, keepdims=True)  # ... gates from the affinity alone, normalised
    expert, gate = _by_expert(np.asarray(out.expert_TK), np.asarray(out.gate_TK))
    np.testing.assert_array_equal(expert, chosen)
    np.testing.assert_allclose(gate, gates, rtol=1e-5)
    # Sequence-wise balance loss: per sequence f_i = E/(K L) count_i, P_i = mean s'_i.
    per_seq = []
    for row in range(b):
        rows = slice(row * length, (row + 1) * length)
        count = np.bincount(chosen[rows].ravel(), minlength=e)
        f = e / (k * length) * count
        p = (s[rows] / s[rows].sum(-1, keepdims=True)).mean(0)
        per_seq.append((f * p).sum())
    np.testing.assert_allclose(float(out.aux_loss), alpha * np.mean(per_seq), rtol=1e-5)
    q = s / s.sum(-1, keepdims=True)
    np.testing.assert_allclose(float(out.entropy), -(q * np.log(q)).sum(-1).mean(), rtol=1e-5)


@pytest.mark.parametrize("k", [1, 2])
def test_switch_router_matches_numpy(k):
    rng = np.random.default_rng(1)
    b, length, e, lb, zl = 2, 12, 5, 0.01, 0.001
    logits = (2 * rng.normal(size=(b, length, e))).astype(np.float32)
    out = moe.route_switch(jnp.asarray(logits), k, lb, zl)
    x = logits.astype(np.float64).reshape(-1, e)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    chosen = _topk_sets(p, k)
    gates = np.take_along_axis(p, chosen, -1)
    if k > 1:
        gates /= gates.sum(-1, keepdims=True)
    expert, gate = _by_expert(np.asarray(out.expert_TK), np.asarray(out.gate_TK))
    np.testing.assert_array_equal(expert, chosen)
    np.testing.assert_allclose(gate, gates, rtol=1e-5)
    f = np.bincount(chosen.ravel(), minlength=e) / chosen.size
    lse = np.log(np.exp(x).sum(-1))
    want = lb * e * (f * p.mean(0)).sum() + zl * (lse**2).mean()
    np.testing.assert_allclose(float(out.aux_loss), want, rtol=1e-5)


def _output_and_grads(layer: moe.MoE, x: jax.Array):
    graphdef, state = nnx.split(layer)
    w = jax.random.normal(jax.random.key(9), x.shape)

    def f(state, x):
        y, stats = nnx.merge(graphdef, state)(x)
        return jnp.sum(y * w), (y, stats)

    (grads, dx), (y, stats) = jax.jit(jax.grad(f, argnums=(0, 1), has_aux=True))(state, x)
    return y, stats, grads, dx


def test_dropless_equals_capacity_when_nothing_is_dropped(monkeypatch):
    x = _x()
    # Capacity factor E: every expert has a slot for every assignment.
    capacity = _output_and_grads(_layer(dispatch="capacity", capacity_factor=E), x)
    assert float(capacity[1]["dropped"].sum()) == 0
    # The CPU path with every assignment in blocks (0), slots for part of the balanced share
    # and blocks past it (the default, and 1: the busiest expert overflows here), every
    # assignment in slots (E: no block computed); and jax.lax.ragged_dot.
    busiest = int(np.max(capacity[1]["load_E"]))
    assert busiest > moe_dispatch.capacity(x.shape[0] * x.shape[1], K, E, 1.0)
    default = moe.DROPLESS_CAPACITY
    shares = ((False, 0.0), (False, default), (False, 1.0), (False, float(E)), (True, 1.0))
    for ragged, share in shares:
        monkeypatch.setattr(moe, "RAGGED_DOT", ragged)
        monkeypatch.setattr(moe, "DROPLESS_CAPACITY", share)
        dropless = _output_and_grads(_layer(), x)
        np.testing.assert_allclose(dropless[0], capacity[0], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(dropless[3], capacity[3], atol=1e-5, rtol=1e-5)
        flat = lambda g: jax.tree.leaves(nnx.State.to_pure_dict(g))
        for a, c in zip(flat(dropless[2]), flat(capacity[2]), strict=True):
            np.testing.assert_allclose(a, c, atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(dropless[1]["load_E"], capacity[1]["load_E"])


def test_on_a_cpu_the_experts_of_a_bfloat16_model_compute_in_float32(monkeypatch):
    """Only the precision changes: the layer of a bfloat16 model is the float32 model's within
    bfloat16's rounding whichever dtype its experts use, and closer to it with float32
    experts (the CPU's default)."""
    assert jax.default_backend() == "cpu"
    assert moe.expert_dtype(jnp.bfloat16) == jnp.float32
    monkeypatch.setattr(moe, "EXPERT_DTYPE", "bfloat16")
    assert moe.expert_dtype(jnp.float32) == jnp.bfloat16
    cfg = moe_cfg()
    x = _x()

    def output(dtype: str, experts: str | None) -> tuple[np.ndarray, np.ndarray]:
        monkeypatch.setattr(moe, "EXPERT_DTYPE", experts)
        layer_cfg = cfg.replace(dtype=dtype)
        with nnx.use_eager_sharding(False):
            layer = nnx.jit(lambda: moe.MoE(layer_cfg, ParamInit.from_key(jax.random.key(0))))()
        y, stats = nnx.jit(lambda m, x: m(x))(layer, x)
        return np.asarray(y, np.float32), np.asarray(stats["load_E"])

    reference, load = output("float32", None)
    float32_experts, load32 = output("bfloat16", None)
    bfloat16_experts, _ = output("bfloat16", "bfloat16")
    scale = np.abs(reference).max()
    error32 = np.abs(float32_experts - reference).max() / scale
    error16 = np.abs(bfloat16_experts - reference).max() / scale
    assert error16 < 0.05 and error32 < 0.05  # one function, at two precisions
    assert error32 < error16, (error32, error16)
    assert (load32 == load).all()  # the router is float32 in every model


def test_block_matmul_computes_the_filled_blocks_and_their_exact_gradients():
    rows, blocks, filled = 4, 5, 3
    x = jax.random.normal(jax.random.key(1), (rows * blocks, 6))
    w = jax.random.normal(jax.random.key(2), (3, 6, 7))
    expert_N = jnp.array([2, 0, 2, 1, 1], jnp.int32)
    g = jax.random.normal(jax.random.key(3), (rows * blocks, 7))

    def reference(x, w):
        out = [x[n * rows : (n + 1) * rows] @ w[expert_N[n]] for n in range(filled)]
        return jnp.concatenate([*out, jnp.zeros(((blocks - filled) * rows, 7))])

    got = lambda x, w: moe.block_matmul(x, w, expert_N, jnp.int32(filled))
    np.testing.assert_allclose(got(x, w), reference(x, w), rtol=1e-6)
    assert not np.asarray(got(x, w))[filled * rows :].any()
    for a, b in zip(
        jax.grad(lambda x, w: jnp.sum(got(x, w) * g), argnums=(0, 1))(x, w),
        jax.grad(lambda x, w: jnp.sum(reference(x, w) * g), argnums=(0, 1))(x, w),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_capacity_drops_are_counted_and_contribute_nothing():
    x = _x(rows=2, length=8)
    t, factor = 16, 0.5
    c = moe_dispatch.capacity(t, K, E, factor)  # 4 slots per expert, 16 tokens want experts 0 and 1
    layers = {}
    for dispatch in ("capacity", "dropless"):
        layer = _layer(dispatch=dispatch, capacity_factor=factor, shared_experts=0)
        layer.router_bias[...] = jnp.array([20.0, 10.0, 0.0, 0.0])  # first 0, second 1
        layers[dispatch] = layer
    y_cap, stats = layers["capacity"](x)
    y_full, _ = layers["dropless"](x)
    assert float(stats["dropped"]) == 2 * (t - c)
    np.testing.assert_array_equal(stats["load_E"], [t, t, 0, 0])
    # Tokens keep their slots in token order: the first c tokens are computed in full, the
    # rest dropped by both experts (zero output: no shared experts here).
    y_cap, y_full = np.asarray(y_cap).reshape(t, -1), np.asarray(y_full).reshape(t, -1)
    np.testing.assert_allclose(y_cap[:c], y_full[:c], atol=1e-6)
    np.testing.assert_array_equal(y_cap[c:], 0.0)
    assert np.abs(y_full[c:]).min(axis=-1).max() > 0


def test_balancing_bias_moves_a_skewed_load_toward_balance():
    """Tokens that all lean towards expert 0: the update bias += gamma * sign(mean - load)
    (moe.balance's rule) brings the busiest expert's load down to near the mean."""
    layer = _layer(shared_experts=0)
    direction = jax.random.normal(jax.random.key(3), (32,))
    x = direction + 0.5 * _x(rows=4, length=16)
    layer.router[...] = layer.router[...].at[:, 0].set(3.0 * direction / (direction @ direction))
    route = jax.jit(lambda bias: moe._assignment_counts(
        moe.route_deepseek(jnp.einsum("BLD,DE->BLE", x, layer.router[...]), bias, K, 0.0)
        .expert_TK, E).sum(0))  # fmt: skip
    bias, ratios = jnp.zeros(E), []
    for _ in range(60):
        load = route(bias)
        ratios.append(float(load.max() / load.mean()))
        bias = bias + 0.02 * jnp.sign(load.mean() - load)
    assert ratios[0] > 1.9  # expert 0 chosen by (nearly) every token: twice the mean load
    assert max(ratios[-10:]) < 1.3, ratios


def test_model_balance_moves_each_layers_bias_by_its_own_load():
    for scan in (True, False):
        model = build_model(moe_cfg(scan_layers=scan, bias_rate=0.5, every=1))
        params = jax.jit(model.init)(jax.random.key(0))
        load = {"decoder": jnp.array([[5.0, 1.0, 1.0, 1.0], [2.0, 2.0, 3.0, 1.0]])}
        moved = moe_balance.balance(model, params, load)
        stack = moved["decoder"]
        bias = (
            stack["layers"]["mlp"]["router_bias"]
            if scan
            else jnp.stack([stack[f"layer_{i}"]["mlp"]["router_bias"] for i in range(2)])
        )
        np.testing.assert_array_equal(bias, [[-0.5, 0.5, 0.5, 0.5], [0.0, 0.0, -0.5, 0.5]])


# ---------------------------------------------------------------------- model contracts


@pytest.mark.parametrize("cfg", [CAUSAL, CAUSAL_CAPACITY], ids=["dropless", "capacity-no-drops"])
def test_causal_moe_decoder_never_sees_the_future(compiled, cfg):
    _model, params, apply = compiled(cfg)
    batch = make_batch(rows=2, length=12, src=10)
    base = apply(params, batch)
    for t in (3, 9):
        diff = _effect(apply, params, batch, base, "decoder_input_tokens", (0, t))
        assert not diff[:t].any(), f"token {t} changed earlier logits {np.flatnonzero(diff[:t])}"
        assert diff[t:].any()


def test_noncausal_moe_prefix_is_bidirectional_and_blind_to_targets(compiled):
    prefix = 7
    _model, params, apply = compiled(NONCAUSAL)
    batch = make_batch(rows=2, length=12, src=10, prefix=prefix)
    base = apply(params, batch)
    assert _effect(apply, params, batch, base, "decoder_input_tokens", (0, 5)).all()
    t = prefix + 3
    diff = _effect(apply, params, batch, base, "decoder_input_tokens", (0, t))
    assert not diff[:t].any()


def test_encoder_decoder_moe_encoder_never_sees_decoder_tokens(compiled):
    _model, params, apply = compiled(ENCDEC)
    batch = make_batch(rows=2, length=12, src=10)
    base = apply(params, batch)
    t = 5
    diff = _effect(apply, params, batch, base, "decoder_input_tokens", (0, t))
    assert not diff[:t].any() and diff[t:].any()
    last = (0, batch["encoder_input_tokens"].shape[1] - 1)
    assert _effect(apply, params, batch, base, "encoder_input_tokens", last).all()


@pytest.mark.parametrize(
    "cfg",
    [CAUSAL, CAUSAL_CAPACITY, NONCAUSAL, ENCDEC],
    ids=["causal-scanned", "causal-every2-switch-capacity", "noncausal", "encdec"],
)
def test_cached_decoding_equals_the_full_pass(compiled, cfg):
    model, params, apply = compiled(cfg)
    prefix = 7 if cfg.arch == "noncausal_decoder" else 0
    batch = make_batch(rows=2, length=12, src=10, prefix=prefix)
    full = np.asarray(apply(params, batch))
    # Capacity dispatch of 1 token against 12 keeps every assignment as well (no drops).
    chunks = [8, 4] if prefix else [11, 1]
    cached = _chunked(model, params, batch, chunks, encoder=cfg.is_encoder_decoder)
    np.testing.assert_allclose(cached, full, atol=2e-5, rtol=2e-5)


def test_scanned_and_unrolled_moe_stacks_agree(compiled):
    batch = make_batch(rows=2, length=12, src=10)
    unrolled = CAUSAL.replace(scan_layers=False)
    logits = [np.asarray(apply(p, batch)) for _, p, apply in map(compiled, (CAUSAL, unrolled))]
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["causal_decoder", "noncausal_decoder", "encoder_decoder"])
def test_a_short_training_lowers_the_loss(arch):
    """Twenty Adam steps on one batch of a one-layer MoE model, the balancing bias moved after
    each and the sequence-wise balance loss included."""
    import optax

    cfg = moe_cfg(arch, n_layers=1, scan_layers=False, bias_rate=0.01, balance_loss=0.01)
    model = build_model(cfg)
    params = jax.jit(model.init)(jax.random.key(0))
    batch = make_batch(rows=2, length=12, src=10, prefix=6 if arch == "noncausal_decoder" else 0)
    tx = optax.adam(1e-2)

    @jax.jit
    def train(params, opt):
        def one(carry, _):
            params, opt = carry
            (loss, aux), grads = jax.value_and_grad(model.loss, has_aux=True)(
                params, batch, None, deterministic=True
            )
            updates, opt = tx.update(grads, opt, params)
            load = {name: stats["load_E"] for name, stats in aux["moe"].items()}
            params = moe_balance.balance(model, optax.apply_updates(params, updates), load)
            return (params, opt), (loss, aux["moe_aux_loss"])

        return jax.lax.scan(one, (params, opt), None, length=20)[1]

    losses, aux = train(params, tx.init(params))
    assert float(losses[-1]) < 0.7 * float(losses[0]), losses
    assert float(aux[0]) > 0  # the sequence-wise balance loss is part of the loss


# ---------------------------------------------------------------------- counting


def _tree_size(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize(
    "arch,kw",
    [
        ("causal_decoder", dict()),
        ("noncausal_decoder", dict(router="switch", shared_experts=0, every=2, scan_layers=False)),
        ("encoder_decoder", dict(d_expert=24, encoder_every=1, every=2, scan_layers=False)),
    ],
)
def test_counted_moe_params_equal_the_model_and_active_ones_by_hand(arch, kw):
    cfg = moe_cfg(arch, **kw)
    counts = counting_.count_params(cfg)
    assert counts["total"] == _tree_size(build_model(cfg).abstract_params())
    m, d = cfg.moe, cfg.d_model
    expert = 3 * d * m.width(cfg.d_ff)  # gated: wi_0, wi_1, wo
    n_moe = len(m.layers("decoder", cfg.n_layers))
    if cfg.is_encoder_decoder:
        n_moe += len(m.layers("encoder", cfg.encoder_layers))
    idle = n_moe * (m.routed_experts - m.top_k) * expert  # the routed experts a token skips
    assert counts["total"] - counts["active"] == idle
    assert counts["non_embedding"] - counts["active_non_embedding"] == idle


def test_granularity_makes_experts_d_ff_over_g_wide_at_every_width():
    """`granularity: G` is `d_expert: d_ff / G` for each d_ff (a ladder's sizes), parameter
    for parameter."""
    for d_ff in (64, 128):
        by_g = moe_cfg("causal_decoder", granularity=4, d_ff=d_ff)
        by_width = moe_cfg("causal_decoder", d_expert=d_ff // 4, d_ff=d_ff)
        shapes = [jax.tree.map(lambda x: x.shape, build_model(c).abstract_params())
                  for c in (by_g, by_width)]  # fmt: skip
        assert shapes[0] == shapes[1] and by_g.moe.width(d_ff) == d_ff // 4
        assert counting_.count_params(by_g) == counting_.count_params(by_width)
    # Unset, it is not in a config's dump: the run ids of earlier MoE runs stay as they were.
    from scalestudy.config.experiment import to_yaml

    assert "granularity" not in to_yaml(moe_cfg()) and "granularity: 4" in to_yaml(by_g)


@pytest.mark.optimized
@pytest.mark.parametrize("arch", ["causal_decoder", "encoder_decoder"])
def test_moe_forward_flops_match_xla_cost_analysis(arch):
    """Capacity dispatch at capacity factor 1 with tokens * top_k a multiple of the experts
    computes exactly the counted expert rows; XLA's count also holds the elementwise work
    left out (norms, softmax, activations, routing): within 3%."""
    cfg = tiny(
        arch, vocab_size=512, d_model=128, n_heads=4, d_ff=512, n_layers=2, scan_layers=False,
        moe={"enabled": True, "routed_experts": 4, "top_k": 2, "shared_experts": 1,
             "d_expert": 256, "dispatch": "capacity", "capacity_factor": 1.0, "every": 2,
             "encoder_every": 1 if arch == "encoder_decoder" else None},
    )  # fmt: skip
    rows, length, src = 2, 64, 48
    model = build_model(cfg)
    batch = make_batch(rows=rows, length=length, src=src)
    compiled = jax.jit(model.apply).lower(model.abstract_params(), batch).compile()
    xla = compiled.cost_analysis()["flops"]
    counted = rows * counting_.forward_flops(cfg, length, src if cfg.is_encoder_decoder else 0)
    assert counted <= xla <= 1.03 * counted, (xla, counted)
    dense = rows * counting_.forward_flops(cfg.replace(moe={}), length, src)
    assert counted != dense  # the MoE layers are counted as such


# ---------------------------------------------------------------------- expert parallelism


def _mesh(**shape):
    from scalestudy.config.experiment import MeshConfig
    from scalestudy.train import sharding

    return sharding.make_mesh(MeshConfig(**shape), model=moe_cfg())


@pytest.mark.parametrize(
    "dispatch,shape",
    [
        ("capacity", dict(data=2, expert=4)),
        ("capacity", dict(data=1, fsdp=2, expert=2, tensor=2)),
        ("dropless", dict(data=1, fsdp=2, expert=2, tensor=2)),
    ],
)
def test_expert_sharded_loss_and_gradients_equal_one_device(dispatch, shape):
    from scalestudy.train import sharding

    # Capacity factor E: nothing is dropped, on one device or per device.
    cfg = moe_cfg(dispatch=dispatch, capacity_factor=float(E), router="switch")
    model = build_model(cfg)
    params = jax.jit(model.init)(jax.random.key(0))
    batch = make_batch(rows=8, length=12)

    def loss_and_grads(params, batch):
        grads, aux = jax.grad(model.loss, has_aux=True)(params, batch, None, deterministic=True)
        return aux["ce"], aux["moe_aux_loss"], grads

    with jax.default_device(jax.devices()[0]):
        want = jax.jit(loss_and_grads)(params, batch)
    mesh = _mesh(**shape)
    param_sh = sharding.param_shardings(mesh, model.param_axes())
    assert param_sh["decoder"]["layers"]["mlp"]["wi_0"].spec[1] == "expert"
    with sharding.axis_rules(mesh):
        step = jax.jit(loss_and_grads, in_shardings=(param_sh, sharding.batch_sharding(mesh)))
        args = jax.device_put(params, param_sh), sharding.shard_batch(mesh, batch)
        # Capacity dispatch exchanges tokens by an explicit all-to-all (forward and backward).
        assert (step.lower(*args).as_text().count("all_to_all") >= 4) == (dispatch == "capacity")
        got = step(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("shape", [dict(data=2, expert=4), dict(fsdp=2, expert=2, tensor=2)])
def test_expert_parallel_capacity_counts_slots_per_device(shape):
    """With drops, the all-to-all dispatch computes what one device computes for each
    device's rows alone (capacity per device's tokens, GShard's groups), and differs from
    capacity over the whole batch."""
    from scalestudy.train import sharding

    layer = _layer(dispatch="capacity", capacity_factor=0.5, router="switch", shared_experts=0)
    x = _x(rows=8, length=6)
    mesh = _mesh(**shape)
    graphdef, state = nnx.split(layer)
    groups = math.prod(size for axis, size in mesh.shape.items() if axis != "tensor")

    def run(state, x):
        y, stats = nnx.merge(graphdef, state)(x)
        return y, stats["dropped"]

    with jax.default_device(jax.devices()[0]):
        whole, whole_dropped = jax.jit(run)(state, x)
        per_group = [jax.jit(run)(state, part) for part in jnp.split(x, groups)]
    want = jnp.concatenate([y for y, _ in per_group])
    with sharding.axis_rules(mesh):
        x_sh = jax.device_put(x, sharding.batch_sharding(mesh))
        got, dropped = jax.jit(run)(state, x_sh)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert float(dropped) == sum(float(d) for _, d in per_group) > 0
    assert np.abs(np.asarray(got) - np.asarray(whole)).max() > 1e-3  # the groups matter here
    assert float(whole_dropped) > 0


def test_describe_shows_total_and_active_parameters(repo, capsys):
    import json

    from scalestudy.cli import main as cli

    tiny_yaml = str(repo / "configs/models/tiny.yaml")
    moe_args = ["model.moe.enabled=true", "model.moe.routed_experts=4", "model.moe.top_k=1"]
    assert cli.main(["describe", "--config", tiny_yaml, "--json", *moe_args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params_active"] < out["params_total"]
    assert out["flops_per_token_6n"] == 6 * out["params_active_non_embedding"]
    assert cli.main(["describe", "--config", tiny_yaml, "--json"]) == 0
    assert "params_active" not in json.loads(capsys.readouterr().out)  # dense: as before
