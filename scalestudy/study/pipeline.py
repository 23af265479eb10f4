"""A study's stages after pretraining, from its spec: pretrain -> adapt -> finetune -> evaluate.

`plan` lists every stage run of a spec's `stages:` (`StagesSpec`): each adaptation of the
pretrained runs of its `from_cell`; beside each adaptation a run from scratch on the adapted
run's architecture and objective whose training FLOPs equal the adapted run's total
(pretraining + adaptation), rounded to a whole step; then finetuning of every pretrained,
adapted and from-scratch run. Stage runs live in `<out>/stages/<name>`, beside the pretrained
runs in `<out>/runs`, and are rows of the study registry with their lineage (stage, parent
run id and step; a run from scratch names the adapted run it matches). `run` trains what is
missing (each stage resumes like any run) and writes `<out>/wang_table.md`
(`study/wang_report.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scalestudy.config import ExperimentConfig
from scalestudy.models import counting
from scalestudy.study import stages, sweep, wang_report
from scalestudy.study.lock import study_lock
from scalestudy.study.registry import Registry
from scalestudy.study.spec import StudySpec
from scalestudy.train import rundir
from scalestudy.train.loop import Preempted

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
    settings: stages.AdaptConfig | stages.FinetuneConfig | None
    pretrained: sweep.PlannedRun  # the pretrained run it descends from (the table's row)
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


def _finetune_settings(study: StudySpec, spec_dir: Path) -> stages.FinetuneConfig | None:
    ft = study.stages.finetune if study.stages else None
    if ft is None or ft.mixture is None:
        return ft
    mixture = Path(ft.mixture)
    if not mixture.is_absolute():
        mixture = (spec_dir / mixture).resolve()
    return ft.replace(mixture=str(mixture))


def scratch_config(adapted: ExperimentConfig, total_flops: float, name: str) -> ExperimentConfig:
    """The adapted run's config trained from scratch for the whole step count whose FLOPs come
    nearest `total_flops` (the adapted run's pretraining + adaptation)."""
    per_step = counting.flops(adapted)["flops_per_example"] * adapted.train.batch_size
    steps = max(1, round(total_flops / per_step))
    train = adapted.train.replace(steps=steps, init_from=None, init_step=None)
    return adapted.replace(name=name, train=train)


def plan(study: StudySpec, spec_dir: Path, out: Path, runs: list | None = None) -> list[StageRun]:
    """Every stage run of the spec, in the order they can run (adaptations and their runs from
    scratch before the finetuning of what they produce); `runs`: the study's expansion when
    already made."""
    from scalestudy.data import prompted

    if study.stages is None:
        return []
    ft = _finetune_settings(study, spec_dir)
    mixture = prompted.load_mixture(ft.mixture) if ft and ft.mixture else None
    out = Path(out)
    planned: list[StageRun] = []
    for run in runs if runs is not None else sweep.expand(study, spec_dir):
        parent = out / "runs" / run.dirname
        steps = run.cfg.train.steps
        # (directory, config, role, via, run id) of every run to finetune
        parents = [(parent, run.cfg, "pretrained", "", run.run_id)]
        for ad in study.stages.adapt:
            if tuple(ad.from_cell) != (run.arch, run.objective):
                continue
            cfg = stages.adapt_config(run.cfg, parent, steps, ad)
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
            planned += [adapted, dataclasses.replace(scratch, matches=name)]
            parents.append((out / "stages" / name, cfg, "adapted", via, adapted.run_id))
            parents.append((out / "stages" / scratch_name, s_cfg, "scratch", via, s_cfg.hash()))
        if ft is None or mixture is None:
            continue
        held = tuple(sorted({t.eval_task for t in mixture.held_out_tasks if t.eval_task}))
        for pdir, pcfg, role, via, pid in parents:
            cfg = stages.finetune_config(
                pcfg,
                pdir,
                pcfg.train.steps,
                ft,
                prompted.mixture_name(mixture),
                None,
                tuple(ft.eval_tasks) or held,
            )
            extra = cfg.train.steps - pcfg.train.steps
            planned.append(
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
    return planned


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


def run(study: StudySpec, spec_dir: Path, out: Path, runs: list, *, dry_run: bool = False) -> None:
    """Plan (and unless `dry_run`, run) the stages after the study's pretraining `runs`; paths
    in the spec are relative to `spec_dir`. Holds the study lock; records every stage run in
    the registry with its lineage."""
    out = Path(out)
    planned = plan(study, Path(spec_dir), out, runs)
    if not planned:
        return
    published = None  # read now: a bad file is one line before anything trains
    if study.stages.published:
        published = wang_report.read_published(Path(spec_dir) / study.stages.published)
    print(f"study {study.name}: {len(planned)} stage runs after pretraining")
    if dry_run:
        print(plan_table(planned))
        return
    with study_lock(out), Registry(out / sweep.REGISTRY_NAME) as reg:
        reg.add_runs(registry_row(r, study.name, out) for r in planned)
        matches = {r.name: r.run_id for r in planned if r.stage == "adapt"}
        for r in planned:
            if r.matches:
                reg.update(r.run_id, matches_run_id=matches[r.matches])
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
        runs_by_id = {row["run_id"]: row for row in reg.runs(stages=True)}
    text = wang_report.render(planned, out, runs_by_id, published)
    (out / TABLE).write_text(text)
    print(text)


def _run_one(r: StageRun, where: Path) -> dict[str, Any]:
    if r.stage == "scratch":
        record = {"stage": "scratch", "parent": None, "parent_step": None, "matches": r.matches}
        return stages.run_stage(r.cfg, record, where, evaluate=False)
    prepare = stages.prepare_adapt if r.stage == "adapt" else stages.prepare_finetune
    cfg, record = prepare(r.parent, where, settings=r.settings)
    record |= {"pretrained": r.pretrained.dirname, "role": r.role, "via": r.via}
    record |= {"parent_run_id": r.parent_run_id}
    return stages.run_stage(cfg, record, where, evaluate=r.stage == "finetune")
