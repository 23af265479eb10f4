"""Attention backends against the reference einsum path, the shared relative bias, remat."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalestudy.config.experiment import MeshConfig, ModelConfig
from scalestudy.models import attention, masks
from scalestudy.models.api import build_model
from scalestudy.models.layers import relative_bucket
from scalestudy.train import sharding
from scalestudy.train.plan import aot

ATOL = 2e-5
VOCAB = 64


def tiny(arch: str = "causal_decoder", **kw) -> ModelConfig:
    """As tests/models/conftest.py's `tiny` (float32, so comparisons can be tight)."""
    base = dict(
        arch=arch, vocab_size=VOCAB, d_model=32, n_heads=4, d_ff=64, n_layers=2, dtype="float32"
    )
    return ModelConfig(**{**base, **kw})


def _segments(length: int, cut: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Row 0: two packed segments then `pad` padding; row 1: one full segment."""
    seg = np.ones((2, length), np.int32)
    seg[0, cut:] = 2
    if pad:
        seg[0, length - pad :] = 0
    pos = np.tile(np.arange(length, dtype=np.int32), (2, 1))
    pos[0, cut:] -= cut
    return seg, np.where(seg > 0, pos, 0)


def packed_batch(length: int = 16, src: int = 12, prefix: int = 3, seed: int = 0) -> dict:
    """Two rows, packed with padding (row 0) and whole (row 1), for every architecture; the
    first `prefix` positions of each decoder segment are the non-causal prefix."""
    rng = np.random.default_rng(seed)
    seg, pos = _segments(length, length // 2 - 1, 3)
    enc_seg, enc_pos = _segments(src, src // 2, 2)
    targets = rng.integers(1, VOCAB, seg.shape).astype(np.int32) * (seg > 0)
    inputs = np.where(pos == 0, 0, np.roll(targets, 1, axis=1))
    sources = rng.integers(1, VOCAB, enc_seg.shape).astype(np.int32) * (enc_seg > 0)
    return {
        "decoder_input_tokens": inputs,
        "decoder_target_tokens": targets,
        "decoder_loss_weights": (seg > 0).astype(np.int32),
        "decoder_segment_ids": seg,
        "decoder_positions": pos,
        "decoder_causal_attention": ((pos < prefix) & (seg > 0)).astype(np.int32),
        "encoder_input_tokens": sources,
        "encoder_segment_ids": enc_seg,
        "encoder_positions": enc_pos,
    }


def _run(cfg, params, batch):
    """Logits and loss gradients in one program, traced now (so `attention.emulate` applies)."""
    model = build_model(cfg)

    def loss(p):
        logits = model.apply(p, batch)
        return model.loss(p, batch, None, deterministic=True)[0], logits

    grads, logits = jax.jit(jax.grad(loss, has_aux=True))(params)
    return np.asarray(logits), grads


@functools.cache
def _reference(cfg, length: int, src: int):
    """Parameters, logits and gradients of the reference path (cached across tests)."""
    params = jax.jit(build_model(cfg).init)(jax.random.key(0))
    return (params, *_run(cfg, params, packed_batch(length, src)))


def _assert_same(cfg, impl: str, length: int = 16, src: int = 12) -> None:
    batch = packed_batch(length, src)
    params, logits, grads = _reference(cfg.replace(attention_impl="xla"), length, src)
    with attention.emulate():
        got_logits, got_grads = _run(cfg.replace(attention_impl=impl), params, batch)
    real = batch["decoder_segment_ids"] > 0  # splash differs on padding queries only
    np.testing.assert_allclose(got_logits[real], logits[real], atol=ATOL)
    assert jax.tree.structure(grads) == jax.tree.structure(got_grads)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        got = got_grads
        for key in path:
            got = got[key.key]
        np.testing.assert_allclose(np.asarray(got), np.asarray(g), atol=ATOL, err_msg=str(path))


# ---------------------------------------------------------------- backends, whole models


@pytest.mark.parametrize(
    "arch, attn",
    [
        ("causal_decoder", "standard"),
        ("noncausal_decoder", "standard"),
        ("noncausal_decoder", "mixed"),
        ("encoder_decoder", "standard"),
        ("encoder_decoder", "mixed_layers"),
    ],
)
def test_cudnn_call_equals_reference(arch, attn):
    """jax.nn.dot_product_attention with our masks and shared bias (its XLA implementation
    here; cuDNN on a GPU): packed segments, padding, the prefix, mixed heads, mixed layers
    (forward layers causal, backward ones dense), T5 relative bias; logits at real positions
    and every parameter gradient."""
    _assert_same(tiny(arch, attention=attn), "cudnn")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["causal_decoder", "encoder_decoder"])
def test_splash_kernel_equals_reference(arch):
    """The splash kernel (Pallas interpret mode here) at its smallest block, 128."""
    _assert_same(tiny(arch, position="rope"), "splash", 128, 128)


def test_sharded_splash_equals_reference():
    """Under a mesh the kernel runs per shard (batch over data x fsdp, heads over tensor)."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(4, 128, 4, 8)), jnp.float32) for _ in range(3))
    seg = np.ones((4, 128), np.int32)
    seg[:, 70:] = 2
    spec = masks.MaskSpec(jnp.asarray(seg), jnp.asarray(seg), causal=True)
    expected = attention.reference(q, k, v, spec)
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    with sharding.axis_rules(mesh), attention.emulate():
        got = jax.jit(lambda *a: attention.attend(*a, spec, impl="splash"))(q, k, v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=ATOL)


@pytest.mark.optimized
def test_splash_compiles_for_a_tpu_topology():
    """Ahead-of-time compile of a training gradient with splash for TPU v5e (2x4) from this
    CPU host: the kernel is really in the program (libtpu only, no TPU needed)."""
    topologies = pytest.importorskip("jax.experimental.topologies")
    pytest.importorskip("libtpu", reason="libtpu is not installed (needed to compile for TPU)")
    try:
        devices = list(topologies.get_topology_desc("v5e:2x4", "tpu").devices)
    except Exception as err:  # libtpu set-up errors vary: lockfile, versions
        pytest.skip(f"no TPU topology from libtpu here: {err}")
    cfg = tiny("causal_decoder", position="rope", d_model=128, n_heads=4, d_ff=256)
    cfg = cfg.replace(dtype="bfloat16", attention_impl="auto")  # auto picks splash on TPU
    model = build_model(cfg)
    mesh = sharding.make_mesh(MeshConfig(data=4, fsdp=2), devices, model=cfg)
    with sharding.axis_rules(mesh):
        params = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            model.abstract_params(),
            sharding.param_shardings(mesh, model.param_axes()),
        )
        rows = jax.ShapeDtypeStruct((8, 256), jnp.int32, sharding=sharding.batch_sharding(mesh))
        names = ("input_tokens", "target_tokens", "loss_weights", "segment_ids", "positions")
        batch = {f"decoder_{n}": rows for n in names}
        grad = jax.jit(jax.grad(lambda p, b: model.loss(p, b, None, deterministic=True)[0]))
        with aot._outside_the_cache(True):  # a slice's program cannot be read back from it
            text = grad.lower(params, batch).compile().as_text()
    assert text.count("tpu_custom_call") >= 3  # forward, and the dq and dkv kernels


