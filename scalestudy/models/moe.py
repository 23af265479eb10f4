"""Mixture-of-experts feed-forward layer: routers, dispatch and experts (Flax NNX).

Shape letters as in `layers.py`, plus T tokens (B * L, flattened), E routed experts, K experts
chosen per token, A assignments (T * K, ordered k-major: all first choices, then all second
choices), C slots per expert (capacity dispatch), R rows of the dropless buffer, F expert width.

Routers (`route_deepseek`, `route_switch`) turn float32 router logits into each token's K
experts and gates plus an auxiliary loss (coefficient applied) and measurements. Dispatch
places assignments in rows grouped by expert:
- dropless: every assignment computed. On accelerators the rows are grouped by expert and
  multiplied with `jax.lax.ragged_dot`; on a CPU, where `ragged_dot` computes every group
  against every row, each expert's balanced share of assignments runs in capacity slots and
  the rest in rows padded to blocks of `block_rows`, a loop running the filled blocks (one
  expert's weights each) one at a time.
- capacity: C = ceil(capacity_factor * T * K / E) slots per expert in fixed-shape [E, C, D]
  arrays; assignments beyond an expert's slots (first choices before second choices, then in
  token order) are dropped and contribute zero. A dropped assignment depends on other tokens of
  the batch, later positions included: only dropless dispatch (and capacity dispatch that drops
  nothing) is a per-token function that keeps a causal decoder causal. Under a mesh with an
  expert axis, capacity dispatch exchanges tokens between devices by all-to-all and counts
  slots per device's tokens (`moe_dispatch.py`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from scalestudy.config.experiment import ModelConfig
from scalestudy.models.attention import platform
from scalestudy.models.layers import MLP, ParamInit, activation, constrain, param
from scalestudy.models.moe_dispatch import Slots, capacity, exchange_axes, expert_parallel, ranks

# Rows per block of the CPU dropless dispatch, at most (fewer for small batches, so the
# padding of each expert's rows to whole blocks stays under a quarter of the rows).
BLOCK_ROWS = 128
# CPU dropless dispatch: slots per expert (x T * K / E) multiplied as one batched product
# before the rest of an expert's assignments go to blocks (0: all in blocks). Half the
# balanced share: a router that is not yet balanced (from initialisation, the busiest expert
# takes several times its share) leaves the slots of idle experts empty and sends the rest to
# blocks, which a full share paid twice for (docs/performance.md#mixture-of-experts-on-cpu).
DROPLESS_CAPACITY = 0.5
# Dropless grouping: None picks by platform (blocks on a CPU, `ragged_dot` elsewhere); True or
# False forces `ragged_dot` or blocks (tests compare the two).
RAGGED_DOT: bool | None = None
# The routed experts' compute dtype: None picks by platform (float32 on a CPU, where XLA:CPU
# runs the dispatch's batched products and gathers slower in bfloat16:
# docs/performance.md#mixture-of-experts-on-cpu;
# the model's compute dtype elsewhere); a dtype name forces it. Outputs return to the latter.
EXPERT_DTYPE: str | None = None


def expert_dtype(compute: Any) -> Any:
    """The dtype the routed experts compute in for a model computing in `compute`."""
    if EXPERT_DTYPE is not None:
        return jnp.dtype(EXPERT_DTYPE)
    return jnp.dtype(jnp.float32) if platform() == "cpu" else jnp.dtype(compute)


class Routing(NamedTuple):
    """A router's decision for T tokens and what the train step measures of it."""

    expert_TK: jax.Array  # int32
    gate_TK: jax.Array  # float32
    aux_loss: jax.Array  # float32 scalar, coefficient applied
    entropy: jax.Array  # mean entropy (nats) of the router's distribution over experts


def _assignment_counts(expert_TK: jax.Array, experts: int) -> jax.Array:
    return jax.nn.one_hot(expert_TK, experts, dtype=jnp.float32).sum(axis=-2)


