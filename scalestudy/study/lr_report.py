"""The report's learning-rate section: what the search of `study/lr_search.py` tried at each
point, what it chose, and how much the choice matters.

Per point: the final validation loss at every rate (the chosen one in bold), the peak rate
trained, an "edge" mark when the choice lies at an end of the range, the margin to the
runner-up in seed standard deviations of the study's runs there, and the learning-rate
sensitivity of Wortsman et al. (2023); whether the cells' order by held-out loss changes when
every cell trains at its runner-up rate instead; then a figure of loss against rate per cell.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from scalestudy.scaling.io import cell_label

CHOICE = "choice.json"  # in OUT/lr_search/, written by lr_search.run


def load(out: Path) -> list[dict[str, Any]]:
    """The search's choice.json records, or [] where the study searched no rates."""
    path = Path(out) / "lr_search" / CHOICE
    return json.loads(path.read_text()) if path.exists() else []


def _spread(runs: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
    """(cell, size) -> the standard deviation of final validation loss between seeds."""
    by: dict[tuple[str, str], list[float]] = {}
    for r in runs:
        if r.get("status") == "done" and r.get("loss") is not None:
            by.setdefault((cell_label(r), r["size"]), []).append(r["loss"])
    out = {}
    for key, v in by.items():
        if len(v) > 1:
            m = sum(v) / len(v)
            out[key] = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))
    return out


def _runner_up(losses: list[float | None]) -> int | None:
    """The index of the second-lowest finite loss (None with fewer than two)."""
    finite = sorted((v, j) for j, v in enumerate(losses) if v is not None and math.isfinite(v))
    return finite[1][1] if len(finite) > 1 else None


def flips(records: list[dict[str, Any]]) -> list[str]:
    """Whether the order of cells would change with the rate: per objective and searched size,
    the cells ordered by held-out loss at their chosen rates and at their runner-up rates
    (the search's own runs: nothing is retrained, and no scored task is read). One line each
    (Markdown list items), naming the pairs that swap."""
    by: dict[tuple[str, str, str], list[tuple[str, float, float]]] = {}
    for rec in records:
        arch, objective, variant, size, budget = rec["point"]
        second = _runner_up(rec["loss"])
        if second is None:
            continue
        cell = "/".join(p for p in (arch, variant) if p)
        chosen, runner = rec["loss"][rec["chosen_index"]], rec["loss"][second]
        by.setdefault((objective, size, budget), []).append((cell, chosen, runner))
    lines = []
    for (objective, size, budget), cells in by.items():
        if len(cells) < 2:
            continue
        at_best = [c for c, *_ in sorted(cells, key=lambda c: c[1])]
        at_second = [c for c, *_ in sorted(cells, key=lambda c: c[2])]
        swapped = [
            f"{a} and {b}"
            for i, a in enumerate(at_best)
            for b in at_best[i + 1 :]
            if at_second.index(a) > at_second.index(b)
        ]
        where = f"{objective.upper()} at {size}" + (f" {budget}" if budget else "")
        said = "the same order" if not swapped else "swapped: " + "; ".join(swapped)
        best = "the best cell stays best" if at_best[0] == at_second[0] else "a new best cell"
        lines.append(
            f"- {where}: {' < '.join(at_best)} at the chosen rates; at each cell's runner-up "
            f"rate {' < '.join(at_second)} ({said}; {best})."
        )
    return lines


def section(out: Path, runs: list[dict[str, Any]]) -> list[str]:
    """The report's learning-rate section (Markdown lines, figure written to OUT/figures);
    empty for a study that searched no rates."""
    records = load(out)
    if not records:
        return []
    rates = records[0]["rates"]
    spread = _spread(runs)
    rows = []
    for rec in records:
        arch, objective, variant, size, budget = rec["point"]
        cell = "/".join(p for p in (arch, objective, variant) if p)
        i = rec["chosen_index"]
        finite = sorted(v for v in rec["loss"] if v is not None and math.isfinite(v))
        margin = finite[1] - finite[0] if len(finite) > 1 else math.nan
        sd = spread.get((f"{arch}/{objective}", size))
        curve = [
            ("diverged" if v is None else f"{v:.3f}") if j != i else f"**{v:.3f}**"
            for j, v in enumerate(rec["loss"])
        ]
        rows.append(
            [
                cell,
                size + (f" {budget}" if budget else ""),
                *curve,
                f"{rec['peak'][i]:.3g}" + (" (edge)" if rec["edge"] else ""),
                f"{margin:.3f}" + (f" ({margin / sd:.1f} sd)" if sd else ""),
                f"{rec['sensitivity']:.3f}",
            ]
        )
    from scalestudy.study.verdicts import table

    head = ["cell", "size", *(f"lr {r:g}" for r in rates), "chosen (peak)", "margin", "sens."]
    edges = sum(rec["edge"] for rec in records)
    lines = [
        "## Learning rates",
        "",
        f"Every cell's first seed trained at {len(rates)} rates at each searched size (as "
        "members of one program); each run's final validation loss, on the held-out split of "
        "the training corpus and never on a scored task, chose the rate (bold) that the "
        "cell's runs at that size train at. Rates are the spec's `optim.learning_rate` before "
        "the ladder's width rule; `chosen` is the peak rate trained. `margin`: the runner-up's "
        "loss minus the best (in seed standard deviations of the study's runs there: under "
        "about 1 the choice is within run-to-run noise). `sens.`: learning-rate sensitivity "
        "(Wortsman et al. 2023), the mean excess loss over the swept rates, a diverged run or "
        "one above the loss at initialisation counting as that loss.",
        "",
        *table(head, rows),
        "",
    ]
    if edges:
        lines += [
            f"At {edges} of {len(records)} points the chosen rate is at an end of the swept "
            "range: the best rate may lie beyond it (widen `lr_search.rates`).",
            "",
        ]
    swaps = flips(records)
    if swaps:
        lines += [
            "Would the order of cells change with the rate? Held-out loss of the search's "
            "runs (one seed each) with every cell at its chosen rate, and with every cell at "
            "its runner-up rate instead:",
            "",
            *swaps,
            "",
        ]
    if figure(records, Path(out) / "figures"):
        lines += ["![lr_search](figures/lr_search.png)", ""]
    return lines


def figure(records: list[dict[str, Any]], where: Path) -> bool:
    """Final validation loss against peak learning rate, one panel per cell, one line per
    size, the chosen rate ringed; returns whether it was drawn."""
    import matplotlib

    matplotlib.use("Agg")
    from scalestudy.scaling import figstyle as fs

    by_cell: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        by_cell.setdefault("/".join(p for p in rec["point"][:3] if p), []).append(rec)
    fig, axs = fs.grid(len(by_cell), width=3.6, height=3.0, ncols=4)
    for ax, (cell, recs) in zip(axs, by_cell.items()):
        for rec in recs:
            pts = [(p, v) for p, v in zip(rec["peak"], rec["loss"]) if v is not None]
            if not pts:
                continue
            line = ax.plot(*zip(*pts), marker="o", ms=3, label=rec["point"][3])[0]
            i = rec["chosen_index"]
            ax.scatter(
                [rec["peak"][i]], [rec["loss"][i]], s=70, facecolor="none", color=line.get_color()
            )
        fs.axes(ax, "peak learning rate", "final validation loss", logy=False)
        ax.set_title(cell, fontsize=9)
        ax.legend(fontsize=6, title="size", title_fontsize=6)
    where.mkdir(parents=True, exist_ok=True)
    fs.save(fig, where, "lr_search")
    return True