# ---------------------------------------------------------------- backends, the core


@pytest.mark.optimized
def test_core_mask_forms_agree():
    """`attend` takes a MaskSpec or its dense array; with a [H, L, S] bias; mixed heads."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 16, 4, 8)), jnp.float32) for _ in range(3))
    bias = jnp.asarray(rng.normal(size=(4, 16, 16)), jnp.float32)
    seg, _ = _segments(16, 7, 3)
    prefix = jnp.asarray((np.arange(16) < 5)[None].repeat(2, 0).astype(np.int32))
    spec = masks.decoder_self_spec(jnp.asarray(seg), prefix, 4, mixed=True)
    dense = spec.dense()
    assert dense.shape == (2, 4, 16, 16)
    expected = attention.reference(q, k, v, dense, bias)
    with attention.emulate():
        for mask in (spec, dense):
            got = attention.attend(q, k, v, mask, bias, impl="cudnn")
            np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=ATOL)
    np.testing.assert_array_equal(attention.attend(q, k, v, spec, bias, impl="xla"), expected)


@pytest.mark.parametrize("arch", ["causal_decoder", "encoder_decoder"])
def test_causal_blocks_equal_the_full_product(arch):
    """The reference's causal path in query blocks (4 rows here, so 4 blocks of 16) against
    one full product: logits at real positions and every gradient (packed segments, padding,
    the relative bias sliced per block)."""
    cfg, length, src = tiny(arch, attention_impl="xla"), 16, 12
    params, logits, grads = _reference(cfg, length, src)
    batch = packed_batch(length, src)
    with attention.causal_block(4):
        got_logits, got_grads = _run(cfg, params, batch)
    real = batch["decoder_segment_ids"] > 0  # a padding query sees fewer keys per block
    np.testing.assert_allclose(got_logits[real], logits[real], atol=ATOL)
    for g, got in zip(jax.tree.leaves(grads), jax.tree.leaves(got_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(g), atol=ATOL)


def test_causal_blocks_apply_only_to_plain_causal_self_attention():
    q = jnp.zeros((2, 16, 4, 8))
    seg = jnp.asarray(_segments(16, 7, 3)[0])
    prefix = jnp.asarray((np.arange(16) < 5)[None].repeat(2, 0).astype(np.int32))
    causal, plm = masks.decoder_self_spec(seg), masks.decoder_self_spec(seg, prefix)
    with attention.causal_block(4):
        assert attention.blocks(q, q, causal) == 4
        assert attention.blocks(q, q, plm) == 0  # the prefix reaches above the diagonal
        assert attention.blocks(q, q, causal.dense()) == 0  # no structure to read
        assert attention.blocks(q, q[:, :12], causal) == 0  # cached keys: not square
    with attention.causal_block(32):
        assert attention.blocks(q, q, causal) == 0  # fewer than two blocks


def test_a_cpu_splits_causal_attention_into_blocks_of_32_query_rows():
    """The platform's block: 32 rows on a CPU (a 128-position row in 4 blocks, equal to the
    full product), 256 elsewhere; `causal_block` overrides it."""
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 128, 4, 8)), jnp.float32) for _ in range(3))
    causal = masks.decoder_self_spec(jnp.asarray(_segments(128, 70, 9)[0]))
    assert jax.default_backend() == "cpu" and attention.causal_block_rows() == 32
    assert attention.blocks(q, q, causal) == 4
    blocked = attention.attend(q, k, v, causal, impl="xla")
    with attention.causal_block(0):
        assert attention.blocks(q, q, causal) == 0
        full = attention.attend(q, k, v, causal, impl="xla")
    real = np.asarray(causal.q_segment_BQ) > 0
    np.testing.assert_allclose(np.asarray(blocked)[real], np.asarray(full)[real], atol=1e-6)
    assert attention.CAUSAL_BLOCK_ROWS.get("tpu", attention.DEFAULT_CAUSAL_BLOCK_ROWS) == 256


def test_compute_dtype_logits_round_only_the_logits():
    """logits="compute": the same in float32; in bfloat16 the logits are rounded before the
    float32 softmax, so the result moves, by no more than bfloat16's rounding."""
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 16, 4, 8)), jnp.float32) for _ in range(3))
    spec = masks.decoder_self_spec(jnp.asarray(_segments(16, 7, 3)[0]))
    wide = attention.reference(q, k, v, spec, logits="float32")
    np.testing.assert_array_equal(attention.reference(q, k, v, spec, logits="compute"), wide)
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    f32 = attention.reference(qb, kb, vb, spec, logits="float32").astype(jnp.float32)
    rounded = attention.reference(qb, kb, vb, spec, logits="compute").astype(jnp.float32)
    assert not np.array_equal(np.asarray(rounded), np.asarray(f32))
    np.testing.assert_allclose(np.asarray(rounded), np.asarray(f32), atol=0.1)


