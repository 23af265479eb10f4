"""Tiny model configs and batches for the model tests."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from scalestudy.config.experiment import ModelConfig

VOCAB = 64


def tiny(arch: str = "causal_decoder", **kw) -> ModelConfig:
    """A 2-layer, d_model 32 model computed in float32 (so comparisons can be tight), its
    layers scanned unless `scan_layers` says otherwise."""
    base = dict(
        arch=arch, vocab_size=VOCAB, d_model=32, n_heads=4, d_ff=64, n_layers=2, dtype="float32",
        scan_layers=True,
    )  # fmt: skip
    return ModelConfig(**{**base, **kw})


def make_batch(
    rows: int = 3, length: int = 16, src: int = 12, prefix: int = 0, seed: int = 0
) -> dict[str, np.ndarray]:
    """One unpacked example per row, every position real (decoder and encoder features)."""
    rng = np.random.default_rng(seed)
    targets = rng.integers(1, VOCAB, (rows, length)).astype(np.int32)
    inputs = np.concatenate([np.zeros((rows, 1), np.int32), targets[:, :-1]], axis=1)
    causal_attention = np.zeros((rows, length), np.int32)
    causal_attention[:, :prefix] = 1
    return {
        "decoder_input_tokens": inputs,
        "decoder_target_tokens": targets,
        "decoder_loss_weights": np.ones((rows, length), np.int32),
        "decoder_segment_ids": np.ones((rows, length), np.int32),
        "decoder_positions": np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
        "decoder_causal_attention": causal_attention,
        "encoder_input_tokens": rng.integers(1, VOCAB, (rows, src)).astype(np.int32),
        "encoder_segment_ids": np.ones((rows, src), np.int32),
        "encoder_positions": np.tile(np.arange(src, dtype=np.int32), (rows, 1)),
    }


@pytest.fixture
def batch() -> dict[str, np.ndarray]:
    return make_batch()


@pytest.fixture(scope="session")
def tiny_cfg():
    """Factory: tiny(arch, **overrides) -> ModelConfig."""
    return tiny


@pytest.fixture(scope="session")
def make_batch_fn():
    """Factory: make_batch(rows, length, src, prefix, seed) -> batch dict."""
    return make_batch


@functools.cache
def _compiled(cfg: ModelConfig):
    from scalestudy.models.api import build_model

    model = build_model(cfg)
    return model, jax.jit(model.init)(jax.random.key(0)), jax.jit(model.apply)


@pytest.fixture(scope="session")
def compiled():
    """Factory: compiled(cfg) -> (model, params, jitted apply), cached across tests so each
    config compiles once."""
    return _compiled
