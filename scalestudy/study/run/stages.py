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
study's stages meet them when its spec is read: study/plan/spec_checks.py). The settings and
the adapted config follow from the spec alone (study/plan/stages_spec.py). The stage writes
`stage.json` (lineage: parent run and step, its settings), and the same in `summary.json`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import ExperimentConfig
from scalestudy.config.yamlio import apply_overrides, validate
from scalestudy.study.plan.stages_spec import (
    AdaptConfig,
    FinetuneConfig,
    StageError,
    adapt_config,
    check_same_parameters,
)
from scalestudy.study.record.lineage import STAGE_FILE, read_lineage

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
