"""The load warning of mixture-of-experts layers: a router that sends (nearly) every token to
one expert is reported, once per layer, instead of training on silently.

Each logged training row carries, per MoE layer, `moe/<layer>/load_max`: the busiest expert's
assignments over the mean assignments per expert, on that step's batch. With E routed experts
and K chosen per token, the busiest expert was chosen by `load_max * K / E` of the tokens (1:
every token). A layer whose busiest expert is chosen by more than `COLLAPSE_SHARE` of the tokens
in a logged row has collapsed: one `warning:` line names the layer, the step and the share, and
the run's summary keeps it under "moe_load_warnings" (in the run's totals, so a resumed run
neither repeats nor forgets it). Layers with K > E / 2 are not watched (`watched`).
"""

from __future__ import annotations

import warnings
from typing import Any

from scalestudy.config.moe_config import MoEConfig

# A layer has collapsed when its busiest expert is chosen by more than this share of tokens.
COLLAPSE_SHARE = 0.9
TOTALS_KEY = "moe_load_warnings"  # in the run's totals and summary: layer -> what was seen


def busiest_share(load_max: float, moe: MoEConfig) -> float:
    """The share of tokens that chose the busiest expert, from its load over the mean load."""
    return load_max * moe.top_k / moe.routed_experts


def watched(moe: MoEConfig) -> bool:
    """Whether the layers of `moe` can collapse visibly (K <= E / 2)."""
    # Not with K > E / 2: there every expert already sees more than half the tokens when the
    # load is balanced.
    return moe.enabled and 2 * moe.top_k <= moe.routed_experts


class LoadWatch:
    """Called with each logged metrics row; warns once per collapsed MoE layer and records it
    in `totals[TOTALS_KEY]`."""

    def __init__(self, moe: MoEConfig, totals: dict[str, Any]):
        self.moe = moe
        self.seen: dict[str, dict[str, float]] = totals.setdefault(TOTALS_KEY, {})

    def __call__(self, step: int, row: dict[str, Any]) -> None:
        for key, value in row.items():
            if not (key.startswith("moe/") and key.endswith("/load_max")):
                continue
            layer = key[len("moe/") : -len("/load_max")]
            share = busiest_share(float(value), self.moe)
            if layer in self.seen or not share > COLLAPSE_SHARE:
                continue
            self.seen[layer] = {"step": int(step), "load_max": float(value), "share": share}
            warnings.warn(
                f"MoE layer {layer} at step {step}: its busiest expert was chosen by "
                f"{share:.0%} of the tokens (load max/mean {float(value):.2f}; balanced: 1, "
                f"warned above {COLLAPSE_SHARE:.0%} of the tokens): the router has collapsed "
                f"onto one expert. Balance it harder ({self._remedy()}) or check the learning "
                "rate",
                stacklevel=2,
            )

    def _remedy(self) -> str:
        if self.moe.router == "deepseek":
            return "a larger model.moe.bias_rate or model.moe.balance_loss"
        return "a larger model.moe.load_balance_loss"
