"""The stages after pretraining as a spec asks for them: multitask prompted finetuning
(`FinetuneConfig`) and objective/mask adaptation (`AdaptConfig`, `AdaptStage`), a study spec's
`stages:` block (`StagesSpec`), and what follows from a spec and a parent's config alone: the
finetuning settings (`finetune_settings`), the adapted run's config (`adapt_config`) and
whether its parameter tree is the parent's (`check_same_parameters`). A study's spec checks
use them before anything trains (`study/plan/spec_checks.py`); `study/run/stages.py` trains
the stages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from scalestudy.config.base import Frozen, Tuple
from scalestudy.config.errors import ScalestudyError
from scalestudy.config.experiment import Arch, ExperimentConfig, ObjectiveName
from scalestudy.config.yamlio import validate
from scalestudy.models import api


class StageError(ScalestudyError):
    """A stage cannot start from the run it was given."""


class FinetuneConfig(Frozen):
    """Multitask prompted finetuning. Defaults: Wang et al. (2022, arXiv:2204.05832v1) follow
    T0's finetuning (Sanh et al. 2021); each default names where it is stated. The optimizer
    (Adafactor, decay_rate 0.8) and z-loss (1e-4) are the parent's, restored with its state,
    as in their Table 2."""

    mixture: str | None = None  # a prompted mixture YAML (configs/prompted/*.yaml)
    arch: Arch | None = None  # refuse a parent of another architecture
    # Wang et al. Table 2: 10,000 steps of 1,310,720 tokens ("13 billion tokens", section 3.3).
    tokens: float = Field(10_000 * 1_310_720, gt=0)
    steps: int | None = Field(None, ge=1)  # overrides `tokens`
    # T0 (Sanh et al. 2021, model card "Training details"): 1,024 sequences of inputs 1,024
    # and targets 256 tokens, i.e. Wang et al.'s 1,310,720 tokens per batch (Table 2).
    batch_size: int = Field(1024, ge=1)
    inputs_length: int = Field(1024, ge=1)
    targets_length: int = Field(256, ge=1)
    learning_rate: float = Field(1e-3, gt=0)  # Wang et al. Table 2: "fixed, 0.001"
    schedule: Literal["constant", "rsqrt", "linear", "cosine"] = "constant"  # ditto
    dropout: float = Field(0.1, ge=0.0, lt=1.0)  # Wang et al. Table 2 (and appendix E.3)
    pack: bool = True  # T0 model card: "we use packing to combine multiple training examples"
    eval_tasks: Tuple = ()  # default: the mixture's held-out tasks with an `eval_task`
    eval_prompts: Literal["harness", "promptsource"] = "promptsource"  # T0: every template

    def steps_for(self) -> int:
        if self.steps is not None:
            return self.steps
        per_step = self.batch_size * (self.inputs_length + self.targets_length)
        return max(1, round(self.tokens / per_step))


class AdaptConfig(Frozen):
    """Adaptation to another objective and/or mask, for a fraction of the parent's budget."""

    arch: Arch | None = None  # the adapted model's architecture (default: the parent's)
    objective: ObjectiveName  # the adapted objective
    # Extra training as a fraction of the parent's steps (same batch and rows, so the same
    # fraction of its processed positions). Wang et al. section 5: non-causal MLM adaptation
    # of the 168B-token causal FLM model for 51B tokens (their language-modeling adaptation
    # is reported as a loss curve, with no fixed budget).
    fraction: float = Field(51 / 168, gt=0.0)
    steps: int | None = Field(None, ge=1)  # overrides `fraction`
    expect_arch: Arch | None = None  # refuse a parent of another architecture
    # After the parent's last step: "continue" its schedule (Wang et al.; a decayed rate stays
    # decayed) or "stretch" it over parent + extra steps (a decayed rate rises again).
    schedule: Literal["continue", "stretch"] = "continue"


