"""Ahead-of-time plans for every train-step shape of a study: pretraining and its stages.

`scalestudy compile --spec STUDY [--topology T]` compiles (never runs) the train step once per
distinct shape the study will train: each pretraining run's, and each stage's after it
(adaptation to another architecture/objective; multitask finetuning at its own lengths and
batch, e.g. Wang et al.'s 1,024 + 256 tokens x 1,024 rows), so a launch learns before the
hardware exists whether every stage fits, not only pretraining. Runs sharing a shape (same
model, feature lengths, batch, microbatches and mesh) share one plan.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scalestudy.config.experiment import ExperimentConfig
from scalestudy.data.objectives import feature_lengths
from scalestudy.study.run import after_pretraining, main_job


def _key(cfg: ExperimentConfig) -> str:
    lengths = feature_lengths(cfg.objective, cfg.model.is_encoder_decoder)
    model = cfg.model.model_dump(mode="json")
    # What changes the compiled program: the model, the batch's shapes, accumulation, mesh.
    shape = [model, lengths, cfg.train.batch_size, cfg.train.microbatches]
    return json.dumps([*shape, cfg.mesh.model_dump(mode="json")], sort_keys=True)


def study_shapes(
    spec: str | Path, overrides: list[str] | tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """The distinct train-step shapes of a study spec, pretraining first, then each stage's:
    {stage, cells, runs, encoder_length, decoder_length, batch, cfg} (cfg: one run's config;
    stage and cells: every stage and arch/objective sharing the shape)."""
    spec = Path(spec)
    study = main_job.load_study(spec, overrides)
    runs = main_job.expand(study, spec.parent)
    staged = [(r.cfg, "pretrain") for r in runs]
    staged += [
        (s.cfg, s.stage) for s in after_pretraining.plan_stages(study, spec.parent, Path("."), runs)
    ]
    shapes: dict[str, dict[str, Any]] = {}
    for cfg, stage in staged:
        entry = shapes.get(_key(cfg))
        cell = f"{cfg.model.arch}/{cfg.objective.name}"
        if entry is None:
            encoder, decoder = feature_lengths(cfg.objective, cfg.model.is_encoder_decoder)
            shapes[_key(cfg)] = {
                "stage": stage,
                "cells": cell,
                "runs": 1,
                "encoder_length": encoder,
                "decoder_length": decoder,
                "batch": cfg.train.batch_size,
                "cfg": cfg,
            }
        else:
            entry["runs"] += 1
            if stage not in entry["stage"].split("+"):
                entry["stage"] += f"+{stage}"
            if cell not in entry["cells"].split(", "):
                entry["cells"] += f", {cell}"
    return list(shapes.values())


def compile_study(
    spec: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    topology: str | None = None,
    costs: bool = True,
) -> list[dict[str, Any]]:
    """`train/aot.compile_plan` for every distinct shape of the study (see `study_shapes`);
    `costs=False`: memory and fit only."""
    from scalestudy.train.plan.aot import compile_plan

    plans = []
    for shape in study_shapes(spec, overrides):
        cfg = shape.pop("cfg")
        plans.append({**shape, **compile_plan(cfg, topology=topology, costs=costs)})
    return plans