def _entropy(p_TE: jax.Array) -> jax.Array:
    return -jnp.sum(p_TE * jnp.log(jnp.maximum(p_TE, 1e-30)), axis=-1).mean()


def route_deepseek(logits_BLE: jax.Array, bias_E: jax.Array, k: int, balance: float) -> Routing:
    """DeepSeek-V3: affinities s = sigmoid(logits); the top k of s + bias are chosen (the bias,
    for balancing, steers selection only and gets no gradient); gates are the chosen
    affinities normalised to sum 1. The sequence-wise balance loss is
    `balance * mean over sequences of sum_i f_i P_i`, f_i = E / (K L) * (tokens choosing i),
    P_i = mean over the sequence of s_i / sum_j s_j."""
    b, length, e = logits_BLE.shape
    s_BLE = jax.nn.sigmoid(logits_BLE)
    _, expert_BLK = jax.lax.top_k(s_BLE + jax.lax.stop_gradient(bias_E), k)
    chosen_BLK = jnp.take_along_axis(s_BLE, expert_BLK, axis=-1)
    gate_BLK = chosen_BLK / jnp.sum(chosen_BLK, axis=-1, keepdims=True)
    share_BLE = s_BLE / jnp.sum(s_BLE, axis=-1, keepdims=True)
    f_BE = _assignment_counts(expert_BLK, e).sum(axis=1) * (e / (k * length))
    p_BE = share_BLE.mean(axis=1)
    loss = balance * jnp.mean(jnp.sum(f_BE * p_BE, axis=-1))
    return Routing(
        expert_BLK.reshape(b * length, k),
        gate_BLK.reshape(b * length, k),
        loss,
        _entropy(share_BLE.reshape(b * length, e)),
    )


def route_switch(logits_BLE: jax.Array, k: int, load_balance: float, z_loss: float) -> Routing:
    """Switch/GShard: p = softmax(logits); the top k of p are chosen; gates are their p (k = 1,
    as Switch) or those renormalised to sum 1 (k > 1). Load-balancing loss
    `load_balance * E * sum_i f_i P_i` (f_i: share of assignments to expert i, P_i: mean p_i)
    plus router z-loss `z_loss * mean logsumexp(logits)^2`."""
    e = logits_BLE.shape[-1]
    logits_TE = logits_BLE.reshape(-1, e)
    p_TE = jax.nn.softmax(logits_TE, axis=-1)
    chosen_TK, expert_TK = jax.lax.top_k(p_TE, k)
    gate_TK = chosen_TK / jnp.sum(chosen_TK, axis=-1, keepdims=True) if k > 1 else chosen_TK
    f_E = _assignment_counts(expert_TK, e).sum(axis=0) / expert_TK.size
    lb = load_balance * e * jnp.sum(f_E * p_TE.mean(axis=0))
    z = z_loss * jnp.mean(jax.nn.logsumexp(logits_TE, axis=-1) ** 2)
    return Routing(expert_TK, gate_TK, lb + z, _entropy(p_TE))


