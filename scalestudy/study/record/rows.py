"""What leaves the study registry: one typed record per run (`RunRow`), built from the
registry's row in one place (`RunRow.from_row`), one per logged step of a run's curve
(`CurvePoint`), and the readers that give them (`read_rows`, `read_planned`, `read_curves`).

A `RunRow` holds the run's columns (study/record/registry_schema.py `RUN_COLUMNS`, but its
config text), `recipe` (the config keys of how it was trained, study/plan/recipe.py) and
`evals`, its final `eval/<task>/<metric>` scores in the registry's order. `value` reads a
column or a score by name, for the code that picks what to read at run time (the x of a
comparison, a metric); `as_dict` is the flat row again, for what leaves the package as a
table (the scaling library's `RunTable`, written as fits.json and figures).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scalestudy.study.plan.recipe import recipe
from scalestudy.study.record.registry import load_curves, load_runs, planned_runs


@dataclass(frozen=True)
class RunRow:
    """One run of a study and its summary, as the registry holds it (None: not recorded)."""

    run_id: str = ""
    study: str | None = None
    name: str | None = None
    arch: str = ""
    objective: str = ""
    size: str | None = None
    size_index: int | None = None
    budget: str | None = None
    seed: int | None = None
    matching: str | None = None
    status: str | None = None
    workdir: str | None = None
    d_model: int | None = None
    n_layers: int | None = None
    n_encoder_layers: int | None = None
    n_heads: int | None = None
    d_ff: int | None = None
    params_total: int | None = None
    params_non_embedding: int | None = None
    params_embedding: int | None = None
    flops_per_token: float | None = None
    flops_per_example: float | None = None
    positions_per_example: int | None = None
    batch_size: int | None = None
    steps: int | None = None
    planned_flops: float | None = None
    tokens: float | None = None
    positions: float | None = None
    flops: float | None = None
    flops_6nd: float | None = None
    document_tokens: float | None = None
    loss_tokens: float | None = None
    planned_document_tokens: float | None = None
    inference_flops_per_token: float | None = None
    inference_context: int | None = None
    data_seed: int | None = None
    loss: float | None = None  # final validation loss
    train_loss: float | None = None
    best_val_loss: float | None = None
    wall_time_s: float | None = None
    created_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    stage: str | None = None
    parent_run_id: str | None = None
    parent_step: int | None = None
    matches_run_id: str | None = None
    params_active: int | None = None
    experts: int | None = None
    granularity: float | None = None
    planned: int | None = None
    recipe: Mapping[str, Any] = field(default_factory=dict)
    evals: Mapping[str, float | None] = field(default_factory=dict)
    # Per-run numbers a report derives (e.g. `incontext_gain/<task>`), read by `value`.
    derived: Mapping[str, float] = field(default_factory=dict)
    # The run's resolved config (YAML text) where the reader kept it; not part of `as_dict`.
    config: str | None = field(default=None, repr=False)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> RunRow:
        """The record of a registry row: its columns, `recipe` (or the recipe of its
        `config`) and its `eval/...` scores; other keys are refused."""
        names = {f.name for f in dataclasses.fields(cls)} - {"evals", "derived"}
        evals = {k: v for k, v in row.items() if k.startswith("eval/")}
        unknown = [k for k in row if k not in names and k not in evals]
        if unknown:
            raise KeyError(f"not a run column: {', '.join(unknown)}")
        known = {k: v for k, v in row.items() if k in names}
        if "recipe" not in known:
            known["recipe"] = recipe(known.get("config"))
        return cls(**known, evals=evals)

    def value(self, key: str) -> Any:
        """A column, score (`eval/...`) or derived number by name; None where absent."""
        if key.startswith("eval/"):
            return self.evals.get(key)
        if key in self.derived:
            return self.derived[key]
        if key in FIELD_NAMES:
            return getattr(self, key)
        return None

    def as_dict(self) -> dict[str, Any]:
        """The flat row as the registry's reader gives it (`registry.load_runs`): the columns,
        `recipe` and the scores, for a table that leaves the package."""
        out: dict[str, Any] = {k: getattr(self, k) for k in COLUMN_NAMES}
        out["recipe"] = dict(self.recipe)
        return out | dict(self.evals)

    def replace(self, **changes: Any) -> RunRow:
        """A copy with `changes` (frozen records change by copy)."""
        return dataclasses.replace(self, **changes)

    @property
    def cell(self) -> str:
        """The run's cell, with its variant when it has one ("arch/objective[/variant]": a
        study's variants, e.g. dense and MoE, are cells of their own in its report)."""
        parts = str(self.name or "").split(".")[1:]  # study.arch.objective[.variant]...
        variant = parts[2] if len(parts) > 2 and parts[2] != self.size else ""
        cell = f"{self.arch}/{self.objective}"
        return f"{cell}/{variant}" if variant else cell

    @property
    def moe(self) -> bool:
        """Whether the run is a mixture-of-experts model (more than one routed expert)."""
        return (self.experts or 1) > 1


FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(RunRow))
# The registry's columns a record carries, in the registry's order (its config text aside).
COLUMN_NAMES = tuple(
    f.name
    for f in dataclasses.fields(RunRow)
    if f.name not in ("recipe", "evals", "derived", "config")
)


def has_experts(rows: list[RunRow]) -> bool:
    """Whether any of `rows` is a mixture-of-experts model."""
    return any(r.moe for r in rows)


def read_rows(path: str | Path, *, stages: bool = False) -> list[RunRow]:
    """Every pretraining run of a study (a registry file or a study directory) as records;
    with `stages`, the stage runs too (`registry.load_runs`)."""
    return [RunRow.from_row(row) for row in load_runs(path, stages=stages)]


def read_planned(path: str | Path, *, every: bool = False) -> tuple[list[RunRow], list[str]]:
    """The runs the spec the study last ran with plans, as records, and the sorted names of
    the rest (`registry.planned_runs`; with `every`, all of them)."""
    rows, gone = planned_runs(load_runs(path), every=every)
    return [RunRow.from_row(row) for row in rows], gone


@dataclass(frozen=True)
class CurvePoint:
    """One logged step of a run's training curve (`registry.load_curves`): the run and its
    cell, size, seed and parameters; the step, tokens, positions and FLOPs so far; training
    loss at the step and validation loss (None where not evaluated)."""

    run_id: str
    arch: str
    objective: str
    size: str | None
    seed: int | None
    params_total: int | None
    params_non_embedding: int | None
    step: int
    tokens: float | None
    positions: float | None
    flops: float | None
    loss: float | None
    val_loss: float | None


def read_curves(path: str | Path, run_ids: set[str] | None = None) -> list[CurvePoint]:
    """Every logged step of a study's pretraining runs (of `run_ids` only, when given)."""
    points = [CurvePoint(**point) for point in load_curves(path)]
    return points if run_ids is None else [p for p in points if p.run_id in run_ids]
