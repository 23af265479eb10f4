"""Stages after pretraining: multitask prompted finetuning and objective/mask adaptation.

Both continue one finished run (`--from RUN`) in a new run directory through the training
loop's `train.init_from`: parameters, optimizer state and step come from the parent's final
checkpoint, the data stream is the stage's own (a branch on other data starts its stream
fresh), and the step count goes on from the parent's, as T5X continues a run.

- finetune: the parent's model on a seqio Mixture of prompted tasks (`data/prompted.py`) as
  (inputs, targets) examples (the prefix-LM features each architecture already reads: loss on
  the targets only), then zero-shot evaluation on the mixture's held-out tasks.
- adapt: the parent's weights under another objective and/or mask (non-causal MLM -> causal
  FLM, causal FLM -> non-causal MLM), for a fraction of the parent's budget.

Every check runs before anything is written: a `--from` run that is missing, unfinished or of
another architecture than the stage expects, an empty mixture, a held-out task in the training
mixture, a template rendering empty, an adaptation between incompatible architectures (a
study's stages meet them when its spec is read: study/plan/spec_checks.py). The stage writes
`stage.json` (lineage: parent run and step, its settings), and the same in `summary.json`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field

from scalestudy.config.base import Frozen, Tuple
from scalestudy.config.errors import ConfigError, ScalestudyError
from scalestudy.config.experiment import Arch, ExperimentConfig, ObjectiveName
from scalestudy.config.yamlio import apply_overrides, validate
from scalestudy.models import api

STAGE_FILE = "stage.json"


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


# ----------------------------------------------------------------------------- parents


def finished_parent(run: Path, expect_arch: str | None = None) -> tuple[ExperimentConfig, int]:
    """(config, final step) of a finished run directory; StageError otherwise."""
    from scalestudy.train.rundir import saved_run

    run = Path(run)
    if not run.is_dir():
        raise StageError(f"--from {run}: no such run directory")
    step = saved_run.latest_step(run)
    if step is None:
        raise StageError(f"--from {run}: no checkpoint there; train the run first")
    cfg = saved_run.load_config(run, step)
    if step < cfg.train.steps or not (run / "summary.json").is_file():
        raise StageError(
            f"--from {run} is unfinished (latest checkpoint at step {step} of "
            f"{cfg.train.steps}); finish it first (`scalestudy train --workdir {run}`)"
        )
    if expect_arch is not None and cfg.model.arch != expect_arch:
        raise StageError(
            f"--from {run} is a {cfg.model.arch} run but this stage expects {expect_arch}; "
            "give a run of that architecture or change the stage's arch"
        )
    return cfg, step


def _check_out(out: Path, parent: Path) -> None:
    if out.resolve() == parent.resolve():
        raise StageError(f"--out {out} is the parent run itself; give a new directory")
    if out.exists() and not out.is_dir():
        raise StageError(f"--out {out} is a file; give a directory")


def split_overrides(overrides: list[str] | tuple[str, ...], stage_keys: set[str]):
    """(stage overrides, run overrides): keys naming a stage field go to the stage."""
    stage, run = [], []
    for item in overrides:
        key = item.partition("=")[0].split(".")[0]
        (stage if key in stage_keys else run).append(item)
    return stage, run


def _apply(cfg: ExperimentConfig, overrides: list[str]) -> ExperimentConfig:
    data = apply_overrides(cfg.model_dump(mode="json"), overrides, ExperimentConfig)
    return validate(ExperimentConfig, data, "overrides")


# ----------------------------------------------------------------------------- finetune


def finetune_config(
    parent_cfg: ExperimentConfig,
    parent: Path,
    parent_step: int,
    ft: FinetuneConfig,
    mixture_name: str,
    eval_data_dir: str | None,
    eval_tasks: tuple[str, ...],
) -> ExperimentConfig:
    """The finetuning run's config: the parent's model and optimizer, the stage's data."""
    p = parent_cfg.model_dump(mode="json")
    p["name"] = f"{parent_cfg.name}-ft"
    p["model"]["dropout"] = ft.dropout
    p["data"] |= {"source": "seqio", "seqio_task": mixture_name, "seqio_module": None}
    p["objective"] |= {
        "name": "plm",  # (inputs, targets) pairs: each architecture's prefix-LM features
        "plm_split": "fit",
        "inputs_length": ft.inputs_length,
        "targets_length": ft.targets_length,
        "pack": ft.pack,
    }
    # The optimizer itself stays the parent's: its state is restored with the weights.
    p["optim"] |= {"learning_rate": ft.learning_rate, "schedule": ft.schedule, "warmup_steps": 0}
    p["train"] |= {
        "steps": parent_step + ft.steps_for(),
        "batch_size": ft.batch_size,
        # The parent's gradient accumulation where it divides the stage's batch (memory).
        "microbatches": m if ft.batch_size % (m := parent_cfg.train.microbatches) == 0 else 1,
        "init_from": str(parent),
        "init_step": parent_step,
        "stop_after_steps": None,
    }
    p["eval"] |= {
        "tasks": list(eval_tasks),
        "prompts": ft.eval_prompts,
        "data_dir": parent_cfg.eval.data_dir or eval_data_dir,
        "inputs_length": None,
        "targets_length": None,
        "every_steps": 0,
    }
    return validate(ExperimentConfig, p, "finetune stage")


