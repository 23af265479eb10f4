"""Study specs expanded into runs with stable ids, and the main job `scalestudy study`.

`expand(study)` turns a StudySpec into one PlannedRun per (size, cell, budget point, seed), in
that order (size-major, so a study stopped early still holds complete grids at small sizes).
A run's id is the hash of its resolved ExperimentConfig, so re-expanding the same spec gives the
same ids and a changed config gives a new run. `run_study` records the plan in the registry,
trains what is missing (resuming unfinished runs from their checkpoints), then fits, plots and
writes the report.

Kept whole: a run's id is made where the spec is expanded, and the main job reads the runs in
the order expansion gives them; the two are one contract.
"""

from __future__ import annotations

import itertools
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import (
    VALID_CELLS,
    ExperimentConfig,
    ModelConfig,
    OptimConfig,
    to_yaml,
)
from scalestudy.config.yamlio import apply_overrides, deep_merge, read_yaml, validate
from scalestudy.models import counting
from scalestudy.study.plan import groups, ladder, spec_checks
from scalestudy.study.plan import matching as matched
from scalestudy.study.plan.spec import BudgetConfig, StudySpec
from scalestudy.study.record.phases import phase
from scalestudy.study.record.registry import Registry
from scalestudy.study.report import page as report
from scalestudy.study.run import executors, lr_search
from scalestudy.study.run.lock import study_lock

REGISTRY_NAME = "registry.sqlite"


@dataclass(frozen=True)
class PlannedRun:
    """One run of a study: its resolved config and the numbers matched comparisons need."""

    run_id: str
    cfg: ExperimentConfig
    size: str
    size_index: int
    budget: str
    seed: int
    matching: str
    params: dict[str, int]
    flops: dict[str, Any]
    variant: str = ""  # the spec's variant name; "" without variants
    context: int = 0  # the context length its inference cost is stated at

    @property
    def arch(self) -> str:
        return self.cfg.model.arch

    @property
    def objective(self) -> str:
        return self.cfg.objective.name

    @property
    def dirname(self) -> str:
        return f"{self.cfg.name}-{self.run_id}"

    @property
    def planned_flops(self) -> float:
        return self.cfg.train.steps * self.cfg.train.batch_size * self.flops["flops_per_example"]

    def row(self, study: str, workdir: Path) -> dict[str, Any]:
        """The registry row planned for this run (status pending)."""
        m = self.cfg.model
        return {
            "run_id": self.run_id,
            "study": study,
            "name": self.cfg.name,
            "arch": self.arch,
            "objective": self.objective,
            "size": self.size,
            "size_index": self.size_index,
            "budget": self.budget,
            "seed": self.seed,
            "matching": self.matching,
            "workdir": str(workdir),
            "config": to_yaml(self.cfg),
            "d_model": m.d_model,
            "n_layers": m.n_layers,
            "n_encoder_layers": m.encoder_layers if m.is_encoder_decoder else None,
            "n_heads": m.n_heads,
            "d_ff": m.d_ff,
            "params_total": self.params["total"],
            "params_non_embedding": self.params["non_embedding"],
            "params_embedding": self.params["embedding"],
            "params_active": self.params["active_non_embedding"],
            "experts": m.moe.routed_experts if m.moe.enabled else 1,
            "granularity": m.d_ff / m.moe.width(m.d_ff) if m.moe.enabled else 1.0,
            "flops_per_token": self.flops["flops_per_token"],
            "flops_per_example": self.flops["flops_per_example"],
            "positions_per_example": self.flops["positions_per_example"],
            "batch_size": self.cfg.train.batch_size,
            "steps": self.cfg.train.steps,
            "planned_flops": self.planned_flops,
            "data_seed": self.cfg.data.seed,
            **matched.planned_counts(self.cfg, self.context or self.cfg.objective.decoder_length),
        }