def test_mixed_layer_specs_equal_their_dense_masks():
    """A forward layer is a plain causal spec (so fused kernels take it as causal); a backward
    layer's spec stands for key >= query inside the bidirectional region."""
    seg, _ = _segments(12, 5, 2)
    seg = jnp.asarray(seg)
    prefix = jnp.asarray((np.arange(12) < 4)[None].repeat(2, 0).astype(np.int32))
    same = np.asarray(masks.segments(seg, seg))
    lower = np.tril(np.ones((12, 12), bool))
    both = (np.asarray(prefix)[:, None, :, None] & np.asarray(prefix)[:, None, None, :]) > 0
    forward, backward = masks.per_layer(
        lambda d: masks.decoder_self_spec(seg, prefix, 4, False, d), "mixed_layers"
    )
    assert forward.causal and not forward.bidirectional and backward.bidirectional
    np.testing.assert_array_equal(forward.dense(), lower & same)
    np.testing.assert_array_equal(backward.dense(), np.where(both, lower.T, lower) & same)
    forward, backward = masks.per_layer(
        lambda d: masks.encoder_self_spec(seg, 4, False, d), "mixed_layers"
    )
    np.testing.assert_array_equal(forward.dense(), lower & same)
    np.testing.assert_array_equal(backward.dense(), lower.T & same)


