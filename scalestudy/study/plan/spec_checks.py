"""What a study spec would be refused for later, checked when it is read (`sweep.load_study`)
and expanded (`sweep.expand`): laws and task names no reader takes, stages and experiments
that would fail only after pretraining (an adaptation from a cell the study lacks or between
incompatible parameter trees, finetuning evaluated on a task it trains on, published numbers
that are not there, groups and budgets that name nothing of the study), and task files a run
would miss. So a dry run refuses what the study would, and a study trains nothing first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scalestudy.config.errors import ConfigError, not_found, path_kind
from scalestudy.config.eval_config import EvalConfig
from scalestudy.config.experiment import ExperimentConfig
from scalestudy.evaluate.tasks import check_spelling
from scalestudy.scaling.laws import LAWS
from scalestudy.study.plan import stages_spec
from scalestudy.study.plan.published import read_published
from scalestudy.study.plan.spec import DecoderOnlyConfig, StudySpec


def check_spec(
    study: StudySpec,
    spec_dir: Path,
    eval_section: dict,
    grid: list[tuple[str, str]],
    labels: list[str],
) -> None:
    """ConfigError for what the spec's later steps would refuse. `eval_section`: the base
    experiment's `eval` keys; `grid`: the study's (arch, objective) cells; `labels`: its
    groups as the experiments name them ("arch/objective[/variant]")."""
    check_run_count(study, grid)
    tasks = eval_section.get("tasks", EvalConfig.model_fields["tasks"].default)
    unknown = [law for law in study.fit.laws if law not in (*LAWS, "auto")]
    if unknown:
        raise ConfigError(f"fit.laws: unknown {unknown}; accepted: auto, {', '.join(LAWS)}")
    if isinstance(tasks, str) or not isinstance(tasks, list | tuple):
        raise ConfigError(f"tasks: a list of task names; got {tasks!r}")
    check_spelling([str(n) for n in tasks], "tasks")
    _check_per_task_keys(eval_section, [str(n) for n in tasks])
    if study.stages is not None:
        _check_stages(study.stages, spec_dir, grid)
    if study.experiments is not None:
        _check_experiments(study.experiments, labels, [v.name for v in study.variants])


# Runs one study may expand into: a study of the whole grid at a dozen sizes and a few seeds
# plans hundreds; past this, planning alone (configs, hashes, the registry) takes minutes
# before the first run, and the spec is far more likely a list written by mistake.
MAX_RUNS = 10_000


def check_run_count(study: StudySpec, grid: list[tuple[str, str]]) -> int:
    """The fewest runs the spec expands into (cells x variants x sizes x seeds), refused past
    MAX_RUNS before any run is planned (a preset ladder counts as one size here)."""
    # Only what every cell trains counts: a variant or size some cells skip, or a seed only
    # some sizes repeat, may add fewer runs.
    every_cell = all(not v.cells for v in study.variants)
    variants = max(1, len(study.variants)) if every_cell else 1
    sizes = max(1, len(study.ladder.sizes)) if not study.ladder.cell_sizes else 1
    seeds = len(study.seeds)
    least = len(grid) * variants * sizes * max(1, seeds)
    if least > MAX_RUNS:
        raise ConfigError(
            f"the spec expands into at least {least:,} runs ({len(grid)} cells x {variants} "
            f"variant(s) x {sizes} sizes x {seeds} seeds); a study plans at most {MAX_RUNS:,}: "
            "split it into several studies, or shorten ladder.sizes or seeds"
        )
    return least


def check_against_runs(study: StudySpec, runs: list[Any]) -> None:
    """The parts of a spec that name sizes, checked against the sizes its runs train at
    (known once the ladder is expanded), before anything is written for the study."""
    sizes = list(dict.fromkeys(r.size for r in runs))
    if study.lr_search is not None:
        unknown = [s for s in map(str, study.lr_search.sizes) if s not in sizes]
        if unknown:
            raise ConfigError(
                f"lr_search.sizes: {unknown} are not sizes of the study; accepted: "
                f"{', '.join(sizes)}"
            )


def _check_per_task_keys(eval_section: dict, tasks: list[str]) -> None:
    """Per-task eval settings must name a task the runs score. Checked where every task is
    a plain name (a task file's scored name is inside the file, read where a run is)."""
    files = any(":" in n or n.endswith((".yaml", ".yml")) for n in tasks)
    if files or eval_section.get("custom_tasks"):
        return
    for key in ("num_fewshot_per_task", "fewshot_files"):
        given = eval_section.get(key) or {}
        unknown = sorted(str(n) for n in given if n not in tasks) if isinstance(given, dict) else []
        if unknown:
            raise ConfigError(
                f"base.eval.{key} names {unknown[0]!r}, which is not a task the study scores; "
                f"accepted: {', '.join(tasks) or 'none (tasks is empty)'}"
            )


def _check_stages(
    spec: stages_spec.StagesSpec, spec_dir: Path, grid: list[tuple[str, str]]
) -> None:
    for i, ad in enumerate(spec.adapt):
        if tuple(ad.from_cell) not in grid:
            accepted = ", ".join(f"[{a}, {o}]" for a, o in grid)
            raise ConfigError(
                f"stages.adapt[{i}].from_cell: {list(ad.from_cell)} is not a cell of the "
                f"study; accepted: {accepted}"
            )
    ft = stages_spec.finetune_settings(spec, spec_dir)
    if ft is not None and ft.mixture is not None:
        from scalestudy.data import prompted

        mixture = prompted.load_mixture(ft.mixture)
        prompted.zero_shot_tasks(mixture, ft.eval_tasks, "stages.finetune.eval_tasks")
    if spec.published:
        published = Path(spec_dir) / spec.published
        if not published.is_file():
            raise ConfigError(
                "stages.published: " + not_found(published, "the published numbers", "a YAML file")
            )
        read_published(published)


def _check_experiments(exp: DecoderOnlyConfig, groups: list[str], variants: list[str]) -> None:
    """A group that names none of the study's `groups`, budgets that are not in increasing
    order or compare what are not `variants` of the study."""
    named = [(f"comparisons[{i}].groups", c.groups) for i, c in enumerate(exp.comparisons)]
    named += [("rank.groups", exp.rank.groups)] if exp.rank else []
    for key, given in named:
        unknown = [g for g in given if g not in groups]
        if unknown:
            raise ConfigError(
                f"experiments.{key}: {unknown} are not groups of the study; accepted: "
                f"{', '.join(groups)}"
            )
    b = exp.budgets
    if b is None:
        return
    if list(b.steps) != sorted(set(b.steps)) or b.steps[0] < 1:
        raise ConfigError(
            "experiments.budgets.steps: positive step counts in increasing order, each "
            f"once; got {list(b.steps)}"
        )
    if b.interaction and len(b.interaction) != 2:
        raise ConfigError(
            "experiments.budgets.interaction names two architectures [A, B] (B's gap minus "
            f"A's); got {list(b.interaction)}"
        )
    for key in ("reference", "treatment"):
        if getattr(b, key) not in variants:
            raise ConfigError(
                f"experiments.budgets.{key}={getattr(b, key)!r} is not a variant of the "
                f"study; accepted: {', '.join(variants) or 'none (the study has no variants)'}"
            )


def check_adaptations(
    adapt: tuple[stages_spec.AdaptStage, ...], parents: list[ExperimentConfig]
) -> None:
    """What `stages.prepare_adapt` would refuse once the pretrained runs had trained, checked
    on their configs before they train: ConfigError naming the adaptation (`stages.adapt[i]`)
    that changes the architecture or the parameter tree of a run of its `from_cell`."""
    seen = set()
    for parent in parents:
        cell = (parent.model.arch, parent.objective.name)
        for i, ad in enumerate(adapt):
            key = (i, parent.model.model_dump_json())
            if tuple(ad.from_cell) != cell or key in seen:
                continue
            seen.add(key)
            try:
                cfg = stages_spec.adapt_config(parent, Path(parent.name), parent.train.steps, ad)
                stages_spec.check_same_parameters(parent, cfg)
            except stages_spec.StageError as e:
                raise ConfigError(f"stages.adapt[{i}] (from {'/'.join(cell)}): {e}") from None


def check_task_paths(runs: list[Any]) -> None:
    """The files the runs' tasks read (text:PATH, blimp:PATH, a task YAML, ...) exist here,
    where the study runs them: one that does not is refused before any run trains. (A
    cluster's runs read theirs there: `launch` does not look.)"""
    from scalestudy.evaluate.tasks import task_path

    for name in sorted({t for r in runs for t in r.cfg.eval.tasks}):
        found = task_path(name)
        if found is None:
            continue
        path, kinds = found
        if path_kind(path) not in kinds:
            expected = " or ".join(kinds)
            raise ConfigError(f"tasks: {name!r}: " + not_found(path, "the task's data", expected))