class AdaptStage(AdaptConfig):
    """An adaptation in a study spec: which pretrained cell it starts from."""

    from_cell: Tuple  # [arch, objective] of the pretrained runs to adapt


class StagesSpec(Frozen):
    """A study spec's stages after pretraining: adaptations, then finetuning of every
    pretrained and adapted run (`study/run/after_pretraining.py` runs them)."""

    adapt: Annotated[tuple[AdaptStage, ...], Field(strict=False)] = ()
    finetune: FinetuneConfig | None = None  # its mixture path is relative to the spec
    published: str | None = None  # published numbers to print beside (relative to the spec)


def finetune_settings(spec: StagesSpec, spec_dir: Path) -> FinetuneConfig | None:
    """The spec's finetuning with its mixture path resolved against the spec's folder."""
    ft = spec.finetune
    if ft is None or ft.mixture is None:
        return ft
    mixture = Path(ft.mixture)
    if not mixture.is_absolute():
        mixture = (Path(spec_dir) / mixture).resolve()
    return ft.replace(mixture=str(mixture))


def adapt_config(
    parent_cfg: ExperimentConfig, parent: Path, parent_step: int, ad: AdaptConfig
) -> ExperimentConfig:
    """The adapted run's config: the parent's, with the new arch/objective and budget."""
    arch = ad.arch or parent_cfg.model.arch
    if not api.is_compatible_adaptation(parent_cfg.model, arch):
        raise StageError(
            f"cannot adapt a {parent_cfg.model.arch} run to {arch}: an encoder-decoder and a "
            "decoder-only model do not share parameters; adapt between causal_decoder and "
            "noncausal_decoder, or change only the objective"
        )
    extra = ad.steps or max(1, round(ad.fraction * parent_step))
    p = parent_cfg.model_dump(mode="json")
    p["name"] = f"{parent_cfg.name}-adapt-{arch}-{ad.objective}"
    p["model"]["arch"] = arch
    p["objective"]["name"] = ad.objective
    if ad.schedule == "continue":
        from scalestudy.train import optim

        p["optim"]["schedule_steps"] = optim.schedule_steps(
            parent_cfg.optim, parent_cfg.train.steps
        )
    p["train"] |= {
        "steps": parent_step + extra,
        "init_from": str(parent),
        "init_step": parent_step,
        "stop_after_steps": None,
    }
    return validate(ExperimentConfig, p, "adapt stage")


def check_same_parameters(parent_cfg: ExperimentConfig, cfg: ExperimentConfig) -> None:
    """StageError naming the first parameter whose shape differs between the two models."""
    import jax

    from scalestudy.models.api import build_model

    def shapes(c: ExperimentConfig) -> dict[str, tuple]:
        flat = jax.tree_util.tree_flatten_with_path(build_model(c.model).abstract_params())[0]
        return {jax.tree_util.keystr(k): tuple(v.shape) for k, v in flat}

    old, new = shapes(parent_cfg), shapes(cfg)
    for name in sorted(old.keys() | new.keys()):
        if old.get(name) != new.get(name) and "relpos" in name:
            raise StageError(
                f"cannot adapt a {parent_cfg.model.arch} run to {cfg.model.arch} with "
                "model.rel_prefix_buckets='mirrored': the non-causal decoder's mirrored bias "
                f"table has a half for future keys that the causal one lacks ({name} is "
                f"{old.get(name)} vs {new.get(name)}); train both with "
                "model.rel_prefix_buckets=causal (Wang et al.'s decoder-only layout, one table "
                "for both masks), or model.position rope or none"
            )
        if old.get(name) != new.get(name):
            raise StageError(
                f"cannot adapt a {parent_cfg.model.arch} run to {cfg.model.arch}: parameter "
                f"{name} is {old.get(name)} in the parent and {new.get(name)} in the adapted "
                f"model (model.position={parent_cfg.model.position!r}); adapt between models "
                "whose parameters match, e.g. with model.position rope or none"
            )
