"""A run's summary: what `summary.json` holds after each invocation (counts, losses, rates)."""

from __future__ import annotations

from typing import Any

from scalestudy.config.experiment import ExperimentConfig
from scalestudy.models import counting
from scalestudy.train.datasheets import mfu, peak_flops


def _peak(cfg: ExperimentConfig) -> float:
    return peak_flops(dtype=cfg.model.dtype)["flops_per_s"]


def run_summary(
    cfg: ExperimentConfig,
    done: int,
    totals: dict,
    last: dict,
    final_eval: dict,
    train_time: float,
    start: int,
    tokens0: float,
) -> dict[str, Any]:
    """summary.json of a run after `done` steps, `done - start` of them in this invocation
    (which took `train_time` seconds of train steps and began with `tokens0` tokens).

    `train_time` should exclude evaluation and checkpointing: MFU and tokens/s divide by it.
    """
    counts = counting.flops(cfg)
    params = counting.count_params(cfg.model)
    flops = done * cfg.train.batch_size * counts["flops_per_example"]
    this_run_flops = (done - start) * cfg.train.batch_size * counts["flops_per_example"]
    this_run_tokens = totals["tokens"] - tokens0
    moe = cfg.model.moe.enabled
    return {
        "name": cfg.name,
        "arch": cfg.model.arch,
        "objective": cfg.objective.name,
        "params_total": params["total"],
        "params_non_embedding": params["non_embedding"],
        "params_embedding": params["embedding"],
        "flops_per_token": counts["flops_per_token"],
        "flops_per_token_6n": counts["flops_per_token_6n"],
        "steps": done,
        "complete": done >= cfg.train.steps,
        # What the run consumed (a study matches cells on these): document tokens read from
        # the corpus (None when resumed from a checkpoint that did not count them), positions
        # processed, loss-bearing tokens (`tokens` is the older name of `loss_tokens`).
        "document_tokens": totals.get("document_tokens"),
        "positions": totals["positions"],
        "loss_tokens": totals["tokens"],
        "tokens": totals["tokens"],
        "flops": flops,
        # 6N per position processed (D = positions: inputs and targets alike).
        "flops_6nd": counts["flops_per_token_6n"] * totals["positions"],
        "final_train_loss": last.get("train/loss"),
        "final_val_loss": final_eval.get("val/loss"),
        "best_val_loss": totals.get("best_val_loss"),
        "wall_time_s": totals["wall_time_s"],
        "tokens_per_s": this_run_tokens / max(train_time, 1e-9),
        "mfu": mfu(this_run_flops, train_time, _peak(cfg)),
        "eval": {k[len("eval/") :]: v for k, v in final_eval.items() if k.startswith("eval/")},
        # MoE layers whose router collapsed onto one expert (train/expert_load.py).
        **({"moe_load_warnings": totals.get("moe_load_warnings", {})} if moe else {}),
    }
