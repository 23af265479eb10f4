"""The projections with a hand-written gradient (`layers.project`) equal autodiff's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalestudy.models import decoder, layers
from scalestudy.models.api import build_model


def _plain(spec: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)


@pytest.mark.parametrize(
    ("spec", "w_shape", "dtype", "out_dtype"),
    [
        ("BLD,DF->BLF", (8, 12), jnp.float32, None),
        ("BLD,DF->BLF", (8, 12), jnp.bfloat16, None),
        ("BLD,VD->BLV", (12, 8), jnp.bfloat16, jnp.float32),  # the tied logits
    ],
)
def test_project_value_and_gradients_equal_autodiffs(spec, w_shape, dtype, out_dtype):
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (3, 5, 8), dtype)
    w = jax.random.normal(kw, w_shape, dtype)

    def loss(f):  # a nonlinear read-out, so the cotangent is elementwise work as in the model
        return lambda x, w: jnp.sum(jax.nn.gelu(f(spec, x, w, out_dtype)).astype(jnp.float32) ** 2)

    ours = jax.value_and_grad(loss(layers.project), argnums=(0, 1))(x, w)
    ref = jax.value_and_grad(loss(_plain), argnums=(0, 1))(x, w)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=tol, atol=tol)


@pytest.mark.parametrize(("activation", "tied"), [("gated_gelu", True), ("gelu", False)])
def test_model_gradients_equal_those_of_plain_einsums(
    monkeypatch, tiny_cfg, make_batch_fn, activation, tied
):
    cfg = tiny_cfg(activation=activation, tie_embeddings=tied, scan_layers=False)
    model = build_model(cfg)
    params = model.init(jax.random.key(1))
    batch = make_batch_fn(rows=2, length=12)

    def grads():
        loss = lambda p: model.loss(p, batch, None, deterministic=True)[0]
        return jax.jit(jax.grad(loss))(params)

    ours = grads()
    monkeypatch.setattr(layers, "project", _plain)
    monkeypatch.setattr(decoder, "project", _plain)
    ref = grads()
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Not vacuous: the projections' weights do get a gradient.
    for name in ("wi_0", "table" if tied else "logits"):
        got = [g for path, g in jax.tree_util.tree_leaves_with_path(ours) if name in str(path)]
        assert got and all(float(jnp.abs(g).max()) > 0 for g in got)
