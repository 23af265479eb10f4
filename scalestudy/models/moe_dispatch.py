"""Capacity dispatch of mixture-of-experts layers: slots per expert, and expert parallelism
with an explicit all-to-all.

Shape letters as in `moe.py`: T tokens, E routed experts, K choices per token, A assignments
(k-major), C slots per expert, D model width; plus N devices of the "expert" mesh axis, E/N
experts each, and S source devices of an exchange.

Expert parallelism (a mesh with mesh.expert > 1): the layer's capacity dispatch runs inside
`jax.shard_map`, manual over the mesh axes the batch is split over (data, fsdp, expert; tensor
stays with XLA). Each device fills [E, C, D] slots from its own tokens, one all-to-all over
"expert" sends each expert's slots to the device that holds it, that device applies its E/N
experts to the slots of all N sources at once, and a second all-to-all returns the outputs.
Capacity is then counted per device's tokens (GShard's groups): C = ceil(factor * T_device *
K / E), so which assignments drop depends on the mesh, while with nothing dropped the layer
computes what it computes on one device. Weights enter the exchange whole over data and fsdp
(fsdp's gather per layer, as elsewhere) and split over "expert".
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax.core import spmd as flax_spmd
from flax.linen import spmd as linen_spmd
from jax.sharding import PartitionSpec as P


def capacity(tokens: int, k: int, experts: int, factor: float) -> int:
    """Slots per expert of capacity dispatch."""
    return max(1, math.ceil(factor * tokens * k / experts))


def ranks(expert_A: jax.Array, experts: int) -> tuple[jax.Array, jax.Array]:
    """Each assignment's rank among the earlier assignments to its expert, and the number of
    assignments per expert [E]."""
    a = expert_A.shape[0]
    order_A = jnp.argsort(expert_A, stable=True)
    count_E = jnp.bincount(expert_A, length=experts)
    start_E = jnp.cumsum(count_E) - count_E
    rank_sorted = jnp.arange(a, dtype=jnp.int32) - start_E[expert_A[order_A]]
    return jnp.zeros(a, jnp.int32).at[order_A].set(rank_sorted.astype(jnp.int32)), count_E


class Slots:
    """Where the assignments of T tokens go in [E * C] capacity slots: `row_A` (E * C for a
    dropped assignment), `keep_A`, and `source_R`, the token of each slot (T: an empty slot,
    the zero row appended to the tokens)."""

    def __init__(self, expert_TK: jax.Array, experts: int, c: int):
        t, k = expert_TK.shape
        self.experts, self.c = experts, c
        expert_A = expert_TK.T.reshape(-1)  # k-major: first choices have priority
        rank_A, _ = ranks(expert_A, experts)
        self.keep_A = rank_A < self.c
        self.row_A = jnp.where(self.keep_A, expert_A * self.c + rank_A, experts * self.c)
        token_A = jnp.tile(jnp.arange(t, dtype=jnp.int32), k)
        empty = jnp.full((experts * self.c + 1,), t, jnp.int32)
        self.source_R = empty.at[self.row_A].set(token_A)[: experts * self.c]

    def gather(self, x_TD: jax.Array) -> jax.Array:
        """[E, C, D] slot inputs from [T, D] tokens (empty slots zero)."""
        x_TD = jnp.concatenate([x_TD, jnp.zeros((1, x_TD.shape[-1]), x_TD.dtype)])
        return x_TD[self.source_R].reshape(self.experts, self.c, -1)

    def combine(self, y_ECD: jax.Array, gate_TK: jax.Array) -> jax.Array:
        """[T, D]: each token's gate-weighted sum of its kept assignments' slot outputs."""
        k, d = gate_TK.shape[1], y_ECD.shape[-1]
        y_AD = jnp.take(y_ECD.reshape(-1, d), self.row_A, axis=0, mode="fill", fill_value=0)
        gate_A = jnp.where(self.keep_A, gate_TK.T.reshape(-1), 0.0).astype(y_AD.dtype)
        return jnp.sum((y_AD * gate_A[:, None]).reshape(k, -1, d), axis=0)


def _mesh_axes(name: str, rules) -> tuple[str, ...]:
    """The mesh axes logical axis `name` maps to under `rules` (train/sharding.py's table)."""
    axes = linen_spmd.logical_to_mesh_axes((name,), rules)[0]
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


def exchange_axes(rows: int) -> tuple[tuple[str, ...], str] | None:
    """(the mesh axes the batch is split over, the one the experts are split over) for an
    expert-parallel exchange, or None where the layer is not under a mesh that splits the
    experts or its `rows` do not split over the batch's axes. Names come from the logical
    rules: this module names no mesh axis."""
    mesh, rules = jax.sharding.get_abstract_mesh(), flax_spmd.get_logical_axis_rules()
    if mesh.empty or not rules:
        return None
    experts, batch = _mesh_axes("expert", rules), _mesh_axes("batch", rules)
    if len(experts) != 1 or mesh.shape[experts[0]] == 1 or experts[0] not in batch:
        return None
    if rows % math.prod(mesh.shape[a] for a in batch):
        return None
    return batch, experts[0]


def expert_parallel(
    axes: tuple[tuple[str, ...], str],
    ffn: Callable[..., jax.Array],
    x_BLD: jax.Array,
    expert_TK: jax.Array,
    gate_TK: jax.Array,
    weights: tuple[jax.Array, ...],
    factor: float,
) -> tuple[jax.Array, jax.Array]:
    """Capacity dispatch over the expert mesh axis: ([B, L, D] outputs, assignments dropped).
    `ffn(x_ECD, *weights)` applies the experts whose [E, ...] `weights` it is given to their
    rows; `axes` from `exchange_axes`."""
    (batch_axes, expert), rules = axes, flax_spmd.get_logical_axis_rules()
    b, length, _ = x_BLD.shape
    k, e = expert_TK.shape[-1], weights[0].shape[0]
    batch = P(batch_axes)

    def local(x_BLD, expert_BLK, gate_BLK, *weights):
        n = jax.lax.axis_size(expert)
        d, t = x_BLD.shape[-1], x_BLD.shape[0] * x_BLD.shape[1]
        slots = Slots(expert_BLK.reshape(t, k), e, capacity(t, k, e, factor))
        x_NECD = slots.gather(x_BLD.reshape(t, d)).reshape(n, e // n, slots.c, d)
        x_SECD = jax.lax.all_to_all(x_NECD, expert, 0, 0)  # my experts' slots, per source
        x_ECD = jnp.swapaxes(x_SECD, 0, 1).reshape(e // n, n * slots.c, d)
        y_SECD = jnp.swapaxes(ffn(x_ECD, *weights).reshape(e // n, n, slots.c, d), 0, 1)
        y_ECD = jax.lax.all_to_all(y_SECD, expert, 0, 0).reshape(e, slots.c, d)
        y_TD = slots.combine(y_ECD, gate_BLK.reshape(t, k))
        dropped = (slots.keep_A.size - slots.keep_A.sum()).astype(jnp.float32)
        return y_TD.reshape(x_BLD.shape), dropped[None]

    # Manual over every axis but model parallelism's (the MLP's): a group's member axis split
    # over data (vmapped with `spmd_axis_name`) adds that axis to its members' dimension.
    model_parallel = set(_mesh_axes("mlp", rules))
    mesh = jax.sharding.get_abstract_mesh()
    run = jax.shard_map(
        local,
        in_specs=(batch, batch, batch, *(P(expert) for _ in weights)),
        out_specs=(batch, batch),
        axis_names={a for a in mesh.axis_names if a not in model_parallel},
    )
    y_BLD, dropped_N = run(
        x_BLD, expert_TK.reshape(b, length, k), gate_TK.reshape(b, length, k), *weights
    )
    return y_BLD, dropped_N.sum()
