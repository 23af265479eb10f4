"""`scalestudy study --status`: where a study stands, read from its registry (nothing trains).

One line per run, pretraining runs first, then the stage runs after them with their lineage
(the stage, the parent run and the step it started from; a run from scratch names the
adapted run whose total compute it matches).
"""

from __future__ import annotations

from pathlib import Path

from scalestudy.study.record.registry import Registry, planned_runs
from scalestudy.study.record.registry_schema import RegistryError


def status_table(out: str | Path) -> str:
    """The runs of the study in `out` (a study directory or its registry file) as text."""
    path = Path(out)
    path = path / "registry.sqlite" if path.is_dir() or not path.suffix else path
    if not path.is_file():
        raise RegistryError(f"no study registry at {path}; run the study first")
    with Registry(path, create=False) as reg:
        rows = reg.runs(stages=True)
        counts = reg.status_counts()
    names = {r["run_id"]: r["name"] or r["run_id"] for r in rows}
    lineage = {}
    for r in rows:
        parent = r.get("parent_run_id")
        lineage[r["run_id"]] = (
            f"{names.get(parent, parent)} ({r['parent_step']})" if parent else "-"
        )
    w = max(len(n) for n in ["run", *names.values()])
    p = max(len(text) for text in ["parent (step)", *lineage.values()])
    head = f"{'run':<{w}} {'id':<12} {'status':<11} {'stage':<8} {'parent (step)':<{p}} matches"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{names[r['run_id']]:<{w}} {r['run_id']:<12} {r['status'] or '':<11} "
            f"{r.get('stage') or '-':<8} {lineage[r['run_id']]:<{p}} "
            f"{r.get('matches_run_id') or '-'}"
        )
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    lines.append(f"{len(rows)} runs: {summary}")
    gone = planned_runs(rows)[1]
    if gone:
        lines.append(
            f"{len(gone)} not planned by the spec the study last ran with (kept; left out of "
            f"its report, fit and plot): {', '.join(gone)}"
        )
    return "\n".join(lines)