def prepare_finetune(
    parent: Path,
    out: Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    settings: FinetuneConfig | None = None,
) -> tuple[ExperimentConfig, dict]:
    """Check everything and build the finetuning config (`settings`, then stage keys of
    `overrides`; the other keys of `overrides` apply to the run's config); writes nothing.

    Returns (config, stage record). Registers the mixture's seqio Tasks in this process.
    """
    from scalestudy.data import require_seqio

    require_seqio("finetune (its prompted mixture is a seqio Mixture)")
    from scalestudy.data import prompted, prompted_seqio

    stage_over, run_over = split_overrides(overrides, set(FinetuneConfig.model_fields))
    base = settings.model_dump(mode="json") if settings is not None else {}
    given = apply_overrides(base, stage_over, FinetuneConfig)
    ft = validate(FinetuneConfig, given, "finetune overrides")
    if ft.mixture is None:
        raise ConfigError(
            "finetune: no mixture given; set mixture=PATH to a prompted mixture YAML "
            "(e.g. mixture=configs/prompted/t0_cpu.yaml)"
        )
    parent, out = Path(parent), Path(out)
    _check_out(out, parent)
    parent_cfg, step = finished_parent(parent, ft.arch)
    mixture = prompted.load_mixture(ft.mixture)
    prompted.check_mixture(mixture)
    for task in mixture.train_tasks:  # renders every template now: empty ones fail here
        prompted.examples(mixture, task.name, "train")
    eval_tasks = prompted.zero_shot_tasks(mixture, ft.eval_tasks)
    data_dir = None
    if mixture.data_dir is not None:
        data_dir = str(prompted.resolve_path(".", mixture.data_dir, mixture.base_dir))
    cfg = finetune_config(
        parent_cfg, parent, step, ft, prompted.mixture_name(mixture), data_dir, eval_tasks
    )
    cfg = _apply(cfg, run_over)
    prompted_seqio.register_mixture(mixture, cfg)
    record = {
        "stage": "finetune",
        "parent": str(parent.resolve()),
        "parent_step": step,
        "parent_arch": parent_cfg.model.arch,
        "parent_objective": parent_cfg.objective.name,
        "mixture": mixture.name,
        "mixture_fingerprint": prompted.fingerprint(mixture),
        "train_tasks": [t.name for t in mixture.train_tasks],
        "held_out_tasks": [t.name for t in mixture.held_out_tasks],
        "eval_tasks": list(eval_tasks),
        "settings": ft.model_dump(mode="json"),
    }
    return cfg, record


