"""A study's stages after pretraining, from its spec: pretrain -> adapt -> finetune -> evaluate.

`plan` lists every stage run of a spec's `stages:` (`StagesSpec`): each adaptation of the
pretrained runs of its `from_cell`; beside each adaptation a run from scratch on the adapted
run's architecture and objective whose training FLOPs equal the adapted run's total
(pretraining + adaptation), rounded to a whole step; then finetuning of every pretrained,
adapted and from-scratch run. Stage runs live in `<out>/stages/<name>`, beside the pretrained
runs in `<out>/runs`, and are rows of the study registry with their lineage (stage, parent
run id and step; a run from scratch names the adapted run it matches). `run` trains what is
missing (each stage resumes like any run) and writes `<out>/wang_table.md`
(`study/report/wang_report.py`). On a cluster, `launch` submits the stage runs in `tiers` after
pretraining, each task trains one (`run_named`), and `collect` records them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import ExperimentConfig
from scalestudy.models import counting
from scalestudy.study.plan import stages_spec
from scalestudy.study.plan.published import read_published
from scalestudy.study.plan.spec import StudySpec
from scalestudy.study.record.registry import Registry
from scalestudy.study.record.rows import RunRow
from scalestudy.study.report import wang_report
from scalestudy.study.run import cluster, executors, lr_search, main_job, stages
from scalestudy.study.run.lock import study_lock
from scalestudy.train.loop import Preempted
from scalestudy.train.rundir import layout as rundir

TABLE = wang_report.TABLE
# Summary counts that run on from the parent in a stage run (the loop counts from step 0);
# the registry holds a stage run's own share.
_CUMULATIVE = ("tokens", "positions", "flops", "flops_6nd", "document_tokens", "loss_tokens")


@dataclass(frozen=True)
class StageRun:
    """One planned stage run: its stage, directory name, parent directory and config."""

    stage: str  # "adapt", "scratch" or "finetune"
    name: str
    parent: Path | None  # None for a run from scratch
    cfg: ExperimentConfig
    extra_steps: int  # the steps this stage trains (all of them for a run from scratch)
    settings: stages_spec.AdaptConfig | stages_spec.FinetuneConfig | None
    pretrained: main_job.PlannedRun  # the pretrained run it descends from (the table's row)
    # What the run (for finetune: its parent) is: "pretrained", "adapted" or "scratch".
    role: str = "pretrained"
    via: str = ""  # "arch/objective" of the adaptation involved, if any
    parent_run_id: str | None = None
    parent_step: int | None = None
    matches: str | None = None  # a run from scratch: the adapted run's name

    @property
    def run_id(self) -> str:
        return self.cfg.hash()

    @property
    def cell(self) -> str:
        """The pretrained run's "arch/objective"."""
        return f"{self.pretrained.arch}/{self.pretrained.objective}"

    @property
    def planned_flops(self) -> float:
        """Training FLOPs of this stage's own steps."""
        per_example = counting.flops(self.cfg)["flops_per_example"]
        return self.extra_steps * self.cfg.train.batch_size * per_example


def scratch_config(adapted: ExperimentConfig, total_flops: float, name: str) -> ExperimentConfig:
    """The adapted run's config trained from scratch for the whole step count whose FLOPs come
    nearest `total_flops` (the adapted run's pretraining + adaptation)."""
    per_step = counting.flops(adapted)["flops_per_example"] * adapted.train.batch_size
    steps = max(1, round(total_flops / per_step))
    train = adapted.train.replace(steps=steps, init_from=None, init_step=None)
    return adapted.replace(name=name, train=train)


