"""The end of a study: its scaling fits and figures (`study/fits.py`), then report.md/.html.

What the report compares, and why (losses of different objectives are not comparable: an
MLM model predicts 15% of corrupted spans, an FLM model every next token):
- validation loss only *within* an objective: every architecture trained with PLM (or MLM)
  is scored on the same targets, so at equal parameters (per-cell power-law fits evaluated at
  a common N) and at equal compute the architectures can be ranked by loss;
- zero-shot probe accuracy *across* all cells: every cell scores the same probe examples by
  rank classification, which is the common held-out metric, at the largest rung (equal
  parameters for decoder-only cells) and at a common training compute (interpolated in
  log C between each cell's runs), with binomial 95% intervals and seed spread.
"""

from __future__ import annotations

import html
import itertools
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from scalestudy.errors import ScalestudyError
from scalestudy.study import comparisons, task_laws
from scalestudy.study import loss_tokens as loss_token_report
from scalestudy.study.fits import fit_study, fits_lines
from scalestudy.study.fits import fmt as _fmt
from scalestudy.study.registry import load_curves, load_runs
from scalestudy.study.spec import StudySpec

Z95 = 1.959964


def probe_accuracy(run: dict[str, Any]) -> tuple[float, float] | None:
    """(accuracy, number of examples) over every evaluated task's `acc`, example-weighted."""
    hits, total = _task_total(run, "acc", weighted=True)
    return (hits / total, total) if total else None


def _task_total(run: dict[str, Any], metric: str, weighted: bool) -> tuple[float, float]:
    """(sum over tasks of metric, or of metric x examples when `weighted`; examples)."""
    value = total = 0.0
    for key, x in run.items():
        parts = key.split("/")  # eval/<task>/<metric>; deeper keys are breakdowns
        if len(parts) == 3 and parts[0] == "eval" and parts[2] == metric and x is not None:
            n = run.get(key[: -len(metric)] + "n") or 1.0
            value += x * n if weighted else x
            total += n
    return value, total


def chance_accuracy(runs: list[dict[str, Any]]) -> float | None:
    """Probe accuracy of a uniform random guess (example-weighted like `probe_accuracy`)."""
    for run in runs:
        hits, total = _task_total(run, "chance", weighted=True)
        if total:
            return hits / total
    return None


def truncated_share(runs: list[dict[str, Any]]) -> tuple[float, float] | None:
    """(most examples any run had to cut from the left to fit its input length, examples)."""
    shares = [_task_total(r, "truncated", weighted=False) for r in runs]
    shares = [(cut, n) for cut, n in shares if n]
    return max(shares) if shares else None


def _cell(run: dict[str, Any]) -> str:
    return f"{run['arch']}/{run['objective']}"