def block_rows(assignments: int, experts: int) -> int:
    """Rows per block of the CPU dropless dispatch: a power of two up to BLOCK_ROWS, small
    enough that padding each expert to whole blocks adds at most a quarter of the rows."""
    rows = 1
    while rows * 2 <= BLOCK_ROWS and experts * rows * 2 <= max(assignments // 4, 1):
        rows *= 2
    return rows


class MoE(nnx.Module):
    """Shared experts (always applied) plus E routed experts, K of them per token; a drop-in
    for `layers.MLP` returning its output and a dict of measurements (float32 scalars and
    the per-expert assignment counts "load_E")."""

    def __init__(self, cfg: ModelConfig, init: ParamInit):
        m = cfg.moe
        d, f, e, pd = cfg.d_model, m.width(cfg.d_ff), m.routed_experts, cfg.param_dtype
        self.router = param(init, (d, e), ("embed", "expert"), d**-0.5, pd)
        if m.router == "deepseek":
            # The balancing bias: a parameter-tree leaf (checkpointed with the model) that has
            # no gradient and that the train step sets after each update (`balance`).
            self.router_bias = nnx.Param(jnp.zeros((e,), jnp.float32), out_sharding=("expert",))
        self.gated, self.act = activation(cfg.activation)
        self.wi_0 = param(init, (e, d, f), ("expert", "embed", "mlp"), d**-0.5, pd)
        if self.gated:
            self.wi_1 = param(init, (e, d, f), ("expert", "embed", "mlp"), d**-0.5, pd)
        self.wo = param(init, (e, f, d), ("expert", "mlp", "embed"), f**-0.5, pd)
        if m.shared_experts:
            # N_s experts always applied are one MLP N_s times as wide (their outputs sum).
            self.shared = MLP(cfg, init, width=m.shared_experts * f)
        self.cfg, self.dtype = m, cfg.dtype

    def route(self, x_BLD: jax.Array) -> Routing:
        """The router's decision for each token of `x_BLD`."""
        m = self.cfg
        logits_BLE = jnp.einsum(
            "BLD,DE->BLE", x_BLD.astype(jnp.float32), self.router[...].astype(jnp.float32)
        )
        if m.router == "deepseek":
            return route_deepseek(logits_BLE, self.router_bias[...], m.top_k, m.balance_loss)
        return route_switch(logits_BLE, m.top_k, m.load_balance_loss, m.router_z_loss)

    def _weights(self) -> tuple[jax.Array, jax.Array]:
        """The experts' input projection [E, D, F] (gated: both, [E, D, 2F], one product of
        twice the width) and output projection [E, F, D], in `expert_dtype`."""
        dt = expert_dtype(self.dtype)
        w_up = self.wi_0[...]
        if self.gated:
            w_up = jnp.concatenate([w_up, self.wi_1[...]], axis=-1)
        return w_up.astype(dt), self.wo[...].astype(dt)

    def _ffn(self, x: jax.Array, mul, w_up: jax.Array, w_out: jax.Array) -> jax.Array:
        """The experts' (gated) feed-forward on rows grouped by expert; `mul(rows, weight)`
        multiplies each row by its expert's slice of a [E, in, out] weight (`_weights`)."""
        up = mul(x, w_up)
        if self.gated:
            f = up.shape[-1] // 2
            up = self.act(up[..., :f]) * up[..., f:]
        else:
            up = self.act(up)
        return mul(up, w_out)

    def __call__(
        self,
        x_BLD: jax.Array,
        rng: jax.Array | None = None,
        deterministic: bool = True,
        record: bool = False,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The layer's output and measurements; with `record` (static), the routed experts
        each token chose are sown as `nnx.Intermediate` "expert_BLK" (int32, the router's
        choices, dropped ones included)."""
        m = self.cfg
        b, length, d = x_BLD.shape
        t, k, e = b * length, m.top_k, m.routed_experts
        routing = self.route(x_BLD)
        if record:
            self.sow(nnx.Intermediate, "expert_BLK", routing.expert_TK.reshape(b, length, k))
        count_E = jnp.bincount(routing.expert_TK.reshape(-1), length=e)
        weights = self._weights()
        x_in = x_BLD.astype(weights[0].dtype)  # the experts' dtype
        if m.dispatch == "capacity" and (axes := exchange_axes(b)):
            ffn = lambda x, *w: self._ffn(x, _einsum_experts, *w)
            y_BLD, dropped = expert_parallel(
                axes, ffn, x_in, routing.expert_TK, routing.gate_TK, weights, m.capacity_factor
            )
        else:
            x_TD = x_in.reshape(t, d)
            if m.dispatch == "capacity":
                y_TD, dropped = self._capacity(x_TD, routing, weights)
            else:
                y_TD, dropped = self._dropless(x_TD, routing, count_E, weights), 0
            y_BLD = y_TD.reshape(b, length, d)
        y_BLD = y_BLD.astype(self.dtype)
        if m.shared_experts:
            y_BLD = y_BLD + self.shared(x_BLD, rng, deterministic)
        stats = {
            "load_E": count_E.astype(jnp.float32),
            "dropped": jnp.asarray(dropped, jnp.float32),
            "assignments": jnp.float32(t * k),
            "aux_loss": routing.aux_loss,
            "entropy": routing.entropy,
        }
        return constrain(y_BLD, ("batch", "length", "embed")), stats

    def _capacity(self, x_TD, routing: Routing, weights) -> tuple[jax.Array, jax.Array]:
        """[T, D] outputs of capacity dispatch over all T tokens, and assignments dropped."""
        t, k = routing.expert_TK.shape
        c = capacity(t, k, self.cfg.routed_experts, self.cfg.capacity_factor)
        slots = Slots(routing.expert_TK, self.cfg.routed_experts, c)
        x_ECD = constrain(slots.gather(x_TD), ("expert", None, "embed"))
        y_ECD = constrain(self._ffn(x_ECD, _einsum_experts, *weights), ("expert", None, "embed"))
        dropped = slots.keep_A.size - slots.keep_A.sum()
        return slots.combine(y_ECD, routing.gate_TK), dropped

    def _slot_rows(self, x_TD, routing: Routing, weights, c: int) -> jax.Array:
        """[A, D] each assignment's expert output through C = `c` slots per expert (zero for
        the assignments past an expert's slots)."""
        slots = Slots(routing.expert_TK, self.cfg.routed_experts, c)
        y_ECD = self._ffn(slots.gather(x_TD), _einsum_experts, *weights)
        return jnp.take(
            y_ECD.reshape(-1, y_ECD.shape[-1]), slots.row_A, axis=0, mode="fill", fill_value=0
        )

    def _dropless(self, x_TD, routing: Routing, count_E, weights) -> jax.Array:
        """[T, D] outputs of dropless dispatch: every assignment computed.

        Accelerators: rows grouped by expert, multiplied by `ragged_dot`. A CPU: the first
        C = ceil(DROPLESS_CAPACITY * T * K / E) assignments of each expert fill slots
        multiplied as one batched product (capacity dispatch's), and only the assignments
        past them (none, when the load is balanced) go to rows grouped by expert in blocks,
        of which only the filled ones are multiplied."""
        t, k = routing.expert_TK.shape
        e, a, d = count_E.shape[0], t * k, x_TD.shape[-1]
        expert_A = routing.expert_TK.T.reshape(-1)
        rank_A, _ = ranks(expert_A, e)
        token_A = jnp.tile(jnp.arange(t, dtype=jnp.int32), k)
        x_TD = jnp.concatenate([x_TD, jnp.zeros((1, d), x_TD.dtype)])  # row T: zero
        grouped = platform() != "cpu" if RAGGED_DOT is None else RAGGED_DOT
        if grouped:
            start_E = jnp.cumsum(count_E) - count_E
            row_A = start_E[expert_A] + rank_A
            x_RD = x_TD[jnp.zeros((a,), jnp.int32).at[row_A].set(token_A)]
            mul = lambda v, w: jax.lax.ragged_dot(v, w, count_E.astype(jnp.int32))
            y_AD = self._ffn(x_RD, mul, *weights)[row_A]
        else:
            c = capacity(t, k, e, DROPLESS_CAPACITY)
            y_AD = self._slot_rows(x_TD[:-1], routing, weights, c)
            # The rest: rows grouped by expert, each expert's padded to whole blocks.
            rows = block_rows(a, e)
            over_E = jnp.maximum(count_E - c, 0)
            padded_E = -(-over_E // rows) * rows
            start_E = jnp.cumsum(padded_E) - padded_E
            r = -(-(a + e * (rows - 1)) // rows) * rows
            row_A = jnp.where(rank_A >= c, start_E[expert_A] + rank_A - c, r)
            src_R = jnp.full((r + 1,), t, jnp.int32).at[row_A].set(token_A)[:r]
            end_E = jnp.cumsum(padded_E)
            first_N = jnp.arange(r // rows) * rows
            expert_N = jnp.minimum(jnp.searchsorted(end_E, first_N, side="right"), e - 1)
            filled = (end_E[-1] // rows).astype(jnp.int32)
            mul = lambda v, w: block_matmul(v, w, expert_N.astype(jnp.int32), filled)
            y_RD = self._ffn(x_TD[src_R], mul, *weights)
            y_AD = y_AD + jnp.take(y_RD, row_A, axis=0, mode="fill", fill_value=0)
        gate_A = routing.gate_TK.T.reshape(-1).astype(y_AD.dtype)
        return jnp.sum((y_AD * gate_A[:, None]).reshape(k, t, -1), axis=0)


@jax.custom_vjp
def block_matmul(
    x_RI: jax.Array, w_EIO: jax.Array, expert_N: jax.Array, filled: jax.Array
) -> jax.Array:
    """Rows in N equal blocks, block n multiplied by expert `expert_N[n]`'s [I, O] weight:
    [R, I] x [E, I, O] -> [R, O], one block at a time (a grouped matmul without the E-fold
    work of `ragged_dot` on a CPU); blocks from `filled` on are left zero uncomputed. Its
    backward pass accumulates the weight gradient in place, expert slice by expert slice,
    instead of adding a full [E, I, O] array per block."""
    return _block_matmul(x_RI, w_EIO, expert_N, filled)


def _block_matmul(x_RI, w_EIO, expert_N, filled):
    b = x_RI.shape[0] // expert_N.shape[0]

    def one(n, y_RO):
        x_bI = jax.lax.dynamic_slice_in_dim(x_RI, n * b, b)
        w_IO = jax.lax.dynamic_index_in_dim(w_EIO, expert_N[n], keepdims=False)
        return jax.lax.dynamic_update_slice_in_dim(y_RO, x_bI @ w_IO, n * b, 0)

    y_RO = jnp.zeros((x_RI.shape[0], w_EIO.shape[-1]), jnp.result_type(x_RI, w_EIO))
    return jax.lax.fori_loop(0, filled, one, y_RO)


def _block_matmul_fwd(x_RI, w_EIO, expert_N, filled):
    return _block_matmul(x_RI, w_EIO, expert_N, filled), (x_RI, w_EIO, expert_N, filled)


def _block_matmul_bwd(res, g_RO):
    x_RI, w_EIO, expert_N, filled = res
    b = x_RI.shape[0] // expert_N.shape[0]

    def one(n, grads):
        dx_RI, dw_EIO = grads
        e = expert_N[n]
        x_bI = jax.lax.dynamic_slice_in_dim(x_RI, n * b, b)
        g_bO = jax.lax.dynamic_slice_in_dim(g_RO, n * b, b)
        w_IO = jax.lax.dynamic_index_in_dim(w_EIO, e, keepdims=False)
        dw_IO = jax.lax.dynamic_index_in_dim(dw_EIO, e, keepdims=False) + x_bI.T @ g_bO
        dw_EIO = jax.lax.dynamic_update_index_in_dim(dw_EIO, dw_IO, e, 0)
        return jax.lax.dynamic_update_slice_in_dim(dx_RI, g_bO @ w_IO.T, n * b, 0), dw_EIO

    grads = (jnp.zeros_like(x_RI), jnp.zeros_like(w_EIO))
    dx_RI, dw_EIO = jax.lax.fori_loop(0, filled, one, grads)
    return dx_RI, dw_EIO, None, None


block_matmul.defvjp(_block_matmul_fwd, _block_matmul_bwd)


def _einsum_experts(x: jax.Array, w: jax.Array) -> jax.Array:
    """[E, rows, in] x [E, in, out] -> [E, rows, out]."""
    return jnp.einsum("ECI,EIO->ECO", x, w)
