"""`scalestudy bench peer`: our train step against an independent JAX trainer.

The peer is nanodo (Google DeepMind's minimal decoder-only trainer) whenever it can be
imported (it is not a dependency: put a checkout's parent folder on PYTHONPATH, e.g.
`PYTHONPATH=../shared/peers`); its model runs inside the same loss and AdamW step as below.
Otherwise the peer is a compact decoder written from scratch below in plain JAX and optax, in
the same spirit: pre-norm causal decoder, plain GELU MLP, tied input/output embeddings, no
position bias, float32, AdamW, no sharding annotations, one `jax.jit` over loss, gradient
and update. `--peer auto` (the default) picks as said; `--peer minimal` or `--peer nanodo`
forces one, and the result names the peer that ran.

Both run the same batch (the decoder features of our pipeline at the config's lengths) and
the same counted FLOPs (checked by `peer_flops`, which counts from the peer's own parameter
shapes, not from our counting module). They are timed alternately in one process, a block
of steps each, and the median of the blocks is reported, so a shared machine's load drifts
into both alike; each block's wall time and the process's CPU time are both reported.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from scalestudy.bench.profile import profile_step
from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import ExperimentConfig
from scalestudy.data import pipeline
from scalestudy.models import counting
from scalestudy.models.decoder import scanned
from scalestudy.train import program as train_program

PEERS = ("auto", "minimal", "nanodo")
PEER_FEATURES = ("decoder_input_tokens", "decoder_target_tokens", "decoder_loss_weights")

# Our model at the peer's shape: what the peer can express.
PEER_SHAPE = (
    "model.arch=causal_decoder",
    "objective.name=flm",
    "model.activation=gelu",
    "model.position=none",
    "model.tie_embeddings=true",
    "model.dtype=float32",
    "model.param_dtype=float32",
    "model.dropout=0.0",
    "optim.name=adamw",
    "optim.schedule=constant",
    "optim.warmup_steps=0",
    "optim.grad_clip_norm=null",  # the peer does not clip
)


def init_peer(key: jax.Array, *, vocab: int, d: int, heads: int, layers: int, d_ff: int):
    """Parameters of the minimal peer: an embedding table and per-layer matrices."""
    keys = iter(jax.random.split(key, 1 + 6 * layers))

    def dense(n_in: int, n_out: int) -> jax.Array:
        return jax.random.normal(next(keys), (n_in, n_out), jnp.float32) / np.sqrt(n_in)

    blocks = [
        {
            "ln1": jnp.ones((d,)),
            "ln2": jnp.ones((d,)),
            "wq": dense(d, d),
            "wk": dense(d, d),
            "wv": dense(d, d),
            "wo": dense(d, d),
            "up": dense(d, d_ff),
            "down": dense(d_ff, d),
        }
        for _ in range(layers)
    ]
    embed = jax.random.normal(next(keys), (vocab, d), jnp.float32) / np.sqrt(d)  # tied: logits O(1)
    return {"embed": embed, "blocks": blocks, "ln_f": jnp.ones((d,)), "heads": heads}


def _rms(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def peer_logits(params: dict, tokens_bl: jax.Array, heads: int) -> jax.Array:
    """Causal decoder forward: tokens [B, L] -> logits [B, L, V]."""
    x_bld = params["embed"][tokens_bl]
    length = tokens_bl.shape[1]
    causal_ll = jnp.tril(jnp.ones((length, length), bool))
    for blk in params["blocks"]:
        h_bld = _rms(x_bld, blk["ln1"])
        b, _, d = h_bld.shape
        q_blhk, k_blhk, v_blhk = (
            (h_bld @ blk[w]).reshape(b, length, heads, d // heads) for w in ("wq", "wk", "wv")
        )
        s_bhqk = jnp.einsum("bqhk,bshk->bhqs", q_blhk, k_blhk) / np.sqrt(d // heads)
        s_bhqk = jnp.where(causal_ll, s_bhqk, -1e30)
        a_blhk = jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(s_bhqk, axis=-1), v_blhk)
        x_bld = x_bld + a_blhk.reshape(b, length, d) @ blk["wo"]
        x_bld = x_bld + jax.nn.gelu(_rms(x_bld, blk["ln2"]) @ blk["up"]) @ blk["down"]
    return _rms(x_bld, params["ln_f"]) @ params["embed"].T


def peer_flops(params: dict, length: int) -> float:
    """Training matmul FLOPs of one example of `length` positions, counted from the peer's
    parameter shapes: 2 per multiply-add of every weight matrix at every position, the
    L x L scores and weighted values of each layer, the tied output projection; x3 for the
    backward pass."""
    vocab, d = params["embed"].shape
    forward = 2.0 * length * vocab * d  # logits (the input lookup is a gather)
    for blk in params["blocks"]:
        for name in ("wq", "wk", "wv", "wo", "up", "down"):
            n_in, n_out = blk[name].shape
            forward += 2.0 * length * n_in * n_out
        forward += 2.0 * 2 * length * length * d  # q.k scores and probabilities x values
    return 3.0 * forward


def _loss(logits_blv: jax.Array, batch: dict) -> jax.Array:
    targets, weights = batch["decoder_target_tokens"], batch["decoder_loss_weights"]
    ce_bl = optax.softmax_cross_entropy_with_integer_labels(logits_blv, targets)
    return jnp.sum(ce_bl * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def resolve_peer(which: str) -> str:
    """The peer `which` names: "auto" is nanodo when it imports, else the minimal one."""
    if which != "auto":
        return which
    try:
        import nanodo.model  # noqa: F401
    except ImportError:
        return "minimal"
    return "nanodo"


def make_peer(cfg: ExperimentConfig, which: str = "minimal") -> tuple[Any, Any, float]:
    """(jitted step(state, batch) -> (state, loss), initial state, counted FLOPs/example)."""
    which = resolve_peer(which)
    m, length = cfg.model, cfg.objective.decoder_length
    if m.d_model % m.n_heads or (m.d_kv is not None and m.d_kv * m.n_heads != m.d_model):
        raise ConfigError("bench peer: the peer needs n_heads x head width == model.d_model")
    o = cfg.optim
    tx = optax.adamw(o.learning_rate, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)
    key = jax.random.key(cfg.train.seed)
    if which == "minimal":
        full = init_peer(
            key, vocab=m.vocab_size, d=m.d_model, heads=m.n_heads, layers=m.n_layers, d_ff=m.d_ff
        )
        flops = peer_flops(full, length)
        heads = full.pop("heads")
        params = full

        def forward(p: dict, tokens: jax.Array) -> jax.Array:
            return peer_logits(p, tokens, heads)

    elif which == "nanodo":
        forward, params = _nanodo(cfg, key, length)
        flops = counting.flops(cfg)["flops_per_example"]  # its shapes are ours by construction
    else:
        raise ConfigError(f"bench peer --peer {which!r}: accepted: {', '.join(PEERS)}")

    def train_step(state: tuple, batch: dict) -> tuple[tuple, jax.Array]:
        p, opt = state
        loss, grads = jax.value_and_grad(
            lambda q: _loss(forward(q, batch["decoder_input_tokens"]), batch)
        )(p)
        updates, opt = tx.update(grads, opt, p)
        return (optax.apply_updates(p, updates), opt), loss

    return jax.jit(train_step, donate_argnums=0), (params, tx.init(params)), flops


def _nanodo(cfg: ExperimentConfig, key: jax.Array, length: int) -> tuple[Any, Any]:
    try:
        from nanodo import model as nanodo_model
    except ImportError:
        raise ConfigError(
            "bench peer --peer nanodo: nanodo is not installed (it is not on the package "
            "index); put the folder holding a checkout of github.com/google-deepmind/nanodo "
            "on PYTHONPATH (e.g. PYTHONPATH=../shared/peers), or use --peer minimal"
        ) from None
    m = cfg.model
    docfg = nanodo_model.DoConfig(
        D=m.d_model,
        H=m.n_heads,
        L=length,
        N=m.n_layers,
        V=m.vocab_size,
        F=m.d_ff,
        fsdp_enabled=False,
        dtype=jnp.dtype(m.dtype),
    )
    net = nanodo_model.TransformerDo(docfg)
    params = net.init(key, jnp.zeros((1, length), jnp.int32))
    return net.apply, params


def peer_config(cfg: ExperimentConfig) -> ExperimentConfig:
    """`cfg` at the peer's shape (see PEER_SHAPE)."""
    from scalestudy.config.yamlio import apply_overrides

    return type(cfg).model_validate(apply_overrides(cfg.model_dump(), PEER_SHAPE))


