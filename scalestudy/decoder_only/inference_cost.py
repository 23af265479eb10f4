"""Multi-turn inference cost: key/value-cache reuse against recomputation, timed per turn.

A dialogue of k turns: each turn appends a user message of u tokens and a greedy reply of r
tokens. What each architecture must compute at turn k (h = (k - 1)(u + r) history tokens):

- causal decoder, cache reused: only the u new tokens (plus the previous reply's last token,
  generated but not yet read) against the cached h; then r - 1 single-token steps.
- causal decoder, no reuse (a control): the whole `0, history, message` again, causally.
- non-causal decoder: the whole history and message again as its bidirectional prefix (every
  earlier prefix position attends to the new ones, so no cached key stays valid).
- encoder-decoder: the whole history and message re-encoded; the reply decoded from 0.

Time to first token is the prefill (or encoding plus first decoder step); total time adds the
r - 1 steps. Compilation is excluded (a warm-up call per shape); each time is the fastest of
`repeats` calls, reported with the median and the slowest and the host's load average while the
series ran (timings on a loaded host are noisy; the FLOPs are not). Replies read back by the
recomputing series are placeholder tokens (the cost does not depend on them). Weights are
freshly initialised: the cost does not depend on their values.

FLOPs are given twice, from `models/counting.py`: what each step needs (`decode_flops` over
the keys written so far) and what the program runs. A cache is a fixed buffer, and a step
attends over every slot of it, masked or not: the reused cache holds the whole dialogue's
slots from turn 1, and a prefill's cache the prompt plus the reply's room. The verdict is on
the FLOPs that run.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scalestudy.config.experiment import ModelConfig
from scalestudy.models import counting
from scalestudy.models.api import build_model, prompt_layout
from scalestudy.study.plan.spec import InferenceCostConfig

SERIES = (
    ("causal_decoder", True),
    ("causal_decoder", False),
    ("noncausal_decoder", False),
    ("encoder_decoder", False),
)


def series_name(arch: str, reuse: bool) -> str:
    return f"{arch} ({'cache reused' if reuse else 'recomputed'})"


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[tuple[float, float, float], Any]:
    """(fastest, median, slowest) wall seconds of `fn()` over `repeats` calls after one warm-up
    (the fastest leads: on a shared host other jobs only ever add time), and its result."""
    out = jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return (min(times), float(np.median(times)), max(times)), out


def _reply(params: Any, extend: Callable, cache: Any, token_B: jax.Array, r: int):
    """r - 1 greedy single-token steps after the first reply token; the final cache."""
    for _ in range(r - 1):
        logits_B1V, cache = extend(params, cache, token_B[:, None])
        token_B = jnp.argmax(logits_B1V[:, -1], axis=-1).astype(jnp.int32)
    return cache, token_B


def _prefill_flops_run(mcfg: ModelConfig, length: int, room: int) -> tuple[float, float]:
    """FLOPs `Model.prefill` then `room - 1` single steps run for a `length`-token prompt: every
    query attends over the whole cache (the positions read plus the room)."""
    encoded, read, slots = prompt_layout(mcfg, length, room)
    first = counting.decode_flops(mcfg, read, slots - read, encoded)
    if encoded:
        first += counting.encoding_flops(mcfg, encoded)
    return first, (room - 1) * counting.decode_flops(mcfg, 1, slots - 1, encoded)


def measure(model_cfg: ModelConfig, cfg: InferenceCostConfig, seed: int = 0) -> list[dict]:
    """One row per (series, turn): measured seconds to first token and in total (fastest and
    slowest of the repeats), and the FLOPs the turn needs by formula."""
    rng = np.random.default_rng(seed)
    shape = (cfg.turns, cfg.rows)
    messages = rng.integers(1, 256, (*shape, cfg.user_tokens)).astype(np.int32)
    # What the recomputing series read back as earlier replies (cost does not depend on it).
    replies = rng.integers(1, 256, (*shape, cfg.reply_tokens)).astype(np.int32)
    series = [
        _series(
            model_cfg.replace(arch=arch, n_encoder_layers=None), reuse, cfg, messages, replies, seed
        )
        for arch, reuse in SERIES
    ]
    # Turn by turn, every series in turn: a busy spell of the host hits all of them alike.
    return [next(turns) for _ in range(cfg.turns) for turns in series]


def _turn_row(
    mcfg: ModelConfig,
    reuse: bool,
    turn: int,
    history_tokens: int,
    ttft: tuple,
    steps: tuple,
    flops: tuple[float, float, float, float],
) -> dict:
    """One turn's row: `ttft` and `steps` are (fastest, median, slowest) seconds of the first
    token and of the rest of the reply; `flops`: (needed to the first token, needed after it,
    run to the first token, run after it)."""
    flops_first, flops_rest, run_first, run_steps = flops
    return {
        "series": series_name(mcfg.arch, reuse),
        "arch": mcfg.arch,
        "reuse": reuse,
        "turn": turn,
        "history_tokens": history_tokens,
        "ttft_s": ttft[0],
        "total_s": ttft[0] + steps[0],
        "ttft_median_s": ttft[1],
        "ttft_max_s": ttft[2],
        "total_max_s": ttft[2] + steps[2],
        "flops_first": flops_first,
        "flops_total": flops_first + flops_rest,
        "flops_first_run": run_first,
        "flops_total_run": run_first + run_steps,
        "load_average": os.getloadavg()[0],  # the host's load while this turn was timed
        "params_total": counting.count_params(mcfg)["total"],
    }


def _series(
    mcfg: ModelConfig,
    reuse: bool,
    cfg: InferenceCostConfig,
    messages: np.ndarray,
    replies: np.ndarray,
    seed: int = 0,
) -> Iterator[dict]:
    """Each turn's row of one series (a generator, so that series can be interleaved)."""
    u, r, b = cfg.user_tokens, cfg.reply_tokens, cfg.rows
    model = build_model(mcfg)
    params = jax.jit(model.init)(jax.random.key(seed))
    extend = jax.jit(model.extend)
    prefill = jax.jit(model.prefill, static_argnums=2)
    buffer = 1 + cfg.turns * (u + r) + r
    history = np.zeros((b, 0), np.int32)  # user messages and replies so far
    cache, last_B = None, jnp.zeros((b,), jnp.int32)  # reused cache; previous reply's end
    for k in range(1, cfg.turns + 1):
        message = messages[k - 1]
        h = history.shape[1]
        if reuse:
            cache = cache if cache is not None else model.new_cache(params, b, buffer)
            chunk = np.concatenate([np.asarray(last_B)[:, None], message], axis=1)
            first = functools.partial(extend, params, cache, chunk)
            flops_first = counting.decode_flops(mcfg, u + 1, h)
            step_flops = [counting.decode_flops(mcfg, 1, h + u + 1 + j) for j in range(r - 1)]
            run_first = counting.decode_flops(mcfg, u + 1, buffer - u - 1)  # every slot
            run_steps = (r - 1) * counting.decode_flops(mcfg, 1, buffer - 1)
        else:  # read the whole dialogue so far from scratch, as this architecture reads a prompt
            prompt = np.concatenate([history, message], axis=1)
            first = functools.partial(prefill, params, prompt, r)
            flops_first = counting.prompt_flops(mcfg, h + u)
            step_flops = [counting.reply_step_flops(mcfg, h + u, j) for j in range(r - 1)]
            run_first, run_steps = _prefill_flops_run(mcfg, h + u, r)
        ttft, (logits, cache_first) = _timed(first, cfg.repeats)
        token_B = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        rest = functools.partial(_reply, params, extend, cache_first, token_B, r)
        steps, (cache_after, last_B) = _timed(rest, cfg.repeats)
        flops_rest = sum(step_flops)
        if reuse:
            cache = cache_after
        history = np.concatenate([history, message, replies[k - 1]], axis=1)
        yield _turn_row(
            mcfg, reuse, k, h, ttft, steps, (flops_first, flops_rest, run_first, run_steps)
        )
