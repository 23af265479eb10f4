"""The report's section on where a study's mixture-of-experts runs send their tokens.

For each MoE cell (architecture/objective/variant) the largest finished rung of its first
seed is measured as `scalestudy experts` measures a run (analysis/experts.py, on the run's
validation text; pictures and `experts.json` in `<run>/experts/`), and the section shows
per MoE layer the load of the busiest expert against the mean, the dropped share, and how
much the router's choice tells about the data domain and the token (mutual information, in
bits), with each layer's picture. One run per cell keeps the report's cost to a forward pass
per cell; the other runs are measured with `scalestudy experts --workdir RUN`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from scalestudy.config.errors import ScalestudyError
from scalestudy.scaling import render
from scalestudy.study.record.rows import RunRow, has_experts


def measured(runs: list[RunRow]) -> list[RunRow]:
    """The run measured for each MoE cell: its largest rung (by active parameters), first
    seed; in cell order."""
    by_cell: dict[str, list[RunRow]] = {}
    for r in runs:
        if r.status == "done" and has_experts([r]) and r.workdir:
            by_cell.setdefault(r.cell, []).append(r)
    return [
        max(rows, key=lambda r: (r.params_active or 0, -(r.seed or 0)))
        for _, rows in sorted(by_cell.items())
    ]


def _measure(workdir: Path) -> tuple[dict[str, Any], Path]:
    """The run's routing as `scalestudy experts` measures it: (`experts.json`, its folder)."""
    from scalestudy.analysis import experts
    from scalestudy.train.rundir import logfile

    with logfile.library_logs_of(workdir):  # orbax's notes to the run's log
        folder = Path(experts.measure_run(workdir)["out"])
    return json.loads((folder / experts.EXPERTS_JSON).read_text()), folder


def _last_dropped(layer: dict[str, Any]) -> str:
    """The share of assignments dropped at the run's last logged training step."""
    values = layer.get("training", {}).get("dropped", {}).get("values")
    return f"{values[-1]:.3f}" if values else "not logged"


def section(runs: list[RunRow], out: Path) -> list[str]:
    """The Markdown lines of the section ([] without MoE runs); figure links are relative to
    the report's folder `out`. A run that cannot be measured is named with the reason."""
    chosen = measured(runs)
    if not chosen:
        return []
    rows, figures, failed = [], [], []
    for r in chosen:
        cell = r.cell
        try:
            results, folder = _measure(Path(r.workdir))
        except ScalestudyError as e:
            failed.append(f"- {cell} ({r.name}): not measured: {e}")
            continue
        for name, layer in sorted(results["layers"].items()):
            rows.append(
                [
                    cell,
                    str(r.size),
                    name,
                    f"{layer['load_max'] or 0.0:.2f}",
                    _last_dropped(layer),
                    f"{layer['mi_domain_bits']:.3f}",
                    f"{layer['mi_token_bits']:.3f}",
                ]
            )
            png = folder / f"experts_{name}.png"
            if png.is_file():
                figures.append(f"![{cell}: {name}]({os.path.relpath(png, out)})")
    head = [
        "cell",
        "size",
        "layer",
        "busiest / mean load",
        "dropped",
        "I(expert; domain)",
        "I(expert; token)",
    ]
    return [
        "## Where the experts send tokens",
        "",
        "Each mixture-of-experts cell's largest rung, first seed, measured on its validation "
        "text as `scalestudy experts` measures a run: the busiest expert's share of routed "
        "tokens over the mean share (1: balanced), the share of assignments dropped at the last "
        "logged training step (capacity dispatch; none when dropless), and what the "
        "router's choice tells about the data domain and the token (mutual information, "
        "bits). Each picture: the experts' shares per domain, the tokens each expert prefers, "
        "the experts chosen for given tokens, and the load over training.",
        "",
        *render.table(head, rows),
        "",
        *failed,
        *([""] if failed else []),
        *figures,
        "",
    ]
