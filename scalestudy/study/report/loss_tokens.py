"""Loss-bearing tokens per cell for the study report: per example and in total (counted on a
config's first batches by `study/plan/loss_token_count.py`).

Cells can differ a lot here (an FLM example has a loss on every token, a span-corruption
example on ~15% plus sentinels; a prefix-LM encoder-decoder that cut its targets would see
fewer than a decoder on the same examples), so the report states them for every cell.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from scalestudy.config.errors import ScalestudyError
from scalestudy.config.experiment import ExperimentConfig
from scalestudy.config.yamlio import parse_yaml, validate
from scalestudy.scaling import render
from scalestudy.study.plan.loss_token_count import measure_loss_tokens
from scalestudy.study.record.registry import Registry
from scalestudy.study.record.rows import RunRow


def _fmt(x: Any, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def lines(runs: list[RunRow], per_example: dict[str, float | str]) -> list[str]:
    """The report section: per cell, loss-bearing tokens per example (a float, or why it was
    not measured) and in total (the runs' `tokens`), and a line per objective whose cells
    differ by more than 10% per example."""
    cells = sorted({r.cell for r in runs} | set(per_example))
    if not cells:
        return []
    out = [
        "## Loss-bearing tokens",
        "",
        "Tokens that carry the training loss: per example (mean over the first two training "
        "batches of the cell), in total (all its runs), and as a share of the positions "
        "processed.",
        "",
    ]
    rows = []
    measured = {c: v for c, v in per_example.items() if not isinstance(v, str)}
    for cell in cells:
        mine = [r for r in runs if r.cell == cell]
        total = sum(r.tokens or 0.0 for r in mine)
        positions = sum(r.positions or 0.0 for r in mine)
        share = total / positions if positions else None
        rows.append(
            [cell, _fmt(measured.get(cell), ".1f"), _fmt(total or None, ".4g"), _fmt(share, ".3f")]
        )
    out += [*render.table(["cell", "per example", "total", "share of positions"], rows), ""]
    notes = [
        f"{cell}: not measured ({v})." for cell, v in per_example.items() if isinstance(v, str)
    ]
    by_objective: dict[str, dict[str, float]] = defaultdict(dict)
    for cell, v in measured.items():
        by_objective[cell.split("/")[1]][cell] = v
    for obj, values in sorted(by_objective.items()):
        few, many = min(values, key=values.get), max(values, key=values.get)
        if values[many] > 1.1 * values[few]:
            notes.append(
                f"Imbalance within `{obj}`: {few} trains on {values[few]:.1f} loss-bearing "
                f"tokens per example, {many} on {values[many]:.1f}."
            )
    return out + [line for note in notes for line in (note, "")]


def per_cell(
    registry: Path, batches: int = 2, run_ids: set[str] | None = None
) -> dict[str, float | str]:
    """Cell -> mean loss-bearing tokens per example, measured on the config of the cell's
    first run in `registry` (among `run_ids`, when given); a cell whose data cannot be read
    here gets the reason instead."""
    configs: dict[str, str] = {}
    with Registry(registry, create=False) as reg:
        for row in map(RunRow.from_row, reg.runs()):
            if run_ids is None or row.run_id in run_ids:
                configs.setdefault(row.cell, row.config or "")
    out: dict[str, float | str] = {}
    for cell, text in sorted(configs.items()):
        try:
            cfg = validate(ExperimentConfig, parse_yaml(text) or {}, f"{cell} config")
            out[cell] = measure_loss_tokens(cfg, batches)
        except ScalestudyError as e:
            out[cell] = str(e)
    return out