def bench_peer(
    cfg: ExperimentConfig,
    steps: int,
    rounds: int = 5,
    which: str = "auto",
    profile_dir: Path | None = None,
):
    """Step time and tokens/s of our train step and the peer's at `cfg`'s shape (made the
    peer's), alternating blocks of `steps` steps for `rounds` rounds; medians, and the ratio
    peer / ours of the reported step times (above 1: ours is faster). With `profile_dir`,
    each side's `steps` steps are then traced there and "profile" gives, per kind of
    operation (`bench/profile.py`), each side's milliseconds per step."""
    cfg = peer_config(cfg)
    which = resolve_peer(which)
    peer_step, peer_state, peer_fpe = make_peer(cfg, which)  # a missing peer fails first
    batch = next(pipeline.make_iterator(cfg, "train"))
    program = train_program.build_program(cfg, batch)
    ours = (program.step, program.init(cfg.train.seed), program.shard_batch(batch))
    peer = (peer_step, peer_state, {k: jnp.asarray(batch[k]) for k in PEER_FEATURES})
    ours_fpe = counting.flops(cfg)["flops_per_example"]
    tokens = float(np.sum(batch["decoder_loss_weights"]))
    ours_s, peer_s, peer_compile_s, losses, ours, peer = _alternate(ours, peer, steps, rounds)
    profile = None
    if profile_dir is not None:
        shape = {"vocab": cfg.model.vocab_size, "d_ff": cfg.model.d_ff}
        _, ours_prof = profile_step(*ours, steps, Path(profile_dir) / "ours", **shape)
        _, peer_prof = profile_step(*peer, steps, Path(profile_dir) / which, **shape)
        profile = {k: {"ours": ours_prof[k], which: peer_prof[k]} for k in ours_prof}
    # The ratios are computed from the reported (rounded) times, so a reader recomputing one
    # from the table gets the same number up to its own rounding.
    ours_ms, ours_cpu_ms = (round(1e3 * statistics.median(t), 3) for t in zip(*ours_s))
    peer_ms, peer_cpu_ms = (round(1e3 * statistics.median(t), 3) for t in zip(*peer_s))
    return {
        **_setup(cfg, which, ours_fpe, peer_fpe),
        "ours_step_ms": ours_ms,
        "peer_step_ms": peer_ms,
        "ours_tokens_per_s": round(tokens / ours_ms * 1e3),
        "peer_tokens_per_s": round(tokens / peer_ms * 1e3),
        "ratio_peer_over_ours_step_time": round(peer_ms / ours_ms, 3),
        "ours_step_cpu_ms": ours_cpu_ms,
        "peer_step_cpu_ms": peer_cpu_ms,
        "ratio_peer_over_ours_cpu_time": round(peer_cpu_ms / ours_cpu_ms, 3),
        "ours_compile_s": round(program.compile_s, 2),
        "peer_compile_s": round(peer_compile_s, 2),
        "peer_loss_first_last": [round(float(losses[0]), 4), round(float(losses[1]), 4)],
        "rounds": rounds,
        "steps_per_round": steps,
        **({"profile_ms_per_step": profile} if profile else {}),
    }


