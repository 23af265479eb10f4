"""Size ladders, token budgets, IsoFLOP grids and matched comparisons across architectures.

A ladder rung is a decoder-stack shape (d_model, n_layers, n_heads, d_ff) chosen by a rule
from a target number of non-embedding parameters, in the spirit of Kaplan et al. (2020),
Chinchilla and T5: about 12 d^2 parameters per layer, a head width of 64 once the model is
wide enough, a feed-forward width of 8/3 d_model (gated MLP), and an aspect ratio
d_model / n_layers that grows log-linearly with size (16 at 1e5 parameters, 128 at 1e11).
Every count reported for a rung comes from models/counting.py, never from the rule.

Matched comparisons (the study spec's `matching`) decide the encoder-decoder's shape:
- equal_stack_shape: encoder and decoder each have the rung's shape (about twice the
  decoder-only parameters, as in Wang et al. 2022);
- equal_total_params: each stack half as deep, and the feed-forward width adjusted so that
  total parameters equal the decoder-only model's within the spec's tolerance;
- equal_flops: the stack shape of equal_stack_shape, with training steps set so that every
  cell spends the training FLOPs of the causal decoder at the same rung and budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scalestudy.config.base import parse_count
from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import ExperimentConfig, ModelConfig
from scalestudy.config.yamlio import read_yaml
from scalestudy.models import counting
from scalestudy.study.plan.spec import BudgetConfig, LadderConfig

# Named rungs: targets of non-embedding parameters per decoder stack, 1e5 .. 1e11.
RUNGS: dict[str, float] = {
    f"{m}{unit}": m * scale
    for unit, scale in (("K", 1e3), ("M", 1e6), ("B", 1e9))
    for m in (1, 3, 10, 30, 100, 300)
    if 1e5 <= m * scale <= 1e11
}

PRESETS: dict[str, tuple[Any, ...]] = {
    # CPU studies: six sizes over 1.5 decades (d_model 16 .. 80), so that a two-parameter law
    # has three sizes per parameter (the fits' points flag) and 7 cells train in minutes.
    "smoke": (1e4, 2e4, 4e4, 7e4, 1.4e5, 3e5),
    "tiny": ("100K", "300K", "1M", "3M"),
    "decades": ("100K", "1M", "10M", "100M", "1B", "10B", "100B"),
    "half_decades": tuple(RUNGS),
    # Chinchilla-style IsoFLOP range on a small accelerator slice.
    "isoflop_small": ("1M", "3M", "10M", "30M", "100M"),
}


@dataclass(frozen=True)
class Rung:
    """One size of the ladder: a name and the ModelConfig keys that give its shape."""

    name: str
    model: dict[str, Any] = field(default_factory=dict)
    target: float | None = None  # target non-embedding parameters, when made by the rule


def _round_to(x: float, q: int) -> int:
    return max(q, round(x / q) * q)


def shape_for(target: float, cfg: LadderConfig, activation: str = "gated_gelu") -> dict[str, int]:
    """Decoder-stack shape whose non-embedding parameters approximate `target`."""
    t = min(max((math.log10(target) - 5.0) / 6.0, 0.0), 1.0)
    aspect = math.exp(
        math.log(cfg.aspect_small) + t * (math.log(cfg.aspect_large) - math.log(cfg.aspect_small))
    )
    mlp_mats = 3 if activation.startswith("gated") else 2
    per_d2 = 4 + mlp_mats * cfg.ff_multiplier  # parameters per layer / d_model^2
    d_raw = (aspect * target / per_d2) ** (1 / 3)
    quantum = 16 if d_raw < 256 else 64 if d_raw < 4096 else 128
    d_model = _round_to(d_raw, quantum)
    head_dim = cfg.head_dim if d_model >= 4 * cfg.head_dim else max(4, d_model // 4)
    if d_model % head_dim:
        d_model = _round_to(d_model, head_dim)
    n_layers = max(cfg.min_layers, round(target / (per_d2 * d_model**2)))
    ff_quantum = 8 if d_model < 1024 else 128
    d_ff = _round_to(cfg.ff_multiplier * d_model, ff_quantum)
    return {
        "d_model": d_model,
        "n_layers": n_layers,
        "n_heads": d_model // head_dim,
        "d_ff": d_ff,
    }


def _rung_name(target: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if target >= scale:
            return f"{target / scale:g}{unit}"
    return f"{target:g}"


def resolve_ladder(
    cfg: LadderConfig, spec_dir: Path | None = None, activation: str = "gated_gelu"
) -> list[Rung]:
    """The rungs of a ladder config, smallest first as written (preset, then `sizes`)."""
    entries = list(cfg.sizes) if cfg.sizes else None
    if entries is None:
        if cfg.preset not in PRESETS:
            raise ConfigError(
                f"ladder.preset: got {cfg.preset!r}; accepted: {', '.join(PRESETS)} "
                "(or give ladder.sizes)"
            )
        entries = list(PRESETS[cfg.preset])
    rungs: list[Rung] = []
    for entry in entries:
        rungs.append(_resolve_entry(entry, cfg, spec_dir, activation))
    names = [r.name for r in rungs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"ladder.sizes: duplicate rung names {dupes}; give each a unique name")
    return rungs


def _resolve_entry(entry: Any, cfg: LadderConfig, spec_dir: Path | None, activation: str) -> Rung:
    if isinstance(entry, dict):
        keys = dict(entry)
        name = keys.pop("name", None)
        if not name:
            raise ConfigError(f"ladder.sizes: an explicit shape needs a `name`; got {entry!r}")
        if "include" in keys:  # a model preset file, optionally with overrides
            path = Path(keys.pop("include"))
            path = path if path.is_absolute() or spec_dir is None else spec_dir / path
            keys = {**read_yaml(path).get("model", {}), **keys}
        return Rung(str(name), keys)
    if isinstance(entry, str) and entry.endswith((".yaml", ".yml")):
        path = Path(entry) if spec_dir is None or Path(entry).is_absolute() else spec_dir / entry
        model = read_yaml(path).get("model")
        if not isinstance(model, dict):
            raise ConfigError(f"ladder.sizes: {path} has no `model:` mapping")
        return Rung(Path(entry).stem, dict(model))
    target = RUNGS.get(entry) if isinstance(entry, str) else None
    if target is None:
        target = parse_count(entry)
    if not isinstance(target, int | float) or target < 1e3:
        raise ConfigError(
            f"ladder.sizes: cannot read {entry!r}; give a rung name ({', '.join(RUNGS)}), a "
            "parameter count >= 1e3, a model YAML file, or a mapping with name and model keys"
        )
    name = entry if isinstance(entry, str) and entry in RUNGS else _rung_name(float(target))
    return Rung(name, shape_for(float(target), cfg, activation), float(target))


# ----------------------------------------------------------------------------- matching


def match_model(
    model: ModelConfig, arch: str, matching: str, tolerance: float = 0.03
) -> ModelConfig:
    """The `arch` model matching the decoder-only rung `model` under `matching`.

    Every stack takes the rung's shape (`n_encoder_layers` unset: as deep as the decoder).
    Under equal_total_params, a model whose parameters exceed the rung's by more than
    `tolerance` (the encoder-decoder's two stacks) is halved in depth per stack and its
    feed-forward width solved for the rung's total.
    """
    if matching not in ("equal_total_params", "equal_stack_shape", "equal_flops"):
        raise ConfigError(
            f"matching: got {matching!r}; accepted: equal_total_params, equal_stack_shape, "
            "equal_flops"
        )
    stacked = model.replace(arch=arch, n_encoder_layers=None)
    if matching != "equal_total_params":
        return stacked
    target = counting.count_params(model)["total"]
    if abs(counting.count_params(stacked)["total"] - target) <= tolerance * target:
        return stacked
    shallow = stacked.replace(n_layers=max(1, model.n_layers // 2))
    # Total parameters are affine in d_ff: solve for the width that matches, then round.
    n_a = counting.count_params(shallow.replace(d_ff=8))["total"]
    n_b = counting.count_params(shallow.replace(d_ff=16))["total"]
    slope = (n_b - n_a) / 8
    d_ff = round((8 + (target - n_a) / slope) / 8) * 8
    if d_ff < 8:
        raise ConfigError(
            f"matching=equal_total_params: cannot shrink a {arch} to {target} parameters at "
            f"d_model={model.d_model}, n_layers={model.n_layers}; use rungs with more layers "
            "or matching=equal_stack_shape"
        )
    matched = shallow.replace(d_ff=d_ff)
    got = counting.count_params(matched)["total"]
    if abs(got - target) > tolerance * target:
        raise ConfigError(
            f"matching=equal_total_params: best {arch} has {got} parameters vs {target} for "
            f"the decoder (d_model={model.d_model}); outside match_tolerance={tolerance}"
        )
    return matched


# ----------------------------------------------------------------------------- budgets


def budget_points(budget: BudgetConfig) -> list[tuple[str, float | None]]:
    """(tag, compute) pairs: one per IsoFLOP budget, else a single point with no compute."""
    if budget.kind != "isoflop":
        return [("", None)]
    return [
        (f"C{float(parse_count(c)):.0e}".replace("+", ""), float(parse_count(c)))
        for c in budget.compute
    ]


def steps_for_budget(
    cfg: ExperimentConfig,
    budget: BudgetConfig,
    compute: float | None = None,
    reference_params: dict[str, int] | None = None,
) -> int:
    """Training steps of `cfg` under `budget` (0 when an IsoFLOP point is too short).

    Token budgets count processed positions (batch_size x positions_per_example per step);
    tokens_per_param uses `reference_params` (the rung's decoder-only counts) so every cell of
    a rung sees the same amount of text.
    """
    batch = cfg.train.batch_size
    if budget.kind == "steps":
        return int(budget.steps)
    flops = counting.flops(cfg)
    if budget.kind == "isoflop":
        steps = int(compute // (batch * flops["flops_per_example"]))
        return steps if steps >= budget.min_steps else 0
    if budget.kind == "tokens":
        tokens = float(budget.tokens)
    else:
        params = reference_params or counting.count_params(cfg.model)
        tokens = budget.tokens_per_param * params[budget.param_kind]
    return max(1, math.ceil(tokens / (batch * flops["positions_per_example"])))


def steps_for_flops(cfg: ExperimentConfig, train_flops: float) -> int:
    """Steps of `cfg` closest to spending `train_flops` (equal_flops matching)."""
    per_step = cfg.train.batch_size * counting.flops(cfg)["flops_per_example"]
    return max(1, round(train_flops / per_step))