def plan_stages(
    study: StudySpec, spec_dir: Path, out: Path, runs: list | None = None
) -> list[StageRun]:
    """Every stage run of the spec, in the order they can run (adaptations and their runs from
    scratch before the finetuning of what they produce); `runs`: the study's expansion when
    already made."""
    from scalestudy.data import prompted

    if study.stages is None:
        return []
    ft = stages_spec.finetune_settings(study.stages, spec_dir)
    mixture = prompted.load_mixture(ft.mixture) if ft and ft.mixture else None
    out = Path(out)
    planned: list[StageRun] = []
    for run in runs if runs is not None else main_job.expand(study, spec_dir):
        parent = out / "runs" / run.dirname
        # (directory, config, role, via, run id) of every run to finetune
        parents = [(parent, run.cfg, "pretrained", "", run.run_id)]
        for ad in study.stages.adapt:
            if tuple(ad.from_cell) != (run.arch, run.objective):
                continue
            adapted, scratch = _adapted_and_scratch(run, parent, ad)
            planned += [adapted, scratch]
            via = adapted.via
            parents.append(
                (out / "stages" / adapted.name, adapted.cfg, "adapted", via, adapted.run_id)
            )
            parents.append(
                (out / "stages" / scratch.name, scratch.cfg, "scratch", via, scratch.run_id)
            )
        if ft is None or mixture is None:
            continue
        planned += _finetunes(run, parents, ft, mixture)
    return planned


def _adapted_and_scratch(
    run: main_job.PlannedRun, parent: Path, ad: stages_spec.AdaptConfig
) -> tuple[StageRun, StageRun]:
    """(the adaptation `ad` of the pretrained `run`, the run from scratch matching its FLOPs)."""
    steps = run.cfg.train.steps
    cfg = stages_spec.adapt_config(run.cfg, parent, steps, ad)
    via = f"{cfg.model.arch}/{cfg.objective.name}"
    name = f"{run.dirname}-adapt-{cfg.model.arch}-{cfg.objective.name}"
    extra = cfg.train.steps - steps
    adapted = StageRun(
        "adapt", name, parent, cfg, extra, ad, run, "adapted", via, run.run_id, steps
    )
    total = run.planned_flops + adapted.planned_flops
    scratch_name = f"{run.dirname}-scratch-{cfg.model.arch}-{cfg.objective.name}"
    s_name = f"{run.cfg.name}-scratch-{cfg.model.arch}-{cfg.objective.name}"
    s_cfg = scratch_config(cfg, total, s_name)
    scratch = StageRun(
        "scratch", scratch_name, None, s_cfg, s_cfg.train.steps, None, run, "scratch", via
    )
    return adapted, dataclasses.replace(scratch, matches=name)


def _finetunes(
    run: main_job.PlannedRun, parents: list[tuple], ft: stages_spec.FinetuneConfig, mixture: Any
) -> list[StageRun]:
    """The finetuning of each of `parents` (the pretrained `run` and what descends from it)."""
    from scalestudy.data import prompted

    eval_tasks = prompted.zero_shot_tasks(mixture, ft.eval_tasks, "stages.finetune.eval_tasks")
    runs = []
    for pdir, pcfg, role, via, pid in parents:
        cfg = stages.finetune_config(
            pcfg,
            pdir,
            pcfg.train.steps,
            ft,
            prompted.mixture_name(mixture),
            None,
            eval_tasks,
        )
        extra = cfg.train.steps - pcfg.train.steps
        runs.append(
            StageRun(
                "finetune",
                f"{pdir.name}-ft",
                pdir,
                cfg,
                extra,
                ft,
                run,
                role,
                via,
                pid,
                pcfg.train.steps,
            )
        )
    return runs


def plan_table(runs: list[StageRun]) -> str:
    """What `--dry-run` prints for the stages: each run's steps, tokens and FLOPs."""
    head = f"{'stage':<9} {'run':<90} {'steps':>7} {'tokens':>10} {'FLOPs':>9}"
    lines = [head, "-" * len(head)]
    for r in runs:
        positions = counting.flops(r.cfg)["positions_per_example"]
        tokens = r.extra_steps * r.cfg.train.batch_size * positions
        lines.append(
            f"{r.stage:<9} {r.name:<90} {r.extra_steps:>7} {tokens:>10.3g} {r.planned_flops:>9.2e}"
        )
    total = sum(r.planned_flops for r in runs)
    lines.append(f"{len(runs)} stage runs, {total:.3e} training FLOPs in all")
    return "\n".join(lines)


