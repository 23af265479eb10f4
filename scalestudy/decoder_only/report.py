"""`decoder_only.md`: one section per claim of the "why decoder-only" experiments, each a
table, its figure and a verdict sentence (see `run.py` for what is measured)."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from scalestudy.study.report import Z95
from scalestudy.study.spec import StudySpec

FLOAT32_TOLERANCE = "rtol = n x float32 eps (n the block size; NumPy's matrix_rank rule)"


def _pm(stats: dict, spec: str = ".4f") -> str:
    if stats.get("mean") is None or not math.isfinite(stats["mean"]):
        return "-"
    half = stats.get("half")
    return f"{stats['mean']:{spec}}" + (f" ± {half:{spec}}" if half is not None else " (1 seed)")


def _figures(figures: dict[str, list[str]], key: str) -> list[str]:
    return [f"![{key}]({f})" for f in figures.get(key, [])] + ([""] if figures.get(key) else [])


def inference_section(results: dict, figures: dict) -> list[str]:
    rows = results["inference"]
    m = results["inference_model"]
    series = list(dict.fromkeys(r["series"] for r in rows))
    by = {(r["series"], r["turn"]): r for r in rows}
    turns = sorted({r["turn"] for r in rows})
    lines = [
        "## 1. Multi-turn inference cost: key/value-cache reuse",
        "",
        f"A dialogue of {len(turns)} turns, each a user message then a greedy reply, on this "
        f"host's CPU; model d_model {m['d_model']}, {m['n_layers']} layers per stack, "
        f"{m['n_heads']} heads, d_ff {m['d_ff']} (weights freshly initialised: cost does not "
        "depend on them). Time to first token (TTFT) and total turn time in ms, the fastest "
        "of the repeats (compilation excluded); FLOPs are what each turn needs by formula "
        "(`counting.decode_flops`, `counting.encoding_flops`).",
        "",
        "| turn | history tokens | " + " | ".join(f"{s}: TTFT / total ms" for s in series) + " |",
        "|---|---|" + "---|" * len(series),
    ]
    for k in turns:
        cells = [
            f"{by[s, k]['ttft_s'] * 1e3:.1f} / {by[s, k]['total_s'] * 1e3:.1f}" for s in series
        ]
        lines.append(f"| {k} | {by[series[0], k]['history_tokens']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| turn | " + " | ".join(f"{s}: GFLOPs first / total" for s in series) + " |",
        "|---|" + "---|" * len(series),
    ]
    for k in turns:
        cells = [
            f"{by[s, k]['flops_first'] / 1e9:.3f} / {by[s, k]['flops_total'] / 1e9:.3f}"
            for s in series
        ]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines += ["", *_figures(figures, "inference")]
    last, reuse = turns[-1], series[0]
    a = by[reuse, last]
    parts = []
    for s in series[1:]:
        b = by[s, last]
        lo, hi = b["ttft_s"] / a["ttft_max_s"], b["ttft_max_s"] / a["ttft_s"]
        word = "slower" if lo > 1 else "faster" if hi < 1 else "not distinguishable"
        parts.append(
            f"{s} {b['ttft_s'] / a['ttft_s']:.1f}x the time to first token (range over repeats "
            f"[{lo:.1f}x, {hi:.1f}x]: {word}; {b['flops_first'] / a['flops_first']:.1f}x the "
            "FLOPs)"
        )
    lines += [
        f"**Verdict.** At turn {last} ({a['history_tokens']} history tokens), against the causal "
        f"decoder reusing its cache: " + "; ".join(parts) + ".",
        "",
    ]
    return lines


def comparison_section(number: int, c: dict, figures: dict) -> list[str]:
    lines = [f"## {number}. {c['title']}", "", c["question"].strip(), ""]
    if c["missing"]:
        lines += [f"No finished runs for {', '.join(c['missing'])}.", ""]
    lines += [
        "| group | seeds | N total | steps | training FLOPs | val loss ± 95% | probe acc ± 95% |",
        "|---|---|---|---|---|---|---|",
    ]
    for g in c["groups"]:
        lines.append(
            f"| {g['label']} | {g['seeds']} | {g['params_total']:.3g} | {g['steps']} "
            f"| {g['flops']:.3g} | {_pm(g['loss'])} | {_pm(g['acc'], '.3f')} |"
        )
    lines += ["", *_figures(figures, f"comparison{number}")]
    if c["verdicts"]:
        lines += ["**Verdict.** " + " ".join(c["verdicts"]), ""]
    else:
        lines += ["**Verdict.** Fewer than two groups finished: nothing to compare.", ""]
    return lines


def _kind(group: str, region: str) -> str:
    """Whether a probed region's attention is bidirectional or causal."""
    if region == "encoder" or (region == "prefix" and group.startswith("noncausal_decoder")):
        return "bidirectional"
    return "causal"


