"""Matched comparisons: how each cell's model and training length are chosen so that one
quantity is equal across the cells of a rung.

The reference is the causal decoder at the rung's shape trained for the study's budget (with
the cell's objective for equal_flops, with the full-LM objective for the data modes).
Modes (the spec's `matching`):

- equal_stack_shape:  every stack takes the rung's shape; steps from the budget.
- equal_total_params: total parameters within `match_tolerance` of the reference (the
  encoder-decoder halves its depth per stack and solves its feed-forward width).
- equal_flops:        training FLOPs equal: steps = reference FLOPs / the cell's per step.
- equal_documents:    document tokens read equal: steps = reference document tokens / the
  cell's per step (`data.pipeline.document_tokens_per_row`: a uniform-split prefix-LM
  encoder-decoder row holds two examples, so it trains half as many steps as a decoder row of
  one).
- equal_loss_tokens:  loss-bearing tokens equal: steps from loss-bearing tokens per row,
  measured on the cell's first two training batches.

  The two data modes match by steps by default. With the spec's `match_by: batch`, a cell whose
  row holds k whole reference rows' data trains the reference's steps at 1/k of its rows
  (`match_training`), so data per step is equal too; the others (k not whole, as a span-corruption
  row's raw text) are matched by steps. A prefix-LM encoder-decoder row holds two examples: by
  steps it trains half the steps of a decoder; by batch, the decoder's steps at half its rows,
  as Wang et al. trained it.
- equal_inference_cost: forward FLOPs per generated token equal, at a context of
  `inference_context` tokens (default: the objective's decoder length) with the context's
  keys and values cached (`inference_flops_per_token`); the encoder-decoder's encoder runs
  once per prompt, not per token, and is not counted. The encoder-decoder's feed-forward
  width is solved for the reference's cost; steps from the budget.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import ExperimentConfig, ModelConfig, ObjectiveConfig, to_yaml
from scalestudy.config.yamlio import parse_yaml, validate
from scalestudy.data.pipeline import document_tokens_per_row
from scalestudy.models import counting
from scalestudy.study.plan import ladder, loss_token_count
from scalestudy.study.plan.spec import DATA_MODES
from scalestudy.train import optim

MODES = (
    "equal_stack_shape",
    "equal_total_params",
    "equal_flops",
    "equal_documents",
    "equal_loss_tokens",
    "equal_inference_cost",
)
# What each mode holds equal, in the report's words.
HOLDS = {
    "equal_stack_shape": "stack shape",
    "equal_total_params": "total parameters",
    "equal_flops": "training FLOPs",
    "equal_documents": "document tokens",
    "equal_loss_tokens": "loss-bearing tokens",
    "equal_inference_cost": "inference FLOPs per generated token",
}


def inference_flops_per_token(model: ModelConfig, context: int) -> float:
    """Forward FLOPs of generating one token after `context` tokens whose keys and values are
    cached (the first reply token after a `context`-token prompt; counting.reply_step_flops)."""
    return counting.reply_step_flops(model, context, 0)


@lru_cache(maxsize=64)
def _measured_loss_tokens(cfg_yaml: str) -> float:
    return loss_token_count.loss_tokens_per_row(
        validate(ExperimentConfig, parse_yaml(cfg_yaml), "matched run")
    )


def loss_tokens_per_row(cfg: ExperimentConfig) -> float:
    """Mean loss-bearing tokens per training row of `cfg` (measured on its first two
    training batches; the same config is measured once)."""
    return _measured_loss_tokens(to_yaml(cfg.replace(train=cfg.train.replace(steps=1))))


def match_model(
    shape: ModelConfig, arch: str, mode: str, tolerance: float, context: int
) -> ModelConfig:
    """The `arch` model matching the decoder-only rung `shape` under `mode`."""
    if mode not in MODES:
        raise ConfigError(f"matching: got {mode!r}; accepted: {', '.join(MODES)}")
    if mode != "equal_inference_cost":
        return ladder.match_model(shape, arch, ladder_mode(mode), tolerance)
    model = shape.replace(arch=arch, n_encoder_layers=None)
    target = inference_flops_per_token(shape, context)
    if abs(inference_flops_per_token(model, context) - target) <= tolerance * target:
        return model
    # FLOPs per token are affine in d_ff: solve for the width that matches, then round.
    a = inference_flops_per_token(model.replace(d_ff=8), context)
    b = inference_flops_per_token(model.replace(d_ff=16), context)
    d_ff = round((8 + (target - a) / ((b - a) / 8)) / 8) * 8
    got = inference_flops_per_token(model.replace(d_ff=max(d_ff, 8)), context)
    if d_ff < 8 or abs(got - target) > tolerance * target:
        raise ConfigError(
            f"matching=equal_inference_cost: no {arch} feed-forward width gives the decoder's "
            f"{target:.4g} FLOPs per generated token at context {context} within "
            f"match_tolerance={tolerance}; use wider rungs or another matching mode"
        )
    return model.replace(d_ff=d_ff)


def ladder_mode(mode: str) -> str:
    """The ladder's shape rule behind `mode` (modes that match data keep the stack shape)."""
    return mode if mode in ("equal_total_params", "equal_flops") else "equal_stack_shape"