def registry_row(r: StageRun, study: str, out: Path) -> dict[str, Any]:
    """The registry row planned for a stage run: the pretrained run's size and seed, its own
    steps and FLOPs, and its lineage."""
    as_run = dataclasses.replace(
        r.pretrained,
        run_id=r.run_id,
        cfg=r.cfg,
        params=counting.count_params(r.cfg.model),
        flops=counting.flops(r.cfg),
    )
    row = as_run.row(study, Path(out) / "stages" / r.name)
    row |= {
        "name": r.name,
        "steps": r.extra_steps,
        "planned_flops": r.planned_flops,
        "stage": r.stage,
        "parent_run_id": r.parent_run_id,
        "parent_step": r.parent_step,
    }
    return row


def _own_counts(summary: dict[str, Any], parent: Path | None) -> dict[str, Any]:
    """A stage run's summary with the counts it carried on from its parent taken out."""
    before = rundir.read_summary(parent) if parent is not None else None
    if not before:
        return summary
    own = dict(summary)
    for key in _CUMULATIVE:
        if isinstance(own.get(key), int | float) and isinstance(before.get(key), int | float):
            own[key] = own[key] - before[key]
    return own


def _add_rows(reg: Registry, planned: list[StageRun], study: StudySpec, out: Path) -> None:
    reg.add_runs(registry_row(r, study.name, out) for r in planned)
    matches = {r.name: r.run_id for r in planned if r.stage == "adapt"}
    for r in planned:
        if r.matches:
            reg.update(r.run_id, matches_run_id=matches[r.matches])


def _write_table(
    study: StudySpec, spec_dir: Path, planned: list[StageRun], out: Path, reg: Registry
) -> None:
    published = None
    if study.stages.published:
        published = read_published(Path(spec_dir) / study.stages.published)
    runs_by_id = {row.run_id: row for row in map(RunRow.from_row, reg.runs(stages=True))}
    text = wang_report.render(planned, out, runs_by_id, published)
    (out / TABLE).write_text(text)
    print(text)


def run_stages(
    study: StudySpec, spec_dir: Path, out: Path, runs: list, *, dry_run: bool = False
) -> None:
    """Plan (and unless `dry_run`, run) the stages after the study's pretraining `runs`; paths
    in the spec are relative to `spec_dir`. Holds the study lock; records every stage run in
    the registry with its lineage."""
    out = Path(out)
    planned = plan_stages(study, Path(spec_dir), out, runs)
    if not planned:
        return
    print(f"study {study.name}: {len(planned)} stage runs after pretraining")
    if dry_run:
        print(plan_table(planned))
        return
    with study_lock(out), Registry(out / main_job.REGISTRY_NAME) as reg:
        _add_rows(reg, planned, study, out)
        done = {row["run_id"] for row in reg.runs("done", stages=True)}
        for r in planned:
            where = out / "stages" / r.name
            if r.run_id in done and rundir.read_summary(where) is not None:
                continue
            reg.mark_running(r.run_id)
            try:
                summary = _run_one(r, where)
            except (Preempted, KeyboardInterrupt) as e:  # checkpointed: resumed next time
                reg.update(r.run_id, status="interrupted", error=str(e) or "interrupted")
                raise
            except Exception as e:
                reg.mark_failed(r.run_id, f"{type(e).__name__}: {e}")
                raise
            reg.finish(r.run_id, _own_counts(summary, r.parent), rundir.read_metrics(where))
        _write_table(study, spec_dir, planned, out, reg)


