"""The report of a study's stages (`<out>/wang_table.md`), in Wang et al.'s layout.

- The table: per pretrained run, the zero-shot average on the finetuning's held-out tasks
  after pretraining, after finetuning, and for each adaptation after adapting and after
  adapting + finetuning, each with a 95% interval, beside the published numbers of the same
  cell when the spec names a file of them (`stages.published`).
- Adapted vs from scratch at equal total compute: each adapted run (its pretraining +
  adaptation FLOPs) against the run from scratch on the same architecture and objective that
  `study/run/after_pretraining.py` plans at the same FLOPs: validation loss on that objective and,
  when both are finetuned, the zero-shot average after finetuning; differences paired by seed.
- The stage runs with their lineage, as the registry holds them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scalestudy.scaling import render as md
from scalestudy.scaling.intervals import accuracy_difference, paired_difference
from scalestudy.study.record import lineage
from scalestudy.study.record.rows import RunRow

TABLE = "wang_table.md"


@dataclass(frozen=True)
class EqualCompute:
    """One adapted run against its run from scratch at equal total compute (`equal_compute`):
    the (pretrained cell, adaptation, size) they compare at (`key`), the pretraining seed, both
    runs' names, total FLOPs and their ratio, both validation losses (None: not yet measured)
    and, where both were finetuned and scored, both zero-shot averages and the examples
    behind them."""

    key: tuple[str, str, str]
    seed: int
    adapted: str
    scratch: str
    adapted_flops: float
    scratch_flops: float
    ratio: float
    loss_adapted: float | None = None
    loss_scratch: float | None = None
    acc_adapted: float | None = None
    acc_scratch: float | None = None
    examples: int | None = None


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


def _examples(evals: dict | None, tasks: tuple[str, ...]) -> int:
    return int(sum((evals or {}).get(f"{t}/n") or 0 for t in tasks))


def _fmt(value: tuple[float, float] | None) -> str:
    return "-" if value is None else f"{100 * value[0]:.1f} ± {100 * value[1]:.1f}"


def _paper(entry: Any) -> str:
    """A published number: a scalar, or {eai, t0} shown as `EAI / T0`."""
    if isinstance(entry, dict):
        return f"{entry.get('eai', '-')} / {entry.get('t0', '-')}"
    return "-" if entry is None else str(entry)


def _evals(out: Path, name: str) -> tuple[dict | None, dict | None]:
    """(zero-shot scores of a finetuning's parent, of the finetuned run) from its directory."""
    record = lineage.read_lineage(out / "stages" / name) or {}
    path = out / "stages" / name / "summary.json"
    after = json.loads(path.read_text()).get("eval") if path.exists() else None
    return record.get("eval_before"), after


def table(planned: list, out: Path, published: dict | None = None) -> str:
    """The Wang-layout table of a finished pipeline (markdown)."""
    rows: dict[str, dict] = {}
    for r in planned:
        if r.stage != "finetune" or r.role == "scratch":
            continue
        before_evals, after_evals = _evals(out, r.name)
        tasks = tuple(r.cfg.eval.tasks)
        row = rows.setdefault(r.pretrained.dirname, {"cell": r.cell, "adapted": []})
        before, ft = average(before_evals, tasks), average(after_evals, tasks)
        if r.role == "adapted":
            row["adapted"].append((r.via, before, ft))
        else:
            row |= {"pretrain": before, "finetune": ft, "tasks": tasks}
    published = published or {}
    cells, adapted_paper = published.get("cells", {}), published.get("adapted", {})
    source = published.get("source", "")
    head = ["pretrained run", "cell", "pretrain", "+ finetune", "adapted to", "adapted"]
    head += ["adapted + finetune", "paper pretrain", "paper + finetune", "paper adapted + finetune"]
    body = []
    for name, row in rows.items():
        paper = cells.get(row["cell"], {})
        for via, before, ft in row["adapted"] or [("", None, None)]:
            theirs = adapted_paper.get(f"{row['cell']} -> {via}", {}) if via else {}
            body.append(
                [
                    name,
                    row["cell"],
                    _fmt(row.get("pretrain")),
                    _fmt(row.get("finetune")),
                    via or "-",
                    _fmt(before) if via else "-",
                    _fmt(ft) if via else "-",
                    _paper(paper.get("pretrain")),
                    _paper(paper.get("finetune")),
                    _paper(theirs.get("finetune")),
                ]
            )
    tasks = next((r.get("tasks") for r in rows.values() if r.get("tasks")), ())
    lines = [
        *md.table(head, body),
        "",
        f"Zero-shot accuracy (%) averaged over {', '.join(tasks) or 'the held-out tasks'}; "
        "± the half-width of a 95% binomial interval.",
    ]
    if source:
        lines.append(
            f"Paper columns: {source}, {published.get('benchmarks', 'EAI-Eval / T0-Eval')}; "
            "their tasks and scale differ from these runs, so they are context, not a target."
        )
    return "\n".join(lines) + "\n"


def equal_compute(planned: list, out: Path, runs: dict[str, RunRow]) -> list[EqualCompute]:
    """One record per (adaptation, seed): the adapted run's total FLOPs (its parent's and its
    own, as measured; planned where not yet measured), the run from scratch's, their ratio,
    both validation losses and both zero-shot averages after finetuning."""
    by_name = {r.name: r for r in planned}
    finetuned = {r.parent.name: r for r in planned if r.stage == "finetune"}
    records = []
    for s in planned:
        if s.stage != "scratch" or s.matches not in by_name:
            continue
        a = by_name[s.matches]
        none = RunRow("")  # a run not in the registry: nothing measured
        row_a, row_s = runs.get(a.run_id, none), runs.get(s.run_id, none)
        row_p = runs.get(a.parent_run_id, none)
        parent_flops = row_p.flops or a.pretrained.planned_flops
        adapted = parent_flops + (row_a.flops or a.planned_flops)
        scratch = row_s.flops or s.planned_flops
        acc_adapted = acc_scratch = examples = None
        if a.name in finetuned and s.name in finetuned:
            tasks = tuple(finetuned[a.name].cfg.eval.tasks)
            _, ev_a = _evals(out, finetuned[a.name].name)
            _, ev_s = _evals(out, finetuned[s.name].name)
            acc_a, acc_s = average(ev_a, tasks), average(ev_s, tasks)
            if acc_a and acc_s:
                acc_adapted, acc_scratch = acc_a[0], acc_s[0]
                examples = min(_examples(ev_a, tasks), _examples(ev_s, tasks))
        rec = EqualCompute(
            key=(a.cell, a.via, a.pretrained.size),
            seed=a.pretrained.seed,
            adapted=a.name,
            scratch=s.name,
            adapted_flops=adapted,
            scratch_flops=scratch,
            ratio=scratch / adapted,
            loss_adapted=row_a.loss,
            loss_scratch=row_s.loss,
            acc_adapted=acc_adapted,
            acc_scratch=acc_scratch,
            examples=examples,
        )
        records.append(rec)
    return records


def equal_compute_lines(records: list[EqualCompute]) -> list[str]:
    """The comparison's markdown: one row per adaptation and size, paired over seeds."""
    if not records:
        return []
    lines = [
        "## Adapted vs from scratch at equal total compute",
        "",
        "Each adapted run (pretraining + adaptation FLOPs) against a run trained from scratch "
        "on the adapted architecture and objective for the whole number of steps nearest the "
        "same FLOPs. Δ = adapted − scratch, paired by seed (t interval over seeds; with one "
        "seed the loss has no interval and the accuracy's is over examples only).",
        "",
    ]
    head = ["pretrained cell", "adapted to", "size", "seeds", "FLOPs scratch / adapted"]
    head += ["val loss adapted", "val loss scratch", "Δ loss", "zero-shot + ft adapted"]
    head += ["scratch", "Δ acc"]
    body = []
    groups: dict[tuple, list[EqualCompute]] = {}
    for rec in records:
        groups.setdefault(rec.key, []).append(rec)
    for (cell, via, size), recs in groups.items():
        ratios = ", ".join(f"{r.ratio:.4f}" for r in recs)
        loss = _paired(recs, "loss_adapted", "loss_scratch")
        acc = "-"
        with_acc = [r for r in recs if r.acc_adapted is not None]
        if with_acc:
            a = {r.seed: r.acc_adapted for r in with_acc}
            b = {r.seed: r.acc_scratch for r in with_acc}
            got, _ = accuracy_difference(a, b, min(r.examples for r in with_acc))
            acc = _interval(got, 100)
        body.append(
            [
                cell,
                via,
                size,
                len(recs),
                ratios,
                _mean(recs, "loss_adapted", ".3f"),
                _mean(recs, "loss_scratch", ".3f"),
                loss,
                _mean(with_acc, "acc_adapted", ".1%"),
                _mean(with_acc, "acc_scratch", ".1%"),
                acc,
            ]
        )
    return [*lines, *md.table(head, body), ""]


def _mean(recs: list[EqualCompute], key: str, spec: str) -> str:
    values = [v for r in recs if (v := getattr(r, key)) is not None]
    return format(sum(values) / len(values), spec) if values else "-"


def _paired(recs: list[EqualCompute], a_key: str, b_key: str) -> str:
    a = {r.seed: v for r in recs if (v := getattr(r, a_key)) is not None}
    b = {r.seed: v for r in recs if (v := getattr(r, b_key)) is not None}
    if not set(a) & set(b):
        return "-"
    got, _ = paired_difference(a, b)
    if got.seeds == 1:
        return f"{got.mean:+.3f} (one seed)"
    return _interval(got, 1)


def _interval(got: Any, scale: float) -> str:
    return got.text(1 if scale == 100 else 3, scale)


def lineage_lines(runs: dict[str, RunRow]) -> list[str]:
    """The stage runs as the registry lists them, with their lineage."""
    rows = [r for r in runs.values() if r.stage]
    if not rows:
        return []
    names = {r.run_id: r.name for r in runs.values()}
    lines = [
        "## Stage runs",
        "",
    ]
    body = []
    for r in rows:
        parent = r.parent_run_id
        body.append(
            [
                r.name,
                r.run_id,
                r.stage,
                r.status,
                names.get(parent, parent) or "-",
                r.parent_step or "-",
                r.matches_run_id or "-",
            ]
        )
    head = ["run", "id", "stage", "status", "parent run", "parent step", "matches"]
    return [*lines, *md.table(head, body), ""]


def render(planned: list, out: Path, runs: dict[str, RunRow], published: dict | None) -> str:
    """The whole `wang_table.md`: the table, the equal-compute comparison, the stage runs."""
    parts = [
        table(planned, out, published),
        *equal_compute_lines(equal_compute(planned, out, runs)),
    ]
    return "\n".join([parts[0], *parts[1:], *lineage_lines(runs)]).rstrip() + "\n"