def rank_section(number: int, results: dict, figures: dict) -> list[str]:
    lines = [
        f"## {number}. Attention rank over training",
        "",
        "The attention-rank probes (`scalestudy probe`) on every kept checkpoint, per layer, "
        "averaged over heads and validation examples: for decoder-only models the block of "
        "the input (prefix) positions, bidirectional in the non-causal decoder and causal in "
        "the causal one; for the encoder-decoder its encoder and decoder stacks. Numerical "
        f"rank tolerance: {FLOAT32_TOLERANCE}. Columns: mean relative numerical rank, fraction "
        "of matrices at full rank, mean relative effective rank (averaged over layers).",
        "",
        "| group | region | kind | step | rank / n | full rank | eff. rank / n |",
        "|---|---|---|---|---|---|---|",
    ]
    pooled: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for group, rows in results["rank"].items():
        by: dict[tuple, list[dict]] = defaultdict(list)
        for r in rows:
            by[r["region"], r["step"]].append(r)
        last = max((r["step"] for r in rows), default=None)
        for (region, step), layer_rows in sorted(by.items()):
            mean = {
                k: sum(x[k] for x in layer_rows) / len(layer_rows)
                for k in ("rank_rel", "full", "eff_rank_rel")
            }
            kind = _kind(group, region)
            lines.append(
                f"| {group} | {region} | {kind} | {step} | {mean['rank_rel']:.3f} "
                f"| {mean['full']:.3f} | {mean['eff_rank_rel']:.3f} |"
            )
            if step == last:
                n = sum(x["matrices"] for x in layer_rows)
                pooled[kind][0] += mean["full"] * n
                pooled[kind][1] += n
    lines += ["", *_figures(figures, "rank")]
    if len(pooled) == 2 and all(n for _, n in pooled.values()):
        (hb, nb), (hc, nc) = pooled["bidirectional"], pooled["causal"]
        pb, pc = hb / nb, hc / nc
        half = Z95 * math.sqrt(max(pb * (1 - pb), 1e-12) / nb + max(pc * (1 - pc), 1e-12) / nc)
        d = pb - pc
        span = f"difference {d:+.3f}, 95% interval [{d - half:+.3f}, {d + half:+.3f}]"
        if abs(d) <= half:
            verdict = f"not distinguishable at 95% ({span})"
        else:
            verdict = f"{'more' if d > 0 else 'less'} often full rank than causal ones ({span})"
        lines += [
            f"**Verdict.** At the last checkpoint, bidirectional attention matrices are full "
            f"rank in {pb:.3f} of {nb:.0f} cases and causal ones in {pc:.3f} of {nc:.0f}: "
            f"bidirectional attention is {verdict}; heads and layers of one example are not "
            "independent, so the interval is optimistic.",
            "",
        ]
    else:
        lines += ["**Verdict.** Both kinds of attention are needed to compare; one is missing.", ""]
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
        f"Time taken on this host: {taken}. Intervals are 95%: validation losses by a t "
        "interval over seeds (Welch for differences), probe accuracy by a binomial interval "
        "widened by the seed spread. `report.md` beside this file pools the variants of each "
        "cell; read the comparisons here.",
        "",
    ]
    number = 1
    if "inference" in results:
        lines += inference_section(results, figures)
    for c in results["comparisons"]:
        number += 1
        lines += comparison_section(number, c, figures)
    if "rank" in results:
        lines += rank_section(number + 1, results, figures)
    return "\n".join(lines)