def tiers(planned: list[StageRun]) -> list[list[StageRun]]:
    """The stage runs grouped by what they wait for (what a cluster launch submits as one
    job each): the first group needs only the pretrained runs (adaptations, runs from
    scratch, finetuning of pretrained runs), each later one the group before it (finetuning
    of adapted and from-scratch runs)."""
    level: dict[str, int] = {}
    for r in planned:  # plan order: a stage run's parent comes before it
        parent = r.parent.name if r.parent is not None else None
        level[r.name] = level[parent] + 1 if parent in level else 0
    groups: list[list[StageRun]] = [[] for _ in range(max(level.values(), default=-1) + 1)]
    for r in planned:
        groups[level[r.name]].append(r)
    return groups


def run_named(spec: Path, out: Path, name: str, overrides: list[str] | tuple = ()) -> dict:
    """Train (or resume, or find finished) the one stage run `name` of a study: what a cluster
    task runs once the run's parent has finished. It touches neither the registry nor the
    study lock (tasks run side by side); `study --collect` records it afterwards."""
    spec = Path(spec)
    study = main_job.load_study(spec, overrides)
    planned = {r.name: r for r in plan_stages(study, spec.parent, Path(out))}
    if name not in planned:
        accepted = ", ".join(planned) if planned else "none: the spec has no stages"
        raise ConfigError(
            f"--stage-run {name!r} is not a stage run of study {study.name}; accepted: {accepted}"
        )
    return _run_one(planned[name], Path(out) / "stages" / name)


def launch(spec: Path, executor: str, out: Path, submit: bool) -> str:
    """Render (and with `submit`, submit) the cluster jobs of a study: pretraining, then each
    group of stage runs (`tiers`) once its parents' job succeeded, then the collect step.
    Returns the scripts' text."""
    spec = Path(spec)
    study = main_job.load_study(spec)
    lr_search.not_on_clusters(study, f"launch {executor}")
    runs = main_job.expand(study, spec.parent)
    groups = tiers(plan_stages(study, spec.parent, Path(out), runs))
    return cluster.launch(study, spec, runs, executor, Path(out), submit=submit, stage_tiers=groups)


def collect(study: StudySpec, spec_dir: Path, out: Path, runs: list) -> list[str]:
    """Record the stage runs that cluster jobs finished (with their lineage) in the registry
    and write the table over the complete ones; trains and evaluates nothing. Returns one line
    per stage run that is not complete."""
    out = Path(out)
    planned = plan_stages(study, Path(spec_dir), out, runs)
    if not planned:
        return []
    problems = []
    with study_lock(out), Registry(out / main_job.REGISTRY_NAME) as reg:
        _add_rows(reg, planned, study, out)
        done = {row["run_id"] for row in reg.runs("done", stages=True)}
        for r in planned:
            where = out / "stages" / r.name
            summary = executors.finished_summary(where, r.cfg.train.steps)
            if summary is None:
                started, why = executors.unfinished(where, r.cfg.train.steps)
                if started:
                    reg.mark_failed(r.run_id, why)
                else:
                    reg.update(r.run_id, status="pending", error=why)
                problems.append(f"{r.name}: {why}")
            elif r.run_id not in done:
                reg.finish(r.run_id, _own_counts(summary, r.parent), rundir.read_metrics(where))
        print(f"stages: {len(planned) - len(problems)} of {len(planned)} stage runs complete")
        for line in problems:
            print(f"  not complete: {line}")
        _write_table(study, spec_dir, planned, out, reg)
    return problems


def _run_one(r: StageRun, where: Path) -> dict[str, Any]:
    if r.stage == "scratch":
        record = {"stage": "scratch", "parent": None, "parent_step": None, "matches": r.matches}
        return stages.run_stage(r.cfg, record, where, evaluate=False)
    prepare = stages.prepare_adapt if r.stage == "adapt" else stages.prepare_finetune
    cfg, record = prepare(r.parent, where, settings=r.settings)
    record |= {"pretrained": r.pretrained.dirname, "role": r.role, "via": r.via}
    record |= {"parent_run_id": r.parent_run_id}
    return stages.run_stage(cfg, record, where, evaluate=r.stage == "finetune")