# ----------------------------------------------------------------------------- adapt


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


def prepare_adapt(
    parent: Path,
    out: Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    settings: AdaptConfig | None = None,
) -> tuple[ExperimentConfig, dict]:
    """Check everything and build the adapted run's config (as `prepare_finetune`)."""
    stage_over, run_over = split_overrides(overrides, set(AdaptConfig.model_fields))
    base = (
        settings.model_dump(mode="json", include=set(AdaptConfig.model_fields)) if settings else {}
    )
    ad = validate(AdaptConfig, apply_overrides(base, stage_over, AdaptConfig), "adapt overrides")
    parent, out = Path(parent), Path(out)
    _check_out(out, parent)
    parent_cfg, step = finished_parent(parent, ad.expect_arch)
    cfg = _apply(adapt_config(parent_cfg, parent, step, ad), run_over)
    check_same_parameters(parent_cfg, cfg)
    record = {
        "stage": "adapt",
        "parent": str(parent.resolve()),
        "parent_step": step,
        "parent_arch": parent_cfg.model.arch,
        "parent_objective": parent_cfg.objective.name,
        "arch": cfg.model.arch,
        "objective": cfg.objective.name,
        "extra_steps": cfg.train.steps - step,
        "settings": ad.model_dump(mode="json"),
    }
    return cfg, record


# ----------------------------------------------------------------------------- running


def run_stage(cfg: ExperimentConfig, record: dict, out: Path, *, evaluate: bool) -> dict[str, Any]:
    """Train the stage's run in `out` (resuming it when interrupted); record its lineage."""
    from scalestudy.train.loop import train
    from scalestudy.train.rundir import logfile

    out = Path(out)
    eval_fn = None
    if evaluate and cfg.eval.tasks:
        from scalestudy.evaluate.rank import make_eval_fn

        eval_fn = make_eval_fn(cfg, out)
        before = (read_lineage(out) or {}).get("eval_before")
        if before is None:  # the parent zero-shot with the very same tasks, prompts, lengths
            with logfile.library_logs_dropped():  # the stage's run has no log yet
                before = _evaluate_parent(cfg, record)
        record = {**record, "eval_before": before}
    summary = train(cfg, out, eval_fn=eval_fn)
    lineage = {k: record[k] for k in ("stage", "parent", "parent_step")}
    _write_json(out / STAGE_FILE, record)
    if summary.get("lineage") != lineage:
        summary = {**summary, "lineage": lineage}
        _write_json(out / "summary.json", summary)
    return summary


def _evaluate_parent(cfg: ExperimentConfig, record: dict) -> dict[str, float] | None:
    """The parent zero-shot as its own run: in the form it was trained in (its architecture
    and objective's input form: span corruption's EOS), on the stage run's very tasks,
    prompts and scoring lengths."""
    from scalestudy.evaluate.rank import make_eval_fn
    from scalestudy.models.api import build_model
    from scalestudy.train.rundir.saved_run import restore_params

    parent_cfg, params, step = restore_params(Path(record["parent"]), record["parent_step"])
    lengths = {
        "inputs_length": cfg.eval.inputs_length or cfg.objective.inputs_length,
        "targets_length": cfg.eval.targets_length or cfg.objective.targets_length,
    }
    parent_cfg = parent_cfg.replace(eval=cfg.eval.replace(**lengths))
    eval_fn = make_eval_fn(parent_cfg)
    if eval_fn is None:  # an objective rank classification cannot score (said on stderr)
        return None
    return dict(eval_fn(build_model(parent_cfg.model), params, step))


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    tmp.replace(path)


def read_lineage(run: Path) -> dict | None:
    """The stage record of a run directory (None for a pretraining run)."""
    path = Path(run) / STAGE_FILE
    return json.loads(path.read_text()) if path.is_file() else None
