"""A study's stages after pretraining, from its spec: pretrain -> adapt -> finetune -> evaluate.

`plan` lists every stage run of a spec's `stages:` (`StagesSpec`): each adaptation of the
pretrained runs of its `from_cell`, then finetuning of every pretrained and adapted run. Stage
runs live in `<out>/stages/<name>`, beside the pretrained runs in `<out>/runs`. `run` trains
what is missing (each stage resumes like any run) and writes `<out>/wang_table.md`: per
pretrained run, the zero-shot average on the finetuning's held-out tasks after pretraining,
after finetuning, and for each adaptation after adapting and after adapting + finetuning, each
with a 95% interval, beside the published numbers when the spec names a file of them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from scalestudy.config import ExperimentConfig
from scalestudy.study import stages, sweep
from scalestudy.study.spec import StudySpec
from scalestudy.yamlio import read_yaml

TABLE = "wang_table.md"


@dataclass(frozen=True)
class StageRun:
    """One planned stage run: its stage, directory name, parent directory and config."""

    stage: str  # "adapt" or "finetune"
    name: str
    parent: Path
    cfg: ExperimentConfig
    extra_steps: int
    settings: stages.AdaptConfig | stages.FinetuneConfig
    pretrained: str  # the pretrained run's directory name (the table's row)
    cell: str  # the pretrained run's "arch/objective"
    via: str = ""  # "arch/objective" of the adaptation in between, if any


def _finetune_settings(study: StudySpec, spec_dir: Path) -> stages.FinetuneConfig | None:
    ft = study.stages.finetune if study.stages else None
    if ft is None or ft.mixture is None:
        return ft
    mixture = Path(ft.mixture)
    if not mixture.is_absolute():
        mixture = (spec_dir / mixture).resolve()
    return ft.replace(mixture=str(mixture))


def plan(study: StudySpec, spec_dir: Path, out: Path, runs: list | None = None) -> list[StageRun]:
    """Every stage run of the spec, in the order they can run (adaptations before the
    finetuning of what they produce); `runs`: the study's expansion when already made."""
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
        parents = [(parent, run.cfg, "")]
        cell = f"{run.arch}/{run.objective}"
        for ad in study.stages.adapt:
            if tuple(ad.from_cell) != (run.arch, run.objective):
                continue
            cfg = stages.adapt_config(run.cfg, parent, steps, ad)
            name = f"{run.dirname}-adapt-{cfg.model.arch}-{cfg.objective.name}"
            extra = cfg.train.steps - steps
            planned.append(StageRun("adapt", name, parent, cfg, extra, ad, run.dirname, cell))
            via = f"{cfg.model.arch}/{cfg.objective.name}"
            parents.append((out / "stages" / name, cfg, via))
        if ft is None or mixture is None:
            continue
        held = tuple(sorted({t.eval_task for t in mixture.held_out_tasks if t.eval_task}))
        for pdir, pcfg, via in parents:
            cfg = stages.finetune_config(
                pcfg,
                pdir,
                pcfg.train.steps,
                ft,
                prompted.mixture_name(mixture),
                None,
                tuple(ft.eval_tasks) or held,
            )
            name = f"{pdir.name}-ft"
            extra = cfg.train.steps - pcfg.train.steps
            planned.append(StageRun("finetune", name, pdir, cfg, extra, ft, run.dirname, cell, via))
    return planned


def plan_table(runs: list[StageRun]) -> str:
    """What `--dry-run` prints for the stages: each run's parent, steps, tokens and FLOPs."""
    from scalestudy.models import counting

    head = f"{'stage':<9} {'run':<90} {'steps':>7} {'tokens':>10} {'FLOPs':>9}"
    lines = [head, "-" * len(head)]
    total = 0.0
    for r in runs:
        counts = counting.flops(r.cfg)
        examples = r.extra_steps * r.cfg.train.batch_size
        tokens = examples * counts["positions_per_example"]
        flops = examples * counts["flops_per_example"]
        total += flops
        lines.append(f"{r.stage:<9} {r.name:<90} {r.extra_steps:>7} {tokens:>10.3g} {flops:>9.2e}")
    lines.append(f"{len(runs)} stage runs, {total:.3e} training FLOPs in all")
    return "\n".join(lines)