def acc_stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean probe accuracy over seeds and its 95% half-width (binomial over the examples, plus
    the seed spread); every seed scores the same examples, so they are counted once."""
    points = [pa for r in rows if (pa := probe_accuracy(r))]
    if not points:
        return {"mean": math.nan, "half": None, "n": 0}
    n = len(points)
    mean = sum(acc for acc, _ in points) / n
    var = max(mean * (1 - mean), 1e-12) / max(max(examples for _, examples in points), 1.0)
    if n > 1:  # the spread between seeds, as the variance of their mean
        var += sum((acc - mean) ** 2 for acc, _ in points) / (n - 1) / n
    return {"mean": mean, "half": Z95 * math.sqrt(var), "n": n}


def _winner(scores: dict[str, tuple[float, float]], higher: bool = True) -> str:
    """A sentence naming the best cell and whether its lead exceeds the combined intervals."""
    if len(scores) < 2:
        return "only one cell has results; nothing to compare."
    ranked = sorted(scores.items(), key=lambda kv: kv[1][0], reverse=higher)
    (best, (b, hb)), (second, (s, hs)) = ranked[0], ranked[1]
    gap = abs(b - s)
    sep = math.sqrt(hb**2 + hs**2)
    if sep == 0.0:
        return (
            f"**{best}** ({b:.3f}) over {second} ({s:.3f}); a single seed gives no interval, "
            "so add seeds before trusting a gap this size."
        )
    verdict = (
        "a clear lead (the gap exceeds the combined 95% interval)"
        if gap > sep
        else "not distinguishable from the runner-up at 95% (gap within the combined interval)"
    )
    return f"**{best}** ({b:.3f} ± {hb:.3f}) over {second} ({s:.3f} ± {hs:.3f}): {verdict}."


def _interp_at(points: list[tuple[float, float, float]], c: float) -> tuple[float, float] | None:
    """Accuracy (and 95% half-width) at compute `c`, linear in log C between two runs."""
    pts = sorted(points)
    for (c0, a0, h0), (c1, a1, h1) in itertools.pairwise(pts):
        if c0 <= c <= c1:
            w = 0.0 if c1 == c0 else (math.log(c) - math.log(c0)) / (math.log(c1) - math.log(c0))
            return (1 - w) * a0 + w * a1, math.sqrt(((1 - w) * h0) ** 2 + (w * h1) ** 2)
    if pts and math.isclose(pts[-1][0], c):
        return pts[-1][1], pts[-1][2]
    return None


def _at_common(
    rows: list[dict[str, Any]], x_key: str, y_key: str, half_key: str | None
) -> tuple[float, dict[str, tuple[float, float]]] | None:
    """Each cell's `y_key` at the largest `x_key` every cell spans (log-linear between runs;
    seeds averaged first), with 95% half-widths."""
    per: dict[str, dict[float, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.get(x_key) and r.get(y_key) is not None:
            per[_cell(r)][float(r[x_key])].append(r)
    if len(per) < 2:
        return None
    curves: dict[str, list[tuple[float, float, float]]] = {}
    for cell, by_x in per.items():
        pts = []
        for x, group in by_x.items():
            if half_key == "acc":
                stats = acc_stats(group)
                mean, half = stats["mean"], stats["half"]
            else:
                ys = [g[y_key] for g in group]
                mean = sum(ys) / len(ys)
                sd = (
                    math.sqrt(sum((y - mean) ** 2 for y in ys) / (len(ys) - 1))
                    if len(ys) > 1
                    else 0.0
                )
                half = Z95 * sd / math.sqrt(len(ys))
            pts.append((x, mean, half))
        curves[cell] = pts
    lo = max(min(p[0] for p in pts) for pts in curves.values())
    hi = min(max(p[0] for p in pts) for pts in curves.values())
    if lo > hi:
        return None
    at = {c: _interp_at(p, hi) for c, p in curves.items()}
    return hi, {c: v for c, v in at.items() if v is not None}


def not_scaling(runs: list[dict[str, Any]]) -> list[str]:
    """Cells whose validation loss does not fall at every step up the ladder (seed means)."""
    losses: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        if r.get("loss") is not None and r.get("params_total"):
            losses[_cell(r)][float(r["params_total"])].append(r["loss"])
    bad = []
    for cell, by_n in sorted(losses.items()):
        means = [sum(v) / len(v) for _, v in sorted(by_n.items())]
        if any(b >= a for a, b in itertools.pairwise(means)):
            bad.append(cell)
    return bad


def compare(runs: list[dict[str, Any]], n_key: str = "params_total") -> dict[str, Any]:
    """The report's comparisons: probe accuracy across cells at equal parameters and at equal
    compute, and validation loss within each objective at equal parameters and compute."""
    done = [r for r in runs if r["status"] == "done"]
    for r in done:
        pa = probe_accuracy(r)
        r["acc"], r["n"] = pa if pa else (None, None)
    out: dict[str, Any] = {"n_done": len(done), "n_runs": len(runs), "n_key": n_key}
    out["not_scaling"] = not_scaling(done)
    for name, x_key in (("equal_params", n_key), ("equal_compute", "flops")):
        got = _at_common(done, x_key, "acc", "acc")
        if got:
            out[name] = {"at": got[0], "scores": got[1], "verdict": _winner(got[1])}
        within = {}
        for obj in sorted({r["objective"] for r in done}):
            rows = [r for r in done if r["objective"] == obj]
            got = _at_common(rows, x_key, "loss", None)
            if got:
                within[obj] = {"at": got[0], "scores": got[1], "verdict": _winner(got[1], False)}
        out[name + "_loss"] = within
    return out


def _runs_table(runs: list[dict[str, Any]]) -> list[str]:
    head = (
        "| cell | size | d_model | layers | N total | N non-emb | steps | tokens | FLOPs "
        "| val loss | probe acc | status |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in sorted(
        runs, key=lambda r: (r["size_index"], r["arch"], r["objective"], r.get("seed") or 0)
    ):
        depth = r.get("n_layers")
        if r.get("n_encoder_layers"):
            depth = f"{r.get('n_encoder_layers')}+{r.get('n_layers')}"
        acc = probe_accuracy(r)
        lines.append(
            f"| {_cell(r)} | {r.get('size')} | {r.get('d_model')} | {depth} "
            f"| {_fmt(r.get('params_total'))} "
            f"| {_fmt(r.get('params_non_embedding'))} | {r.get('steps')} | {_fmt(r.get('tokens'))} "
            f"| {_fmt(r.get('flops'), '.2e')} | {_fmt(r.get('loss'), '.4f')} "
            f"| {_fmt(acc[0] if acc else None, '.3f')} | {r.get('status')} |"
        )
    return lines


def _score_table(scores: dict[str, tuple[float, float]], what: str) -> list[str]:
    lines = [f"| cell | {what} | 95% ± |", "|---|---|---|"]
    for cell, (v, h) in sorted(scores.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"| {cell} | {v:.3f} | {h:.3f} |")
    return lines


def render_markdown(
    study: StudySpec,
    runs: list[dict[str, Any]],
    fits: dict[str, Any],
    figures: list[str],
    notes: list[str] = (),
    loss_tokens: dict[str, float | str] | None = None,
) -> str:
    """The report as Markdown: what ran, who wins at equal parameters and compute, fits.

    `loss_tokens`: cell -> mean loss-bearing tokens per example, or why it was not measured
    (`loss_tokens.per_cell`)."""
    cmp = compare(runs)
    wall = sum(r.get("wall_time_s") or 0.0 for r in runs)
    flops = sum(r.get("flops") or 0.0 for r in runs)
    lines = [
        f"# Study `{study.name}`",
        "",
        study.description.strip() or "",
        "",
        f"{cmp['n_done']} of {cmp['n_runs']} runs finished; matching mode "
        f"`{study.matching}`; {flops:.3e} training FLOPs; {wall / 60:.1f} min of training.",
        "",
        "## How to read the comparisons",
        "",
        "Validation losses of different objectives are **not comparable**: an MLM model "
        "predicts corrupted spans, a PLM model the continuation after a prefix, an FLM model "
        "every token. Losses are therefore compared only between architectures trained with "
        "the same objective. Across all cells the common metric is **zero-shot probe "
        "accuracy** (rank classification of the same held-out examples); its intervals are "
        "binomial 95% intervals over probe examples, widened by the seed spread when there "
        "are several seeds.",
        "",
        *(
            [f"Chance (a uniform guess among each example's choices): {chance:.3f}.", ""]
            if (chance := chance_accuracy(runs)) is not None
            else []
        ),
        *(
            [
                f"{cut:.0f} of {n:.0f} probe examples had their context cut from the left to "
                "fit the models' input length, so the probes mostly test consistency with the "
                "nearest context; raise `eval.inputs_length` (or train longer sequences) to "
                "test longer-range structure.",
                "",
            ]
            if (share := truncated_share(runs)) and (cut := share[0]) and (n := share[1])
            else []
        ),
        "## Verdicts",
        "",
    ]
    if cmp["not_scaling"]:
        lines += [
            f"Validation loss falls at every step up the ladder except in "
            f"{', '.join(cmp['not_scaling'])}: at this budget those cells' larger rungs are "
            "not yet ahead (train longer, or scale the learning rate down with width), so "
            "read their fits with care.",
            "",
        ]
    elif cmp["n_done"]:
        lines += ["Validation loss falls at every step up the ladder in every cell.", ""]
    n_what = "total parameters" if cmp["n_key"] == "params_total" else "non-embedding parameters"
    for name, title, x_what in (
        ("equal_params", "Equal parameters", n_what),
        ("equal_compute", "Equal compute", "training FLOPs"),
    ):
        if name in cmp:
            c = cmp[name]
            lines += [
                f"**{title}** (probe accuracy at {c['at']:.3g} {x_what}, the largest value "
                "every cell spans, interpolated in log scale between runs): " + c["verdict"],
                "",
                *_score_table(c["scores"], "probe accuracy"),
                "",
            ]
        for obj, c in cmp[name + "_loss"].items():
            lines += [
                f"- {title.lower()}, validation loss within `{obj}` (at {c['at']:.3g} "
                f"{x_what}; lower is better): " + c["verdict"],
            ]
        if cmp[name + "_loss"]:
            lines.append("")
    lines += comparisons.lines(runs, study.match_tolerance)
    if fits or notes:
        lines += ["## Scaling-law fits", "", *notes, *fits_lines(fits), ""]
    lines += task_laws.section(fits)
    if figures:
        lines += ["## Figures", ""] + [f"![{Path(f).stem}]({f})" for f in figures] + [""]
    if loss_tokens is not None:
        lines += loss_token_report.lines(runs, loss_tokens)
    lines += ["## Runs", "", *_runs_table(runs), ""]
    return "\n".join(lines)


def render_html(markdown: str) -> str:
    """A minimal self-contained HTML page for the Markdown report (tables and images)."""
    body: list[str] = []
    rows: list[str] = []
    for line in [*markdown.splitlines(), ""]:
        if line.startswith("|"):
            if not set(line) <= set("|-: "):
                cells = [html.escape(c.strip()) for c in line.strip("|").split("|")]
                tag = "th" if not rows else "td"
                rows.append("<tr>" + "".join(f"<{tag}>{c}</{tag}>" for c in cells) + "</tr>")
            continue
        if rows:
            body.append("<table>" + "".join(rows) + "</table>")
            rows = []
        if line.startswith("!["):
            src = line[line.index("(") + 1 : -1]
            body.append(f'<img src="{html.escape(src)}" style="max-width:48%">')
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{html.escape(line.lstrip('# '))}</h{level}>")
        elif line.strip():
            body.append(f"<p>{html.escape(line)}</p>")
    style = "body{font-family:sans-serif;max-width:70em;margin:auto}td,th{padding:2px 8px}"
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><style>{style}</style></head>"
        f"<body>{''.join(body)}</body></html>"
    )


def finalize(study: StudySpec, out: Path) -> Path:
    """Write `out/report.md` and `out/report.html` from the registry, with the study's fits
    and figures (`out/fits.json`, `out/figures/`); returns the Markdown path."""
    out = Path(out)
    runs = load_runs(out / "registry.sqlite")
    fits: dict[str, Any] = {}
    figures: list[str] = []
    notes: list[str] = []
    done = [r for r in runs if r["status"] == "done"]
    if done:
        try:
            fits, paths = fit_study(study, out, done, load_curves(out / "registry.sqlite"))
            figures = [str(Path(p).relative_to(out)) for p in paths if str(p).endswith(".png")]
        except ScalestudyError as e:  # too few runs to fit is a finding, not a crash
            notes.append(f"Scaling fits were not possible: {e}")
    per_example = loss_token_report.per_cell(out / "registry.sqlite")
    text = render_markdown(study, runs, fits, figures, notes, per_example)
    from scalestudy.scaling.zeroshot_plots import report_section  # matplotlib: load late

    text += report_section(done, out)
    (out / "report.md").write_text(text)
    (out / "report.html").write_text(render_html(text))
    print(f"report: {out / 'report.md'}")
    return out / "report.md"