def test_auto_picks_the_platform_kernel_or_falls_back(monkeypatch):
    bf16 = jnp.zeros((2, 128, 4, 64), jnp.bfloat16)
    seg = jnp.ones((2, 128), jnp.int32)
    causal = masks.decoder_self_spec(seg)
    prefix = masks.decoder_self_spec(seg, seg)
    bias = jnp.zeros((4, 128, 128))
    assert attention.choose("auto", bf16, bf16, causal, bias) == "xla"  # CPU
    monkeypatch.setattr(attention, "platform", lambda: "gpu")
    assert attention.choose("auto", bf16, bf16, prefix, bias) == "cudnn"
    assert attention.choose("auto", bf16.astype(jnp.float32), bf16, causal) == "xla"
    monkeypatch.setattr(attention, "platform", lambda: "tpu")
    assert attention.choose("auto", bf16, bf16, causal) == "splash"
    assert attention.choose("auto", bf16, bf16, causal, bias) == "xla"  # relative bias
    assert attention.choose("auto", bf16, bf16, prefix) == "xla"  # per-row prefix
    short = bf16[:, :96]
    assert attention.choose("auto", short, short, masks.decoder_self_spec(seg[:, :96])) == "xla"


def test_bad_backend_combinations_are_clear_errors():
    x = jnp.zeros((1, 16, 2, 8))
    spec = masks.encoder_self_spec(jnp.ones((1, 16), jnp.int32))
    with pytest.raises(attention.AttentionError, match=r"'cudnn'.*needs a GPU.*platform is cpu"):
        attention.attend(x, x, x, spec, impl="cudnn")
    with pytest.raises(attention.AttentionError, match=r"'splash'.*needs a TPU"):
        attention.attend(x, x, x, spec, impl="splash")
    with attention.emulate(), pytest.raises(attention.AttentionError, match="multiples of 128"):
        attention.attend(x, x, x, spec, impl="splash")
    with pytest.raises(attention.AttentionError, match="accepted: auto, xla, cudnn, splash"):
        attention.attend(x, x, x, spec, impl="flash")
    long = jnp.zeros((1, 128, 2, 8))
    backward = masks.encoder_self_spec(jnp.ones((1, 128), jnp.int32), layer_direction="backward")
    with attention.emulate(), pytest.raises(attention.AttentionError, match="no backward mask"):
        attention.attend(long, long, long, backward, impl="splash")
    for kw, words in (
        ({"attention_impl": "splash"}, "relative_bias"),
        ({"attention_impl": "splash", "position": "rope", "arch": "noncausal_decoder"}, "prefix"),
        ({"attention_impl": "splash", "position": "none", "attention": "mixed"}, "mixed"),
        ({"attention_impl": "cudnn", "dropout": 0.1}, "dropout"),
        (
            {
                "attention_impl": "splash",
                "position": "none",
                "arch": "encoder_decoder",
                "attention": "mixed_layers",
            },
            "mixed_layers",
        ),
    ):
        with pytest.raises(ValueError, match=rf"attention_impl='\w+' cannot run with.*{words}"):
            tiny(**kw)