def run(study: StudySpec, spec_dir: Path, out: Path, runs: list, *, dry_run: bool = False) -> None:
    """Plan (and unless `dry_run`, run) the stages after the study's pretraining `runs`; paths
    in the spec are relative to `spec_dir`."""
    planned = plan(study, Path(spec_dir), Path(out), runs)
    if not planned:
        return
    print(f"study {study.name}: {len(planned)} stage runs after pretraining")
    if dry_run:
        print(plan_table(planned))
        return
    for r in planned:
        where = Path(out) / "stages" / r.name
        prepare = stages.prepare_adapt if r.stage == "adapt" else stages.prepare_finetune
        cfg, record = prepare(r.parent, where, settings=r.settings)
        record["pretrained"], record["via"] = r.pretrained, r.via
        stages.run_stage(cfg, record, where, evaluate=r.stage == "finetune")
    published = None
    if study.stages.published:
        published = read_yaml(Path(spec_dir) / study.stages.published)
    text = table(planned, Path(out), published)
    (Path(out) / TABLE).write_text(text)
    print(text)


# ----------------------------------------------------------------------------- the table


def average(evals: dict | None, tasks: tuple[str, ...]) -> tuple[float, float] | None:
    """(mean accuracy over `tasks`, half-width of its 95% interval), from per-task acc and n
    (binomial errors of independent tasks); None when any task is missing."""
    if not evals or not tasks:
        return None
    accs, var = [], 0.0
    for t in tasks:
        acc, n = evals.get(f"{t}/acc"), evals.get(f"{t}/n")
        if acc is None or not n:
            return None
        accs.append(acc)
        var += acc * (1 - acc) / n
    return sum(accs) / len(accs), 1.96 * math.sqrt(var) / len(accs)


def _fmt(value: tuple[float, float] | None) -> str:
    return "-" if value is None else f"{100 * value[0]:.1f} ± {100 * value[1]:.1f}"


def table(planned: list[StageRun], out: Path, published: dict | None = None) -> str:
    """The Wang-layout table of a finished pipeline (markdown)."""
    rows: dict[str, dict] = {}
    for r in planned:
        if r.stage != "finetune":
            continue
        record = stages.read_lineage(out / "stages" / r.name) or {}
        summary_path = out / "stages" / r.name / "summary.json"
        after = json.loads(summary_path.read_text()).get("eval") if summary_path.exists() else None
        tasks = tuple(r.cfg.eval.tasks)
        row = rows.setdefault(r.pretrained, {"cell": r.cell, "adapted": []})
        before, ft = average(record.get("eval_before"), tasks), average(after, tasks)
        if r.via:
            row["adapted"].append((r.via, before, ft))
        else:
            row |= {"pretrain": before, "finetune": ft, "tasks": tasks}
    cells = (published or {}).get("cells", {})
    source = (published or {}).get("source", "")
    lines = [
        "| pretrained run | cell | pretrain | + finetune | adapted to | adapted | adapted + "
        f"finetune | paper pretrain | paper + finetune |{f' ({source})' if source else ''}",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        paper = cells.get(row["cell"], {})
        adapted = row["adapted"] or [("", None, None)]
        for via, before, ft in adapted:
            lines.append(
                f"| {name} | {row['cell']} | {_fmt(row.get('pretrain'))} | "
                f"{_fmt(row.get('finetune'))} | {via or '-'} | {_fmt(before) if via else '-'} | "
                f"{_fmt(ft) if via else '-'} | {paper.get('pretrain', '-')} | "
                f"{paper.get('finetune', '-')} |"
            )
    tasks = next((r.get("tasks") for r in rows.values() if r.get("tasks")), ())
    lines.append("")
    lines.append(
        f"Zero-shot accuracy (%) averaged over {', '.join(tasks) or 'the held-out tasks'}; "
        "± the half-width of a 95% binomial interval."
    )
    return "\n".join(lines) + "\n"