def _timed(step_fn: Any, state: Any, batch: Any, steps: int) -> tuple[Any, tuple[float, float]]:
    """`steps` steps; (wall, CPU) seconds per step. CPU time counts every thread of this
    process, and only one side runs at a time, so it is that side's work, which other jobs on
    a shared machine slow far less than its wall time."""
    t, c = time.perf_counter(), time.process_time()
    for _ in range(steps):
        state, out = step_fn(state, batch)
    jax.block_until_ready(out)
    return state, ((time.perf_counter() - t) / steps, (time.process_time() - c) / steps)


def _alternate(ours: tuple, peer: tuple, steps: int, rounds: int) -> tuple:
    """Warm both sides up (timing the peer's compile), then `rounds` blocks of `steps` steps
    each, ours then the peer's. `ours` and `peer`: (step_fn, state, batch). Returns each
    side's (wall, CPU) per block, the peer's compile seconds, the peer's first and last loss,
    and both sides with their states advanced."""
    peer_step, peer_state, peer_batch = peer
    t = time.perf_counter()
    peer_state, first_loss = peer_step(peer_state, peer_batch)  # compile + warm-up
    jax.block_until_ready(first_loss)
    peer_compile_s = time.perf_counter() - t
    ours_step, ours_state, ours_batch = ours
    ours_state, _ = _timed(ours_step, ours_state, ours_batch, steps)  # warm-up
    ours_s, peer_s = [], []
    for _ in range(rounds):
        ours_state, s = _timed(ours_step, ours_state, ours_batch, steps)
        ours_s.append(s)
        peer_state, s = _timed(peer_step, peer_state, peer_batch, steps)
        peer_s.append(s)
    peer_state, last_loss = peer_step(peer_state, peer_batch)
    ours = (ours_step, ours_state, ours_batch)
    peer = (peer_step, peer_state, peer_batch)
    return ours_s, peer_s, peer_compile_s, (first_loss, last_loss), ours, peer


def _setup(cfg: ExperimentConfig, which: str, ours_fpe: float, peer_fpe: float) -> dict:
    """The first columns of a peer row: what was compared, on which devices."""
    return {
        "peer": which,
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "shape": (
            f"d{cfg.model.d_model} ff{cfg.model.d_ff} h{cfg.model.n_heads} "
            f"L{cfg.model.n_layers} V{cfg.model.vocab_size}"
        ),
        "batch": cfg.train.batch_size,
        "length": cfg.objective.decoder_length,
        "flops_per_example_ours": ours_fpe,
        "flops_per_example_peer": peer_fpe,
        "scan_layers": f"{cfg.model.scan_layers} ({'on' if scanned(cfg.model) else 'off'})",
    }
