"""`decoder_only.md`: one section per claim of the "why decoder-only" experiments, each a
table, its figure and a verdict sentence (see `decoder_only/experiments.py` for what is
measured)."""

from __future__ import annotations

import math
from typing import Any

from scalestudy.decoder_only import stats
from scalestudy.decoder_only.rank_report import figure_lines as _figures
from scalestudy.decoder_only.rank_report import rank_section, rank_tests
from scalestudy.scaling import render as md
from scalestudy.study.plan.spec import StudySpec


def _pm(summary: dict, spec: str = ".4f") -> str:
    if summary.get("mean") is None or not math.isfinite(summary["mean"]):
        return "-"
    half = summary.get("half")
    return f"{summary['mean']:{spec}}" + (f" ± {half:{spec}}" if half is not None else " (1 seed)")


def inference_section(results: dict, figures: dict) -> list[str]:
    rows = results["inference"]
    m = results["inference_model"]
    series = list(dict.fromkeys(r["series"] for r in rows))
    by = {(r["series"], r["turn"]): r for r in rows}
    turns = sorted({r["turn"] for r in rows})
    load = max(r.get("load_average", 0.0) for r in rows)
    lines = [
        "## 1. Multi-turn inference cost: key/value-cache reuse",
        "",
        f"A dialogue of {len(turns)} turns, each a user message then a greedy reply, on this "
        f"host's CPU (load average up to {load:.1f} while timing); model d_model "
        f"{m['d_model']}, {m['n_layers']} layers per stack, {m['n_heads']} heads, d_ff "
        f"{m['d_ff']} (weights freshly initialised: cost does not depend on them). Time to "
        "first token (TTFT) in ms: the fastest, median and slowest of the repeats "
        "(compilation excluded). FLOPs (`models/counting.py`) twice: what the turn needs (keys "
        "written so far) and what the program runs (every slot of its cache buffer).",
        "",
    ]
    ttft, flops = [], []
    for k in turns:
        cells = [
            f"{by[s, k]['ttft_s'] * 1e3:.1f} / {by[s, k]['ttft_median_s'] * 1e3:.1f}"
            f" / {by[s, k]['ttft_max_s'] * 1e3:.1f}"
            for s in series
        ]
        ttft.append([k, by[series[0], k]["history_tokens"], *cells])
        cells = [
            f"{by[s, k]['flops_first'] / 1e9:.3f} / {by[s, k]['flops_first_run'] / 1e9:.3f}"
            for s in series
        ]
        flops.append([k, *cells])
    head = ["turn", "history tokens", *(f"{s}: TTFT fastest / median / slowest" for s in series)]
    lines += md.table(head, ttft)
    head = ["turn", *(f"{s}: GFLOPs to first token, needed / run" for s in series)]
    lines += ["", *md.table(head, flops)]
    lines += ["", *_figures(figures, "inference")]
    lines += _inference_verdict(by, series, turns)
    return lines


def _inference_verdict(by: dict, series: list[str], turns: list[int]) -> list[str]:
    """Each series against the causal decoder reusing its cache (the first), at the last turn."""
    last, reuse = turns[-1], series[0]
    a = by[reuse, last]
    parts = []
    for s in series[1:]:
        b = by[s, last]
        lo, hi = b["ttft_s"] / a["ttft_max_s"], b["ttft_max_s"] / a["ttft_s"]
        word = "slower" if lo > 1 else "faster" if hi < 1 else "not distinguishable"
        parts.append(
            f"{s} runs {b['flops_first_run'] / a['flops_first_run']:.1f}x the FLOPs to the "
            f"first token ({b['flops_first'] / a['flops_first']:.1f}x needed) and took "
            f"{b['ttft_s'] / a['ttft_s']:.1f}x the time (range over repeats "
            f"[{lo:.1f}x, {hi:.1f}x]: {word})"
        )
    return [
        f"**Verdict.** At turn {last} ({a['history_tokens']} history tokens), against the causal "
        f"decoder reusing its cache: " + "; ".join(parts) + ". The time ratios are one "
        "host's, with the spread of the repeats; the FLOP ratios are exact.",
        "",
    ]


def comparison_section(number: int, c: dict, figures: dict, verdicts: list[str]) -> list[str]:
    lines = [f"## {number}. {c['title']}", "", c["question"].strip(), ""]
    if c["missing"]:
        lines += [f"No finished runs for {', '.join(c['missing'])}.", ""]
    head = ["group", "seeds", "N total", "steps", "training FLOPs", "val loss ± 95%"]
    head.append("probe acc ± 95%")
    rows = [
        [
            g["label"],
            g["seeds"],
            f"{g['params_total']:.3g}",
            g["steps"],
            f"{g['flops']:.3g}",
            _pm(g["loss"]),
            _pm(g["acc"], ".3f"),
        ]
        for g in c["groups"]
    ]
    lines += [*md.table(head, rows), ""]
    for h in c.get("held", []):
        line = f"- {h['group']} against {h['reference']}: changes {', '.join(h['changed'])}"
        line += f"; held equal: {', '.join(h['same']) or 'nothing counted'}"
        line += f"; not equal: {', '.join(h['differ'])}." if h["differ"] else "."
        lines.append(line)
    lines += ["", *_figures(figures, f"comparison{number}")]
    if verdicts:
        lines += ["**Verdict.** " + " ".join(verdicts), ""]
    else:
        lines += ["**Verdict.** Fewer than two groups finished: nothing to compare.", ""]
    return lines


def render(study: StudySpec, results: dict[str, Any], figures: dict[str, list[str]]) -> str:
    """The whole decoder-only report as Markdown."""
    sec = results["seconds"]
    taken = ", ".join(f"{k} {v / 60:.1f} min" for k, v in sec.items())
    lines = [
        f"# Why decoder-only: study `{study.name}`",
        "",
        study.description.strip(),
        "",
        f"Time taken on this host: {taken}. Intervals are 95% and unadjusted, with the run "
        "as the unit. Per group: validation loss and probe accuracy by a t-interval over "
        "seeds (a run's accuracy is its mean over the examples every seed scores, so no "
        "examples term is added). Differences between groups are paired by seed (the same "
        "seed gives the same data order and initialisation stream) with a t-interval over the "
        "common seeds (`decoder_only/stats.py`). Verdicts are tested at 5% after Holm's "
        "correction over "
        "every test in this report, and each shows its n. Each comparison names what its "
        "groups change and what they hold equal (within the study's `match_tolerance`).",
        "",
    ]
    if floors := results.get("order_floor"):
        lines += [
            "Loss floor of the order task: a predictor that knows the task exactly scores "
            + ", ".join(f"{v:.4f} (seed {k})" for k, v in sorted(floors.items()))
            + " nats on the validation batches each seed's runs are scored on "
            "(`decoder_only/order_floor.py`); a model that has learnt the reversal is close "
            "to it.",
            "",
        ]
    sections = [c["tests"] for c in results["comparisons"]]
    sections.append(rank_tests(results["rank"]) if "rank" in results else [])
    adjusted = iter(stats.holm([test.est.p for tests in sections for test in tests]))
    verdicts = [
        [stats.verdict(t.name, t.ref, t.est, t.what, t.lower, next(adjusted)) for t in tests]
        for tests in sections
    ]
    number = 1
    if "inference" in results:
        lines += inference_section(results, figures)
    for c, said in zip(results["comparisons"], verdicts):
        number += 1
        lines += comparison_section(number, c, figures, said)
    if "rank" in results:
        lines += rank_section(number + 1, results, figures, verdicts[-1])
    return "\n".join(lines)
