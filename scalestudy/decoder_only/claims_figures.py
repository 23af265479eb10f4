"""Figures of the "why decoder-only" report (results from `decoder_only/experiments.py`): inference
cost per turn, each comparison's loss and probe accuracy with 95% intervals, and attention rank
over depth and training steps. PNG files under `<out>/figures/decoder_only/`."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _save(fig: Any, out: Path, name: str) -> str:
    directory = out / "figures" / "decoder_only"
    directory.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(directory / f"{name}.png", dpi=110)
    plt.close(fig)
    return str(Path("figures") / "decoder_only" / f"{name}.png")


def plot_inference(rows: list[dict], out: Path) -> str:
    """Time to first token, total turn time and FLOPs per turn, one line per series."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    by: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by[r["series"]].append(r)
    for series, rs in by.items():
        rs = sorted(rs, key=lambda r: r["turn"])
        turns = [r["turn"] for r in rs]
        axes[0].plot(turns, [r["ttft_s"] * 1e3 for r in rs], "o-", label=series)
        axes[1].plot(turns, [r["total_s"] * 1e3 for r in rs], "o-", label=series)
        axes[2].plot(turns, [r["flops_total"] / 1e9 for r in rs], "o-", label=series)
    for ax, what in zip(axes, ("time to first token (ms)", "turn time (ms)", "turn GFLOPs")):
        ax.set_xlabel("turn k")
        ax.set_ylabel(what)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return _save(fig, out, "inference_cost")


def plot_comparison(c: dict, out: Path, name: str) -> str | None:
    """Validation loss and probe accuracy per group with 95% intervals."""
    groups = c["groups"]
    if not groups:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.5 * len(groups) + 1.8))
    ys = list(range(len(groups)))
    for ax, key, what in zip(axes, ("loss", "acc"), ("validation loss", "probe accuracy")):
        means = [g[key]["mean"] for g in groups]
        halves = [g[key]["half"] or 0.0 for g in groups]
        ax.errorbar(means, ys, xerr=halves, fmt="o", capsize=4)
        ax.set_yticks(ys, [g["label"] for g in groups], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(f"{what} (95% interval)")
        ax.grid(alpha=0.3)
    axes[1].set_yticks(ys, [""] * len(groups))
    fig.suptitle(c["title"], fontsize=9)
    return _save(fig, out, name)


def plot_rank(rank: dict[str, list[dict]], out: Path) -> str | None:
    """Relative effective rank over depth (mean over seeds), one panel per (group, region), a
    line per step."""
    panels = [
        (g, region) for g, rows in rank.items() for region in sorted({r["region"] for r in rows})
    ]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(3.3 * len(panels), 3.2), squeeze=False)
    for ax, (group, region) in zip(axes[0], panels):
        rows = [r for r in rank[group] if r["region"] == region]
        for step in sorted({r["step"] for r in rows}):
            by_layer = defaultdict(list)  # the mean over seeds
            for r in rows:
                if r["step"] == step:
                    by_layer[r["layer"]].append(r["eff_rank_rel"])
            layers = sorted(by_layer)
            means = [sum(by_layer[k]) / len(by_layer[k]) for k in layers]
            ax.plot(layers, means, "o-", label=step)
        ax.set_title(f"{group}\n{region}", fontsize=7)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("effective rank / n")
    axes[0][-1].legend(title="step", fontsize=6)
    return _save(fig, out, "attention_rank")


def plot_experiments(out: Path, results: dict) -> dict[str, list[str]]:
    """Every figure of the report, keyed by section ("inference", "comparison<k>", "rank")."""
    out = Path(out)
    figures: dict[str, list[str]] = {}
    if results.get("inference"):
        figures["inference"] = [plot_inference(results["inference"], out)]
    for k, c in enumerate(results.get("comparisons", []), start=2):
        path = plot_comparison(c, out, f"comparison{k}")
        if path:
            figures[f"comparison{k}"] = [path]
    if results.get("rank"):
        path = plot_rank(results["rank"], out)
        if path:
            figures["rank"] = [path]
    return figures
