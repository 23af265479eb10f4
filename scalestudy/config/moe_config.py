"""The `model.moe` section: mixture-of-experts feed-forward layers (models/moe.py).

Off by default (`enabled: false`), and then left out of dumps, so dense configs and their run
ids are unchanged. `ModelConfig` checks it against the rest of the model (`check`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from scalestudy.config.base import Frozen
from scalestudy.config.errors import ConfigError


class MoEConfig(Frozen):
    """Routed and shared experts replacing the dense MLP of every `every`-th layer."""

    enabled: bool = False
    routed_experts: int = 8  # N_r
    shared_experts: int = 0  # N_s, always applied (DeepSeek-V3)
    top_k: int = 2  # K_r: routed experts per token
    # Hidden width of each expert (routed and shared); default model.d_ff. The granularity G of
    # Krajewski et al. (2024) is d_ff / d_expert; `granularity` gives G instead of a width
    # (experts d_ff / G wide at every size of a ladder), never both. Left out of dumps when
    # unset, so the run ids of MoE runs from before it existed are unchanged.
    d_expert: int | None = None
    granularity: int | None = Field(None, exclude_if=lambda v: v is None)
    # Layer i (0-based) of the decoder-only stack, or of the encoder-decoder's decoder, is an
    # MoE layer when (i + 1) % every == 0 (1: all, 2: every second, 0: none); `encoder_every`
    # is the same for the encoder-decoder's encoder (default: `every`).
    every: int = 1
    encoder_every: int | None = None
    # deepseek: sigmoid affinities, top-k on affinity + balancing bias, gates normalised to sum
    # 1; switch: softmax router, top-k (gates renormalised when k > 1), load-balancing loss and
    # router z-loss (models/moe.py).
    router: Literal["deepseek", "switch"] = "deepseek"
    # dropless: every assignment computed (tokens grouped by expert); capacity: fixed slots
    # per expert, ceil(capacity_factor * tokens * top_k / routed_experts), overflow dropped.
    dispatch: Literal["dropless", "capacity"] = "dropless"
    capacity_factor: float = 1.25
    # deepseek: the balancing bias moves by bias_rate * sign(mean load - load) after each step
    # (gamma; 0: never), and the sequence-wise balance loss's coefficient (alpha).
    bias_rate: float = Field(1e-3, ge=0.0)
    balance_loss: float = Field(1e-4, ge=0.0)
    # switch: the load-balancing loss's coefficient and the router z-loss's.
    load_balance_loss: float = Field(1e-2, ge=0.0)
    router_z_loss: float = Field(1e-3, ge=0.0)

    def width(self, d_ff: int) -> int:
        """Each expert's hidden width."""
        if self.granularity is not None:
            return d_ff // self.granularity
        return self.d_expert if self.d_expert is not None else d_ff

    def stack_every(self, stack: str) -> int:
        """The `every` of stack "decoder" or "encoder"."""
        if stack == "encoder" and self.encoder_every is not None:
            return self.encoder_every
        return self.every

    def layers(self, stack: str, n_layers: int) -> tuple[int, ...]:
        """Indices of the MoE layers of a stack of `n_layers` ("decoder" or "encoder")."""
        if not self.enabled:
            return ()
        k = self.stack_every(stack)
        return tuple(i for i in range(n_layers) if k and (i + 1) % k == 0)

    def check(self, depths: dict[str, int], encoder_decoder: bool, d_ff: int) -> None:
        """Raise ConfigError on an impossible section; `depths` maps stack name to depth,
        `d_ff` is the dense MLP's width."""
        if not self.enabled:
            given = sorted(self.model_fields_set - {"enabled"})
            if given:
                raise ConfigError(
                    f"model.moe.{given[0]} is set but model.moe.enabled is false (a dense "
                    f"model); set model.moe.enabled=true, or remove model.moe.{', '.join(given)}"
                )
            return
        n, k = self.routed_experts, self.top_k
        if n < 1:
            raise ConfigError(
                f"model.moe.routed_experts={n}: an MoE layer needs at least 1 routed expert; "
                "give routed_experts >= 1 (or model.moe.enabled=false for a dense model)"
            )
        if self.shared_experts < 0:
            raise ConfigError(f"model.moe.shared_experts={self.shared_experts}; give 0 or more")
        if not 1 <= k <= n:
            raise ConfigError(
                f"model.moe.top_k={k} with model.moe.routed_experts={n}: each token chooses "
                f"top_k distinct routed experts; give 1 <= top_k <= {n}"
            )
        if self.d_expert is not None and self.d_expert < 1:
            raise ConfigError(f"model.moe.d_expert={self.d_expert}; give a width >= 1")
        if (g := self.granularity) is not None:
            if self.d_expert is not None:
                raise ConfigError(
                    f"model.moe.granularity={g} and model.moe.d_expert={self.d_expert} both "
                    "set each expert's width; give one (granularity G: d_ff / G)"
                )
            if g < 1 or d_ff % g:
                raise ConfigError(
                    f"model.moe.granularity={g} with model.d_ff={d_ff}: experts are d_ff / G "
                    f"wide, so G must be a divisor of d_ff >= 1 (e.g. 1, 2, 4 where d_ff allows)"
                )
        if not self.capacity_factor > 0:
            raise ConfigError(
                f"model.moe.capacity_factor={self.capacity_factor}: the slots per expert are "
                "capacity_factor * tokens * top_k / routed_experts; give a factor > 0 "
                "(1.0: exactly a balanced load; 1.25 is usual)"
            )
        if self.every < 0 or (self.encoder_every or 0) < 0:
            raise ConfigError(
                f"model.moe.every={self.every}, encoder_every={self.encoder_every}: give 0 "
                "(no MoE layer in that stack), 1 (every layer) or k (every k-th layer)"
            )
        if self.encoder_every is not None and not encoder_decoder:
            raise ConfigError(
                f"model.moe.encoder_every={self.encoder_every} is only meaningful for arch "
                "'encoder_decoder' (a decoder-only model has one stack: use model.moe.every)"
            )
        if not any(self.layers(s, d) for s, d in depths.items()):
            raise ConfigError(
                f"model.moe.every={self.every} (encoder_every={self.encoder_every}) selects no "
                f"layer of stacks {depths}; give every <= the depth, or model.moe.enabled=false"
            )

    def check_expert_axis(self, expert: int) -> None:
        """An explicit mesh.expert must split the routed experts evenly (sharding.py checks
        the resolved mesh again)."""
        if expert in (-1, 1):
            return
        if not self.enabled:
            raise ConfigError(
                f"mesh.expert={expert} splits routed experts, but model.moe.enabled is false; "
                "use mesh.data for data parallelism, or enable model.moe"
            )
        if self.routed_experts % expert:
            raise ConfigError(
                f"mesh.expert={expert} does not divide model.moe.routed_experts="
                f"{self.routed_experts}; choose an expert axis size dividing it"
            )