def match_training(
    cfg: ExperimentConfig,
    shape: ModelConfig,
    budget: Any,
    compute: float | None,
    reference_params: dict[str, int],
    mode: str,
    by: str = "steps",
) -> tuple[int, int]:
    """(training steps, batch rows) of the cell `cfg` under `mode` (steps 0: an IsoFLOP point
    too short). `by` "batch" under a data mode: where the cell's row holds k whole reference
    rows' data, the reference's steps at 1/k of the rows; elsewhere matched by steps. Other
    modes match no data and keep the batch whatever `by` is (a variant's own matching)."""
    rows = cfg.train.batch_size
    if mode not in ("equal_flops", *DATA_MODES):
        return ladder.steps_for_budget(cfg, budget, compute, reference_params), rows
    ref = cfg.replace(model=shape.replace(arch="causal_decoder", n_encoder_layers=None))
    ref_steps = ladder.steps_for_budget(ref, budget, compute, reference_params)
    if ref_steps == 0:
        return 0, rows
    ref = ref.replace(train=ref.train.replace(steps=ref_steps))
    if mode == "equal_flops":
        flops = ref_steps * ref.train.batch_size * counting.flops(ref)["flops_per_example"]
        return ladder.steps_for_flops(cfg, flops), rows
    # Data is matched to the causal decoder's full-LM run, so cells of every objective read
    # (or train on) what it does.
    flm = ref.replace(objective=ref.objective.replace(name="flm"))
    per_row = document_tokens_per_row if mode == "equal_documents" else loss_tokens_per_row
    cell, reference = per_row(cfg), per_row(flm)
    k = round(cell / reference)
    if by == "batch" and k >= 1 and abs(cell / reference - k) <= 1e-6 * k:
        if rows % k:
            raise ConfigError(
                f"match_by: batch: a {cfg.model.arch} {cfg.objective.name} row holds {k} "
                f"reference rows' {HOLDS[mode]}, which does not divide train.batch_size="
                f"{rows}; give a batch divisible by {k} or use match_by: steps"
            )
        return ref_steps, rows // k
    return max(1, round(ref_steps * reference / cell)), rows


def with_steps(cfg: ExperimentConfig, steps: int, name: str) -> ExperimentConfig:
    """`cfg` training `steps` steps, its schedule checked as the run's first step would check
    it (warmup shorter than the run, ...), so a plan refuses what its runs would refuse."""
    cfg = cfg.replace(train=cfg.train.replace(steps=steps))
    try:
        optim.check_schedule(cfg.optim, steps)
    except ConfigError as e:
        raise ConfigError(f"run {name} ({steps} steps): {e}") from None
    return cfg


def planned_counts(cfg: ExperimentConfig, context: int) -> dict[str, float]:
    """What the run is planned to consume and cost: document tokens, inference FLOPs per
    generated token at `context`."""
    rows = cfg.train.steps * cfg.train.batch_size
    return {
        "planned_document_tokens": rows * document_tokens_per_row(cfg),
        "inference_flops_per_token": inference_flops_per_token(cfg.model, context),
        "inference_context": context,
    }


def context_for(study: Any, base: dict) -> int:
    """The context length inference cost is stated at: the spec's `inference_context`, else
    the base objective's decoder length."""
    if getattr(study, "inference_context", None):
        return int(study.inference_context)
    return int(
        validate(ObjectiveConfig, base.get("objective", {}), "base.objective").decoder_length
    )