# ---------------------------------------------------------------- relative bias


@pytest.mark.parametrize("arch", ["causal_decoder", "noncausal_decoder", "encoder_decoder"])
def test_shared_bias_equals_per_row_bias_on_packed_batches(arch):
    """The [H, L, S] bias from indices equals the per-row [B, H, L, S] bias from positions
    (as computed before) wherever the mask lets a query see a key."""
    cfg = tiny(arch)
    model = build_model(cfg)
    params = jax.jit(model.init)(jax.random.key(0))
    module = model._bind(params)
    batch = packed_batch(length=40, src=40, prefix=5)
    stacks = [("decoder", "decoder")] + ([("encoder", "encoder")] if cfg.is_encoder_decoder else [])
    for stack, feature in stacks:
        relpos = getattr(module, stack).relpos
        pos = jnp.asarray(batch[f"{feature}_positions"])
        seg = jnp.asarray(batch[f"{feature}_segment_ids"])
        rel_BLS = pos[:, None, :] - pos[:, :, None]
        kw = {"n_buckets": cfg.rel_buckets, "max_distance": cfg.rel_max_distance}
        if relpos.mode == "bidirectional":
            bucket = relative_bucket(rel_BLS, bidirectional=True, **kw)
        else:
            bucket = relative_bucket(rel_BLS, bidirectional=False, **kw)
            if relpos.mode == "prefix":
                future = cfg.rel_buckets + relative_bucket(-rel_BLS, bidirectional=False, **kw)
                bucket = jnp.where(rel_BLS > 0, future, bucket)
        per_row_BHLS = jnp.take(relpos.table[...], bucket, axis=0).transpose(0, 3, 1, 2)
        index = jnp.arange(pos.shape[1])
        shared_HLS = relpos(index, index)
        visible = np.broadcast_to(np.asarray(masks.segments(seg, seg)), per_row_BHLS.shape)
        diff = np.abs(np.asarray(per_row_BHLS - shared_HLS[None]))
        assert diff[visible].max() == 0.0
        assert diff[~visible].max() > 0  # the rows really differ where masked


def test_relative_bias_models_read_offsets_not_positions(compiled):
    """Documented: a relative-bias model takes within-segment offsets from indices, so
    positions that are not contiguous within a segment are not seen (RoPE reads them)."""
    _model, params, apply = compiled(tiny("causal_decoder"))
    batch = packed_batch()
    odd = dict(batch, decoder_positions=batch["decoder_positions"] * 3)
    np.testing.assert_array_equal(np.asarray(apply(params, batch)), apply(params, odd))
    _model, params, apply = compiled(tiny("causal_decoder", position="rope"))
    assert np.abs(np.asarray(apply(params, batch)) - apply(params, odd)).max() > 1e-3


@pytest.mark.parametrize("rows", [1, 3, 6, 16])  # summed in 1, 1, 2 and 4 groups
def test_broadcast_rows_is_broadcast_to_and_its_gradient_the_row_sum(rows):
    """Forward bit for bit; the gradient of a random cotangent equals autodiff's sum over
    rows (not, say, their mean or one group's sum)."""
    kx, kg = jax.random.split(jax.random.key(0))
    x_HLS = jax.random.normal(kx, (3, 5, 7))
    g_BHLS = jax.random.normal(kg, (rows, 3, 5, 7))
    out, vjp = jax.vjp(lambda x: attention.broadcast_rows(x, rows), x_HLS)
    ref, ref_vjp = jax.vjp(lambda x: jnp.broadcast_to(x, (rows, 3, 5, 7)), x_HLS)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_allclose(vjp(g_BHLS)[0], ref_vjp(g_BHLS)[0], rtol=1e-6, atol=1e-6)


