"""The report's learning-rate section: what the search of `study/run/lr_search.py` tried at each
point, what it chose, and how much the choice matters.

Per point: the final validation loss at every rate tried (the chosen one in bold), the peak
rate trained, an "edge" mark when the choice still lies at an end of the rates tried, the
margin to the runner-up in seed standard deviations of the study's scored runs there, how many
rates were added beyond the spec's, and the learning-rate sensitivity of Wortsman et al.
(2023); whether the cells' order by held-out loss changes when every cell trains at its
runner-up rate instead; then a figure of loss against rate per cell. `cannot_tell` gives the
lines of the report's "What this study cannot tell" that the search owes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from scalestudy.scaling import render
from scalestudy.study.record.rows import RunRow

CHOICE = "choice.json"  # in OUT/lr_search/, written by lr_search.train_search


def load(out: Path) -> list[dict[str, Any]]:
    """The search's choice.json records, or [] where the study searched no rates."""
    path = Path(out) / "lr_search" / CHOICE
    return json.loads(path.read_text()) if path.exists() else []


def _spread(runs: list[RunRow]) -> dict[tuple[str, str], float]:
    """(cell, size) -> the standard deviation of final validation loss between seeds."""
    by: dict[tuple[str, str], list[float]] = {}
    for r in runs:
        if r.status == "done" and r.loss is not None:
            by.setdefault((r.cell, r.size), []).append(r.loss)
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


def _cell(rec: dict[str, Any]) -> str:
    """A record's cell as `RunRow.cell` names a registry run's: arch/objective[/variant]."""
    return "/".join(p for p in rec["point"][:3] if p)


def _where(rec: dict[str, Any]) -> str:
    size, budget = rec["point"][3:]
    return size + (f" {budget}" if budget else "")


def _row(rec: dict[str, Any], rates: list[float], sd: float | None) -> list[str]:
    """One table row: the loss at each rate of `rates` (bold: chosen; a dash: not tried)."""
    i = rec["chosen_index"]
    at = {r: j for j, r in enumerate(rec["rates"])}
    curve = []
    for r in rates:
        j = at.get(r)
        v = None if j is None else rec["loss"][j]
        text = "—" if j is None else "diverged" if v is None else f"{v:.3f}"
        curve.append(f"**{text}**" if j == i else text)
    finite = sorted(v for v in rec["loss"] if v is not None and math.isfinite(v))
    margin = finite[1] - finite[0] if len(finite) > 1 else math.nan
    return [
        _cell(rec),
        _where(rec),
        *curve,
        f"{rec['peak'][i]:.3g}" + (" (edge)" if rec["edge"] else ""),
        f"{margin:.3f}" + (f" ({margin / sd:.1f} sd)" if sd else ""),
        str(rec.get("extended", 0)),
        f"{rec['sensitivity']:.3f}",
    ]


def _intro(records: list[dict[str, Any]]) -> str:
    """The paragraph above the learning-rate table: what was trained and what each column is."""
    return (
        f"Every cell trained a seed of the search's own (seed {records[0].get('seed', '?')}, "
        f"none of the scored seeds) at {len(records[0].get('grid') or [])} rates at each "
        "searched size (as members of one program); each run's final validation loss, on the "
        "held-out split of the training corpus and never on a scored task, chose the rate "
        "(bold) that the cell's runs at that size train at, every scored seed trained afresh: "
        "no search run enters a verdict, a fit or another table. A choice at an end of the "
        "rates tried added one rate beyond that end (the ratio of the two rates there), "
        f"trained and compared, at most {records[0].get('most', 0)} times per point "
        "(`lr_search.extensions`): `added` counts them, a dash marks a rate not tried. Rates "
        "are the spec's `optim.learning_rate` before the ladder's width rule; `chosen` is the "
        "peak rate trained. `margin`: the runner-up's loss minus the best (in seed standard "
        "deviations of the study's scored runs there: under 1 the choice is within run-to-run "
        "noise). `sens.`: learning-rate sensitivity (Wortsman et al. 2023), the mean excess "
        "loss over the rates tried, a diverged run or one above the loss at initialisation "
        "counting as that loss."
    )


