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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scalestudy.analysis.experts import EXPERTS_JSON
from scalestudy.errors import ScalestudyError
from scalestudy.study import comparisons, verdicts


def measured(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run measured for each MoE cell: its largest rung (by active parameters), first
    seed; in cell order."""
    by_cell: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        if r.get("status") == "done" and (r.get("experts") or 1) > 1 and r.get("workdir"):
            by_cell.setdefault(comparisons.label(r), []).append(r)
    return [
        max(rows, key=lambda r: (r.get("params_active") or 0, -(r.get("seed") or 0)))
        for _, rows in sorted(by_cell.items())
    ]


def _last_dropped(path: Path) -> dict[str, float]:
    """layer -> the share of assignments dropped at the run's last logged step (from the
    training curves in `experts.json`; layers that logged none are absent)."""
    try:
        layers = json.loads(path.read_text())["layers"]
    except (OSError, ValueError, KeyError):
        return {}
    return {
        name: float(layer["training"]["dropped"]["values"][-1])
        for name, layer in layers.items()
        if layer.get("training", {}).get("dropped", {}).get("values")
    }


def _measure(workdir: Path) -> dict[str, Any]:
    from scalestudy.analysis import experts
    from scalestudy.train import logfile

    with logfile.library_logs_of(workdir):  # orbax's notes to the run's log
        return experts.measure_run(workdir)


def section(
    runs: list[dict[str, Any]],
    out: Path,
    measure: Callable[[Path], dict[str, Any]] = _measure,
) -> list[str]:
    """The Markdown lines of the section ([] without MoE runs); figure links are relative to
    the report's folder `out`. A run that cannot be measured is named with the reason."""
    chosen = measured(runs)
    if not chosen:
        return []
    rows, figures, failed = [], [], []
    for r in chosen:
        workdir = Path(r["workdir"])
        try:
            got = measure(workdir)
        except ScalestudyError as e:
            failed.append(f"- {comparisons.label(r)} ({r.get('name')}): not measured: {e}")
            continue
        layers = sorted({k.rsplit("/", 1)[0] for k in got if "/" in k})
        pictures = Path(got["out"])
        dropped = _last_dropped(pictures / EXPERTS_JSON)
        for layer in layers:
            rows.append(
                [
                    comparisons.label(r),
                    str(r.get("size")),
                    layer,
                    f"{got[f'{layer}/load_max']:.2f}",
                    f"{dropped[layer]:.3f}" if layer in dropped else "not logged",
                    f"{got[f'{layer}/mi_domain_bits']:.3f}",
                    f"{got[f'{layer}/mi_token_bits']:.3f}",
                ]
            )
        for layer in layers:
            png = pictures / f"experts_{layer}.png"
            if png.is_file():
                figures.append(f"![{comparisons.label(r)}: {layer}]({os.path.relpath(png, out)})")
    head = [
        "cell", "size", "layer", "busiest / mean load", "dropped", "I(expert; domain)",
        "I(expert; token)",
    ]  # fmt: skip
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
        *verdicts.table(head, rows),
        "",
        *failed,
        *([""] if failed else []),
        *figures,
        "",
    ]
