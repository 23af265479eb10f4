"""Cached incremental decoding equals the full forward pass; greedy generation equals
argmax-by-recomputation; mixed-layer masks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalestudy.models import masks
from scalestudy.models.api import build_model

from .conftest import VOCAB, make_batch, tiny


def _params(model, seed: int = 0):
    return jax.jit(model.init)(jax.random.key(seed))


def _chunked(model, params, batch, chunks, max_length=None, encoder=False):
    """Logits of the decoder features fed through the cache in `chunks` (sizes)."""
    tokens = batch["decoder_input_tokens"]
    rows, length = tokens.shape
    assert sum(chunks) == length
    enc = batch["encoder_input_tokens"] if encoder else None
    cache = model.new_cache(params, rows, max_length or length + 3, enc)
    extend = jax.jit(model.extend)
    out, start = [], 0
    for size in chunks:
        piece = {
            k: jnp.asarray(batch[k][:, start : start + size])
            for k in ("decoder_segment_ids", "decoder_positions", "decoder_causal_attention")
        }
        logits, cache = extend(
            params,
            cache,
            tokens[:, start : start + size],
            piece["decoder_segment_ids"],
            piece["decoder_positions"],
            piece["decoder_causal_attention"],
        )
        out.append(logits)
        start += size
    assert int(cache.length) == length
    return np.concatenate(out, axis=1)


def _packed(rows: int = 2, seed: int = 1) -> dict[str, np.ndarray]:
    """Two packed segments per row (lengths 6 and 7) then 3 padding positions."""
    batch = make_batch(rows, 16, seed=seed)
    segment = np.array([1] * 6 + [2] * 7 + [0] * 3, np.int32)
    positions = np.array(list(range(6)) + list(range(7)) + [0] * 3, np.int32)
    batch["decoder_segment_ids"] = np.tile(segment, (rows, 1))
    batch["decoder_positions"] = np.tile(positions, (rows, 1))
    batch["decoder_input_tokens"] = np.where(segment > 0, batch["decoder_input_tokens"], 0)
    batch["decoder_input_tokens"][:, [0, 6]] = 0  # each segment starts from id 0
    return batch


@pytest.mark.parametrize("position", ["relative_bias", "rope", "none"])
def test_cached_equals_uncached_causal_unpacked(position):
    model = build_model(tiny(position=position, scan_layers=position != "none"))
    params = _params(model)
    batch = make_batch(rows=2, length=16)
    full = np.asarray(model.apply(params, batch))
    cached = _chunked(model, params, batch, [7, 1, 1, 7])
    np.testing.assert_allclose(cached, full, atol=2e-5, rtol=2e-5)


def test_cached_equals_uncached_causal_packed():
    model = build_model(tiny())
    params = _params(model)
    batch = _packed()
    full = np.asarray(model.apply(params, batch))
    cached = _chunked(model, params, batch, [4, 1, 1, 1, 9])
    real = batch["decoder_segment_ids"] > 0
    np.testing.assert_allclose(cached[real], full[real], atol=2e-5, rtol=2e-5)
    # The second segment never reads the first: recomputing it alone gives the same logits.
    alone = {k: v[:, 6:13] for k, v in batch.items() if k.startswith("decoder_")}
    np.testing.assert_allclose(
        cached[:, 6:13], np.asarray(model.apply(params, alone)), atol=2e-5, rtol=2e-5
    )


@pytest.mark.parametrize("attention", ["standard", "mixed", "mixed_layers"])
def test_cached_equals_uncached_noncausal(attention):
    model = build_model(tiny("noncausal_decoder", attention=attention))
    params = _params(model)
    batch = make_batch(rows=2, length=16, prefix=7)
    full = np.asarray(model.apply(params, batch))
    cached = _chunked(model, params, batch, [7, 1, 1, 7])  # the prefix comes in one chunk
    np.testing.assert_allclose(cached, full, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_cached_equals_uncached_encoder_decoder(qk_norm):
    model = build_model(tiny("encoder_decoder", position="rope", qk_norm=qk_norm))
    params = _params(model)
    batch = make_batch(rows=2, length=10, src=12)
    full = np.asarray(model.apply(params, batch))
    cached = _chunked(model, params, batch, [3, 1, 6], encoder=True)
    np.testing.assert_allclose(cached, full, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("arch", ["causal_decoder", "noncausal_decoder", "encoder_decoder"])
def test_greedy_equals_argmax_recomputation(arch):
    model = build_model(tiny(arch))
    params = _params(model, seed=3)
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, VOCAB, (2, 5)).astype(np.int32)
    steps = 5
    got = np.asarray(jax.jit(model.generate, static_argnums=2)(params, prompt, steps))
    apply = jax.jit(model.apply)
    # Recompute over one fixed length (one compilation): positions after the last real one
    # are padding, which no real position attends to.
    length = 1 + steps + (0 if arch == "encoder_decoder" else prompt.shape[1])
    out = np.zeros((2, 0), np.int32)
    for _ in range(steps):
        real = np.concatenate([np.zeros((2, 1), np.int32), out], axis=1)
        prefix = 0
        if arch != "encoder_decoder":
            real = np.concatenate([real[:, :1], prompt, out], axis=1)
            prefix = prompt.shape[1] + 1
        n = real.shape[1]
        dec = np.zeros((2, length), np.int32)
        dec[:, :n] = real
        batch = {
            "decoder_input_tokens": dec,
            "decoder_target_tokens": (np.arange(length) < n)[None].repeat(2, 0).astype(np.int32),
            "decoder_causal_attention": (np.arange(length) < prefix)[None].repeat(2, 0),
            "encoder_input_tokens": prompt,
        }
        logits = np.asarray(apply(params, batch))
        out = np.concatenate([out, logits[:, n - 1].argmax(-1)[:, None].astype(np.int32)], axis=1)
    np.testing.assert_array_equal(got, out)
    logits, _ = model.prefill(params, prompt, steps)  # what generation starts from
    np.testing.assert_array_equal(np.asarray(logits[:, -1]).argmax(-1), got[:, 0])
    assert len(np.unique(got)) > 1  # a constant output would hide an ignored cache


@pytest.mark.parametrize("arch", ["causal_decoder", "noncausal_decoder", "encoder_decoder"])
def test_padded_prompts_generate_as_alone(arch):
    """Prompts of several lengths in one call (padded with 0 at the right, `lengths_B`)
    continue as each does alone; the position scheme with the most to lose from a shifted
    slot (relative bias) is the default."""
    model = build_model(tiny(arch))
    params = _params(model, seed=5)
    rng = np.random.default_rng(1)
    lengths = [5, 2]
    steps = 4
    prompts = [rng.integers(3, VOCAB, n).astype(np.int32) for n in lengths]
    padded = np.zeros((len(prompts), max(lengths)), np.int32)
    for row, p in enumerate(prompts):
        padded[row, : len(p)] = p
    generate = jax.jit(model.generate, static_argnums=2)
    got = np.asarray(generate(params, padded, steps, np.asarray(lengths, np.int32)))
    for row, p in enumerate(prompts):
        alone = np.asarray(generate(params, p[None], steps))[0]
        np.testing.assert_array_equal(got[row], alone)
    assert len(np.unique(got)) > 1


def test_by_slot_equals_decoder_self():
    rng = np.random.default_rng(0)
    segment = jnp.asarray(np.sort(rng.integers(0, 3, (2, 12)), axis=1)[:, ::-1].copy())
    prefix = jnp.asarray((rng.random((2, 12)) < 0.5).astype(np.int32))
    slots = jnp.broadcast_to(jnp.arange(12), (2, 12))
    for mixed, direction in ((False, None), (True, None), (False, "backward")):
        want = masks.decoder_self(segment, prefix, 4, mixed, direction)
        got = masks.by_slot(slots, slots, segment, segment, prefix, prefix, 4, mixed, direction)
        np.testing.assert_array_equal(*np.broadcast_arrays(got, want))


@pytest.mark.parametrize("n_layers", [1, 2])
def test_mixed_layers_directions(n_layers):
    """Layer 0 looks forward only (a later prefix token cannot reach an earlier position in a
    one-layer model); layer 1 looks backward, so with two layers it can."""
    cfg = tiny("noncausal_decoder", attention="mixed_layers", n_layers=n_layers)
    model = build_model(cfg)
    params = _params(model)
    batch = make_batch(rows=1, length=12, prefix=8)
    changed = {k: v.copy() for k, v in batch.items()}
    changed["decoder_input_tokens"][0, 6] = (batch["decoder_input_tokens"][0, 6] % 60) + 1
    a, b = (np.asarray(model.apply(params, x)) for x in (batch, changed))
    moved = np.abs(a[0, :6] - b[0, :6]).max()
    assert (moved > 1e-4) == (n_layers == 2)


def test_mixed_layers_masks_alternate_directions():
    segment = jnp.ones((1, 6), jnp.int32)
    both = masks.per_layer(lambda d: masks.encoder_self(segment, 4, False, d), "mixed_layers")
    lower = np.tril(np.ones((6, 6), bool))
    np.testing.assert_array_equal(both[0, 0, 0], lower)  # layer 0 (and 2, 4, ...) forward
    np.testing.assert_array_equal(both[1, 0, 0], lower.T)  # layer 1 (and 3, ...) backward
    single = masks.per_layer(lambda d: masks.encoder_self(segment, 4, False, d), "standard")
    assert single.ndim == 4 and bool(single.all())


@pytest.mark.parametrize("arch", ["causal_decoder", "encoder_decoder"])
def test_prompt_flops_agree_with_the_forward_count(arch):
    """Reading a prompt from scratch is a forward pass with logits at one position only."""
    from scalestudy.models import counting

    cfg = tiny(arch)
    logits_per_position = 2.0 * cfg.d_model * cfg.vocab_size
    if arch == "encoder_decoder":
        want = counting.forward_flops(cfg, 1, encoder_length=20)
        assert counting.prompt_flops(cfg, 20) == pytest.approx(want)
    else:
        want = counting.forward_flops(cfg, 21) - 20 * logits_per_position
        assert counting.prompt_flops(cfg, 20) == pytest.approx(want)
    # A cached step costs what the uncached pass adds for one more position (causal decoder).
    if arch == "causal_decoder":
        extra = counting.forward_flops(cfg, 22) - counting.forward_flops(cfg, 21)
        got = counting.reply_step_flops(cfg, 20, 0)
        # the uncached pass also re-scores the 21 old queries against the new key: 2*2*hk*21
        assert got == pytest.approx(extra - 4.0 * cfg.n_layers * cfg.d_model * 21)


@pytest.mark.parametrize("arch", ["causal_decoder", "encoder_decoder"])
@pytest.mark.parametrize("scan", [True, False])
def test_training_and_cached_decoding_run_one_block_class(arch, scan, monkeypatch):
    from scalestudy.models import decoder

    model = build_model(tiny(arch, scan_layers=scan))
    params = _params(model)
    batch = make_batch(2, 8)
    calls = []
    block_call = decoder.Block.__call__

    def spy(self, x, ctx, rng, deterministic, record=False, cache=None):
        calls.append(("cached" if cache is not None else "training", self.cross))
        return block_call(self, x, ctx, rng, deterministic, record, cache)

    monkeypatch.setattr(decoder.Block, "__call__", spy)
    model.apply(params, batch)
    enc = batch["encoder_input_tokens"] if arch == "encoder_decoder" else None
    cache = model.new_cache(params, 2, 8, enc)
    model.extend(params, cache, batch["decoder_input_tokens"][:, :3])
    kinds = {kind for kind, _ in calls}
    assert kinds == {"training", "cached"}
    # The cached decoder runs the training decoder's blocks (cross-attention included).
    cross = arch == "encoder_decoder"
    assert {c for kind, c in calls if kind == "cached"} == {cross}


@pytest.mark.parametrize("arch", ["causal_decoder", "noncausal_decoder", "encoder_decoder"])
def test_prompt_layout_is_what_prefill_builds(arch):
    from scalestudy.models.api import prompt_layout

    model = build_model(tiny(arch))
    params = model.abstract_params()
    for length, room in ((5, 1), (7, 4)):
        prompt = jax.ShapeDtypeStruct((2, length), jnp.int32)
        logits, cache = jax.eval_shape(lambda p, x, r=room: model.prefill(p, x, r), params, prompt)
        encoded, read, slots = prompt_layout(model.cfg, length, room)
        assert logits.shape == (2, read, VOCAB)
        assert cache.k_NBSHK.shape[2] == slots
        crossed = 0 if cache.cross_k_NBSHK is None else cache.cross_k_NBSHK.shape[2]
        assert crossed == encoded