@pytest.mark.optimized
@pytest.mark.parametrize("arch", ["causal_decoder", "noncausal_decoder", "encoder_decoder"])
def test_relative_bias_gradients_equal_those_of_a_plain_broadcast(monkeypatch, arch):
    """The whole model's loss bit for bit and its gradients (the bias table's included) to
    float32 rounding, against the bias broadcast over the batch by autodiff."""
    cfg = tiny(arch, attention_impl="xla")
    model = build_model(cfg)
    params = model.init(jax.random.key(1))
    batch = packed_batch()
    calls = []

    def value_and_grads(broadcast_rows):
        def counted(x, rows):
            calls.append(broadcast_rows)
            return broadcast_rows(x, rows)

        monkeypatch.setattr(attention, "broadcast_rows", counted)
        loss = lambda p: model.loss(p, batch, None, deterministic=True)[0]
        return jax.jit(jax.value_and_grad(loss))(params)

    ours = attention.broadcast_rows
    loss, grads = value_and_grads(ours)
    plain = lambda x, rows: jnp.broadcast_to(x, (rows, *x.shape))
    ref_loss, ref_grads = value_and_grads(plain)
    assert ours in calls and plain in calls  # each model's bias went through its own
    assert loss == ref_loss
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    tables = [g for path, g in jax.tree_util.tree_leaves_with_path(grads) if "relpos" in str(path)]
    assert tables and all(float(jnp.abs(g).max()) > 0 for g in tables)


# ---------------------------------------------------------------- remat


@pytest.mark.parametrize(
    "policy",
    ["full", "minimal", "save_attention", "save_attention_mlp", "save_dots", "save_dots_no_batch"],
)
def test_remat_policies_give_the_same_gradients(policy):
    cfg = tiny("encoder_decoder", attention_impl="xla")
    params, _, expected = _reference(cfg, 16, 12)
    _, got = _run(cfg.replace(remat=policy), params, packed_batch())
    for g1, g2 in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(g2), np.asarray(g1), atol=1e-6)


def test_attention_impl_stays_out_of_run_ids_while_auto():
    """Run ids hash the dumped config: the default must not change existing ids."""
    assert "attention_impl" not in ModelConfig().model_dump()
    chosen = ModelConfig(attention_impl="xla")
    assert ModelConfig(**chosen.model_dump()) == chosen
    assert ModelConfig(**ModelConfig().model_dump()).attention_impl == "auto"


def test_remat_policies_keep_what_they_say():
    """Elements kept for the backward pass (abstract trace, no compile): nothing saved per
    layer with `full`, only the residual stream added by `minimal`, attention (and MLP)
    outputs on top with `save_attention` (`save_attention_mlp`), more with the dot policies,
    everything with `none`."""
    try:
        from jax._src.ad_checkpoint import saved_residuals
    except ImportError:  # private helper; its absence only loses this check
        pytest.skip("jax._src.ad_checkpoint.saved_residuals is not available in this JAX")
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in packed_batch().items()}
    kept = {}
    policies = ("none", "full", "minimal", "save_attention", "save_attention_mlp", "save_dots")
    for policy in (*policies, "save_dots_no_batch"):
        model = build_model(tiny("encoder_decoder", remat=policy))
        res = saved_residuals(
            lambda p, b, m=model: m.loss(p, b, None, deterministic=True)[0],
            model.abstract_params(),
            batch,
        )
        kept[policy] = sum(int(np.prod(aval.shape)) for aval, _ in res)
    assert kept["full"] < kept["minimal"] < kept["save_dots_no_batch"] < kept["save_dots"]
    assert kept["save_dots"] < kept["none"]
    # Each set of named projections adds arrays per layer to what `minimal` keeps.
    assert kept["minimal"] < kept["save_attention"] < kept["save_attention_mlp"] < kept["none"]