def load_study(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> StudySpec:
    """Read and validate a study spec YAML (with `include:` and dotted overrides).

    Without a `budget:` section every run trains the base experiment's `train.steps`.
    Fit laws and evaluation task names are checked here, so a typo fails `--dry-run`
    rather than a finished study's report.
    """
    path = Path(path)
    data = apply_overrides(read_yaml(path), overrides, StudySpec)
    study = validate(StudySpec, data, str(path))
    base = base_config(study, path.parent)
    steps = base.get("train", {}).get("steps") if isinstance(base.get("train"), dict) else None
    if "budget" not in data and steps is not None:
        budget = validate(BudgetConfig, {"kind": "steps", "steps": steps}, "base.train.steps")
        study = study.replace(budget=budget)
    eval_section = base.get("eval") if isinstance(base.get("eval"), dict) else {}
    grid = cells(study)
    labels = ["/".join((*cell, v.name) if v else cell) for cell, v in _cell_variants(study, grid)]
    try:
        spec_checks.check_spec(study, path.parent, eval_section, grid, labels)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return study


def base_config(study: StudySpec, spec_dir: Path | None = None) -> dict:
    """The study's base experiment as a dict: base_config file, then inline `base` keys."""
    data: dict = {}
    for name in study.base_config:
        path = Path(name)
        path = path if path.is_absolute() or spec_dir is None else spec_dir / path
        data = deep_merge(data, read_yaml(path))
    data = deep_merge(data, dict(study.base))
    if study.tasks:
        data = deep_merge(data, {"eval": {"tasks": list(study.tasks)}})
    return data


def cells(study: StudySpec) -> list[tuple[str, str]]:
    """The (arch, objective) cells of a study, in the order the spec gives them."""
    if study.cells:
        return [tuple(c) for c in study.cells]
    return [(a, o) for a in study.archs for o in study.objectives if o in VALID_CELLS[a]]


def expand(study: StudySpec, spec_dir: Path | None = None, rates: Any = None) -> list[PlannedRun]:
    """Every run of the study, size-major, with stable ids (the resolved config's hash).
    `rates((arch, objective, variant, size, budget))`, where given and not None, replaces
    `optim.learning_rate` before the ladder's rule (study/run/lr_search.py)."""
    base = base_config(study, spec_dir)
    base_model = validate(ModelConfig, base.get("model", {}), "base.model")
    rungs = ladder.resolve_ladder(study.ladder, spec_dir, base_model.activation)
    grid = cells(study)
    if not grid:
        raise ConfigError(
            f"the study has no valid cells: archs={list(study.archs)}, "
            f"objectives={list(study.objectives)}"
        )
    names = [r.name for r in rungs]
    sizes_of, seeds_of = _cell_sizes(study, grid, names), _size_seeds(study, names)
    _size_names("budget.steps_per_size", tuple(study.budget.steps_per_size), names)
    _check_cell_base(study, grid)
    context = matched.context_for(study, base)
    runs: list[PlannedRun] = []
    points = [
        (i, rung, tag, compute, seed)
        for (i, rung), (tag, compute) in itertools.product(
            enumerate(rungs), ladder.budget_points(study.budget)
        )
        for seed in seeds_of[rung.name]
    ]
    for point in points:
        rung = point[1]
        shape = _rung_shape(base_model, rung)
        for (arch, objective), variant in _cell_variants(study, grid):
            if rung.name not in sizes_of.get((arch, objective), (rung.name,)):
                continue
            matching = (variant.matching if variant else None) or study.matching
            model = matched.match_model(shape, arch, matching, study.match_tolerance, context)
            vname = variant.name if variant else ""
            if variant and variant.model:
                model = validate(
                    ModelConfig, {**model.model_dump(), **variant.model}, f"variant {vname}"
                )
            cell = (arch, objective, vname)
            cfg = _run_config(study, base, model, cell, point, shape, rates)
            run = _matched_run(study, cfg, shape, point, matching, cell, context)
            if run is not None:
                runs.append(run)
    if not runs:
        raise ConfigError("the study expands to no runs; check ladder sizes and budget.compute")
    if study.stages is not None:  # the adaptations' parameter trees, before anything trains
        spec_checks.check_adaptations(study.stages.adapt, [r.cfg for r in runs])
    return runs


def _check_cell_base(study: StudySpec, grid: list[tuple[str, str]]) -> None:
    for key in study.cell_base:
        if tuple(key.split("/")) not in grid:
            accepted = ", ".join(f"{a}/{o}" for a, o in grid)
            raise ConfigError(f"cell_base: {key!r} is not a cell of the study ({accepted})")


def _rung_shape(base_model: ModelConfig, rung: Any) -> ModelConfig:
    """The rung's decoder-stack shape over the base model."""
    # A rung is a decoder-stack shape; the cell's architecture is applied by matching.
    keys = {k: v for k, v in rung.model.items() if k not in ("arch", "n_encoder_layers")}
    return validate(
        ModelConfig,
        {**base_model.model_dump(), **keys, "arch": "causal_decoder", "n_encoder_layers": None},
        f"ladder rung {rung.name}",
    )


def _run_name(cell: tuple[str, str, str], point: tuple) -> str:
    """The run's name, "arch.objective[.variant].size.budget.sSEED", at an (index, rung,
    budget tag, compute, seed) point."""
    _, rung, tag, _, seed = point
    return ".".join(p for p in (*cell, rung.name, tag, f"s{seed}") if p)


def _run_config(
    study: StudySpec,
    base: dict,
    model: ModelConfig,
    cell: tuple[str, str, str],
    point: tuple,
    shape: ModelConfig,
    rates: Any,
) -> ExperimentConfig:
    """The run's config before its training is matched: the base, the cell's base, the
    matched `model` of `cell` (arch, objective, variant name) and the point's seed."""
    arch, objective, vname = cell
    _, rung, tag, _, seed = point
    name = _run_name(cell, point)
    cell_key = f"{arch}/{objective}"
    cell_base = deep_merge(base, dict(study.cell_base.get(cell_key, {})))
    if rates and (rate := rates((arch, objective, vname, rung.name, tag))) is not None:
        cell_base = deep_merge(cell_base, {"optim": {"learning_rate": rate}})
    data = deep_merge(
        cell_base,
        {
            "name": f"{study.name}.{name}",
            "model": model.model_dump(),
            "objective": {"name": objective},
            "train": {"seed": seed},
            # A seed replicates the whole run: data order too (seed 0: the base's).
            "data": {"seed": cell_base.get("data", {}).get("seed", 0) + seed},
            "optim": {"learning_rate": _learning_rate(study, cell_base, shape, cell_key)},
        },
    )
    return validate(ExperimentConfig, data, f"run {name}")


def _matched_run(
    study: StudySpec,
    cfg: ExperimentConfig,
    shape: ModelConfig,
    point: tuple,
    matching: Any,
    cell: tuple[str, str, str],
    context: Any,
) -> PlannedRun | None:
    """The run of `cfg` (of `cell`: arch, objective, variant name) with the steps and rows
    its budget point matches; None where the point is too short for this size."""
    i, rung, tag, compute, seed = point
    budget = study.budget.for_size(rung.name)
    steps, rows = matched.match_training(
        cfg, shape, budget, compute, counting.count_params(shape), matching, study.match_by
    )
    cfg = cfg.replace(train=cfg.train.replace(batch_size=rows))
    if steps == 0:
        return None  # an IsoFLOP point too short for this size
    cfg = matched.with_steps(cfg, steps, _run_name(cell, point))
    return PlannedRun(
        run_id=cfg.hash(),
        cfg=cfg,
        size=rung.name,
        size_index=i,
        budget=tag,
        seed=seed,
        matching=matching,
        params=counting.count_params(cfg.model),
        flops=counting.flops(cfg),
        variant=cell[2],
        context=context,
    )


def _cell_sizes(
    study: StudySpec, grid: list[tuple[str, str]], names: list[str]
) -> dict[tuple[str, str], tuple[str, ...]]:
    """ladder.cell_sizes as {(arch, objective): size names}, checked against the study's
    cells and its ladder's size names."""
    out = {}
    for key, sizes in study.ladder.cell_sizes.items():
        cell = tuple(key.split("/"))
        if cell not in grid:
            accepted = ", ".join(f"{a}/{o}" for a, o in grid)
            raise ConfigError(f"ladder.cell_sizes: {key!r} is not a cell of the study ({accepted})")
        out[cell] = _size_names(f"ladder.cell_sizes[{key}]", sizes, names)
    return out


def _size_names(key: str, sizes: Any, names: list[str]) -> tuple[str, ...]:
    """`sizes` of the spec's `key` as size names, each one of the ladder's `names`."""
    given = tuple(str(n) for n in sizes)
    unknown = [n for n in given if n not in names]
    if unknown:
        raise ConfigError(f"{key}: {unknown} are not sizes of the ladder ({', '.join(names)})")
    return given


def _size_seeds(study: StudySpec, names: list[str]) -> dict[str, tuple[int, ...]]:
    """The seeds each size trains: `seeds` everywhere, and `repeat_seeds.seeds` at its sizes
    (checked against the ladder's size names)."""
    repeat = study.repeat_seeds
    given = _size_names("repeat_seeds.sizes", repeat.sizes, names)
    return {n: tuple(study.seeds) + (tuple(repeat.seeds) if n in given else ()) for n in names}


def _cell_variants(study: StudySpec, grid: list[tuple[str, str]]) -> list[tuple[tuple, Any]]:
    """(cell, variant) pairs in cell order; each cell once with variant None when the study
    has no variants; a variant with `cells` applies only to those (which must be in the grid)."""
    if not study.variants:
        return [(cell, None) for cell in grid]
    for v in study.variants:
        missing = [list(c) for c in v.cells if tuple(c) not in grid]
        if missing:
            raise ConfigError(
                f"variants[{v.name}].cells: {missing} not among the study's cells {grid}"
            )
    return [
        (cell, v)
        for cell in grid
        for v in study.variants
        if not v.cells or cell in [tuple(c) for c in v.cells]
    ]


def _learning_rate(study: StudySpec, base: dict, shape: ModelConfig, cell: str = "") -> float:
    """The rung's peak rate (scaled by width where the ladder asks); errors name `cell_base`."""
    where = "base" if "optim" not in study.cell_base.get(cell, {}) else f"cell_base[{cell}]"
    lr = validate(OptimConfig, base.get("optim", {}), f"{where}.optim").learning_rate
    if study.ladder.lr_scaling == "inverse_width":
        lr *= study.ladder.lr_reference_width / shape.d_model
    return lr


def plan_table(runs: list[PlannedRun]) -> str:
    """A fixed-width table of the planned runs (what --dry-run prints)."""
    head = f"{'run':<46} {'id':<12} {'d':>5} {'L':>5} {'d_ff':>6} {'N total':>10} "
    head += f"{'N non-emb':>10} {'steps':>7} {'FLOPs':>9}"
    lines = [head, "-" * len(head)]
    for r in runs:
        m = r.cfg.model
        depth = f"{m.encoder_layers}+{m.n_layers}" if m.is_encoder_decoder else str(m.n_layers)
        lines.append(
            f"{r.cfg.name.split('.', 1)[-1]:<46} {r.run_id:<12} {m.d_model:>5} {depth:>5} "
            f"{m.d_ff:>6} {r.params['total']:>10.3g} {r.params['non_embedding']:>10.3g} "
            f"{r.cfg.train.steps:>7} {r.planned_flops:>9.2e}"
        )
    total = sum(r.planned_flops for r in runs)
    lines.append(f"{len(runs)} runs, {total:.3e} training FLOPs in all")
    return "\n".join(lines)


def run_study(
    spec: Path,
    out: Path,
    overrides: list[str] | tuple[str, ...] = (),
    dry_run: bool = False,
    *,
    train_fn: Any = None,
    collect: bool = False,
    workers: int = 1,
) -> tuple[StudySpec, list[PlannedRun]]:
    """Run (or resume) a whole study: train what is missing, then fit, plot and report;
    returns the study and its planned runs (what the rooms above it, such as the decoder-only
    experiments, continue from).

    With `collect`, nothing is trained or evaluated: the runs that cluster jobs finished are
    recorded, the report is written, and missing or unfinished runs raise StudyRunError.
    `workers` > 1 trains that many runs at a time, each in its own process.
    `train_fn(cfg, workdir) -> summary` replaces the built-in trainer (tests use it; with
    workers it must be importable by name).
    """
    if dry_run and collect:
        raise ConfigError(
            "--dry-run and --collect exclude each other: --dry-run only plans, --collect "
            "records finished cluster runs; give one"
        )
    spec = Path(spec)
    study = load_study(spec, overrides)
    runs = expand(study, spec.parent)
    spec_checks.check_against_runs(study, runs)  # before anything is written to OUT
    limit = f" of at most {spec_checks.MAX_RUNS:,}" if dry_run else ""
    print(f"study {study.name}: {len(runs)} runs{limit} ({len(cells(study))} cells)")
    cap = groups.cap(study.members)
    if not collect:  # the runs are evaluated here
        spec_checks.check_task_paths(runs)
    if dry_run:
        _print_plan(study, spec.parent, runs, cap)
        return study, runs
    out = Path(out)
    if collect:  # refused before anything is written to OUT
        lr_search.not_on_clusters(study, "--collect")
        executors.check_collect(out, len(runs))
    with study_lock(out):  # one process per study directory
        (out / "spec.yaml").write_text(to_yaml(study))
        with phase("learning-rate search") if study.lr_search else nullcontext():
            runs = lr_search.resolve(
                study,
                spec.parent,
                out,
                runs,
                expand,
                train_fn=train_fn,
                workers=workers,
                members=cap,
            )
        missing, failed = _pretrain(study, out, runs, collect, train_fn, workers, cap)
        with phase("report"):
            report.finalize(study, out)  # the runs `_pretrain` planned in the registry
    _refuse_unfinished(out, len(runs), missing, failed)
    return study, runs


def _pretrain(
    study: StudySpec,
    out: Path,
    runs: list[PlannedRun],
    collect: bool,
    train_fn: Any,
    workers: int,
    cap: int,
) -> tuple[list[str], list[str]]:
    """Register the runs as the study's plan, then train what is missing (or with `collect`,
    record what cluster jobs finished); returns (the runs not collected, the runs failed)."""
    with (
        Registry(out / REGISTRY_NAME) as reg,
        phase("collecting runs" if collect else "pretraining"),
    ):
        reg.add_runs(r.row(study.name, out / "runs" / r.dirname) for r in runs)
        reg.set_plan(r.run_id for r in runs)
        if collect:
            return executors.collect(reg, out, runs), []
        executor = executors.LocalExecutor(
            reg,
            out,
            train_fn=train_fn,
            workers=workers,
            members=cap,
        )
        return [], executor.run(runs)


def _print_plan(study: StudySpec, spec_dir: Path, runs: list, cap: int) -> None:
    """A dry run's answer: the plan's table, the search before it and the programs of members."""
    print(plan_table(runs))
    if study.lr_search:
        search = study.lr_search
        print(
            f"lr_search first: {len(lr_search.plan_search(study, spec_dir, expand))} runs (seed "
            f"{search.seed}; up to {search.extensions} more per point past an end of the rates)"
        )
    jobs = groups.plan_groups(runs, cap)
    print(f"members: {groups.describe(jobs)}")
    for job in (j for j in jobs if len(j) > 1):
        names = ", ".join(r.cfg.name.split(".", 1)[-1] for r in job)
        print(f"  one program: {names}")


def _refuse_unfinished(out: Path, n_runs: int, missing: list, failed: list) -> None:
    """After the report: runs a collect found incomplete, or runs that failed here."""
    if missing:
        raise executors.StudyRunError(
            f"{len(missing)} of {n_runs} run(s) are not complete (listed above; each "
            f"run's state is in the `error` column of {out / REGISTRY_NAME}); the report "
            "covers the complete ones. Collecting never trains: re-submit their jobs, then "
            "collect again"
        )
    if failed:
        raise executors.StudyRunError(
            f"{len(failed)} run(s) failed: {', '.join(failed)}; see the `error` column of "
            f"{out / REGISTRY_NAME} and each run's directory. Re-run the same command to retry "
            "them; finished runs are kept"
        )