def section(out: Path, runs: list[RunRow]) -> list[str]:
    """The report's learning-rate section (Markdown lines, figure written to OUT/figures);
    empty for a study that searched no rates. `runs`: the study's scored runs (their seed
    spread puts each choice's margin in standard deviations)."""
    records = load(out)
    if not records:
        return []
    rates = sorted({r for rec in records for r in rec["rates"]})
    spread = _spread(runs)
    rows = [_row(rec, rates, spread.get((_cell(rec), rec["point"][3]))) for rec in records]
    head = ["cell", "size", *(f"lr {r:g}" for r in rates), "chosen (peak)", "margin", "added"]
    head.append("sens.")
    lines = [
        "## Learning rates",
        "",
        _intro(records),
        "",
        *render.table(head, rows),
        "",
    ]
    edges = [rec for rec in records if rec["edge"]]
    if edges:
        named = ", ".join(f"{_cell(rec)} at {_where(rec)}" for rec in edges)
        lines += [
            f"Still at an end of the rates tried after the extensions: {named}; the best rate "
            "may lie beyond it (widen `lr_search.rates` or raise `lr_search.extensions`).",
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


def cannot_tell(records: list[dict[str, Any]], runs: list[RunRow]) -> list[str]:
    """The learning-rate lines of the report's "What this study cannot tell" (Markdown list
    items): the chosen rates still at an end of the rates tried, the choices within one seed
    standard deviation of their runner-up (the scored seeds' spread of validation loss at the
    searched size), and the rungs whose depth or peak rate no search run had."""
    if not records:
        return []
    runs = [r for r in runs if r.status == "done"]
    lines = []
    if edges := [f"{_cell(rec)} at {_where(rec)}" for rec in records if rec["edge"]]:
        lines.append(
            f"- Learning rates still at an end of the rates tried, after up to "
            f"{records[0].get('most', 0)} added beyond it: {', '.join(edges)}. The best rate "
            "may lie further out, so these cells may be handicapped in every comparison."
        )
    spread, close = _spread(runs), []
    for rec in records:
        i, second = rec["chosen_index"], _runner_up(rec["loss"])
        sd = spread.get((_cell(rec), rec["point"][3]))
        margin = math.inf if second is None else rec["loss"][second] - rec["loss"][i]
        if sd and margin < sd:
            close.append(
                f"{_cell(rec)} at {_where(rec)} ({rec['rates'][i]:g} over "
                f"{rec['rates'][second]:g} by {margin:.3f}, {margin / sd:.1f} sd)"
            )
    if close:
        lines.append(
            "- Learning-rate choices within one seed standard deviation of the runner-up: "
            f"{'; '.join(close)}. One search seed cannot tell these rates apart; the cell's "
            "verdicts could move with the other rate."
        )
    return lines + unseen(records, runs)


def unseen(records: list[dict[str, Any]], runs: list[RunRow]) -> list[str]:
    """Lines naming the scored rungs that train at a depth (layers per stack) or a peak rate
    no search run of their cell had: the ladder's rate rule scales by width only, and the
    search's losses say nothing about depth or about rates outside those tried."""
    place = {r.size: r.size_index for r in runs}
    depth_at = {(r.cell, r.size): _depth(r) for r in runs}
    depth: dict[str, set[str]] = {}
    outside: dict[str, set[str]] = {}
    for r in runs:
        cell, size = r.cell, r.size
        # The searched size the run's rate came from: the nearest (lower on a tie), as
        # lr_search.rate_for chooses it.
        recs = [rec for rec in records if _cell(rec) == cell and rec["point"][3] in place]
        if not recs or any(rec["point"][3] == size for rec in recs):
            continue
        rec = min(
            recs, key=lambda q: (abs(place[q["point"][3]] - place[size]), place[q["point"][3]])
        )
        there = rec["point"][3]
        if (cell, there) in depth_at and _depth(r) != depth_at[cell, there]:
            said = f"{size} ({_layers(_depth(r))}) from {there} ({_layers(depth_at[cell, there])})"
            depth.setdefault(said, set()).add(cell)
        peak = (r.recipe or {}).get("optim.learning_rate")
        tried = [p for p, v in zip(rec["peak"], rec["loss"]) if v is not None]
        if peak is not None and tried and not min(tried) <= peak <= max(tried):
            outside.setdefault(cell, set()).add(f"{size} at {peak:.3g}")
    lines = []
    if depth:
        said = "; ".join(f"{k}: {', '.join(sorted(v))}" for k, v in sorted(depth.items()))
        lines.append(
            "- Depth is not in the rate rule: these rungs train at a rate searched at another "
            f"depth, scaled for width only ({said}); their rate was not searched at their depth."
        )
    if outside:
        said = "; ".join(f"{c} {', '.join(sorted(v))}" for c, v in sorted(outside.items()))
        lines.append(
            "- Peak rates outside every rate the search tried for the cell (the ladder's rate "
            f"rule carried them there): {said}."
        )
    return lines


def _depth(run: RunRow) -> tuple[int | None, int | None]:
    return (run.n_encoder_layers, run.n_layers)


def _layers(depth: tuple[int | None, int | None]) -> str:
    """(encoder layers, decoder layers) in words: "2 layers", or "2+2 layers" with an encoder."""
    enc, dec = depth
    return f"{enc}+{dec} layers" if enc else f"{dec} layers"


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
