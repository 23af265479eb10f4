"""The pictures of `experts.py`: one figure per MoE layer (PNG and SVG), four panels:
token distribution over experts per domain, the tokens each expert prefers, the experts
chosen for given strings, and load balance over training. Drawing only: every number comes
from the results `experts.measure_run` computed (and writes to experts.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from scalestudy.scaling import figstyle

plt = figstyle.plt


def shown(text: str) -> str:
    """A token as a label: spaces and line breaks made visible."""
    return text.replace(" ", "\u2423").replace("\n", "\\n") or "\u2205"


def _heat(ax: Any, fig: Any, rows: list[str], share: np.ndarray, title: str) -> None:
    im = ax.imshow(share, aspect="auto", cmap="viridis", vmin=0.0)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.set_xticks(range(share.shape[1]))
    ax.set_xlabel("expert")
    ax.set_title(title, fontsize=10)
    if share.shape[1] <= 16 and share.size <= 256:
        for (r, c), v in np.ndenumerate(share):
            if np.isfinite(v):
                ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=6, color="w")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02, label="share of assignments")


def _domains(ax: Any, fig: Any, layer: dict) -> None:
    names = [n for n, d in layer["domains"].items() if d["share"] is not None]
    share = np.array([layer["domains"][n]["share"] for n in names])
    _heat(
        ax,
        fig,
        [f"{n} ({layer['domains'][n]['positions']})" for n in names],
        share,
        "token distribution over experts, per domain (positions)",
    )


def _top_tokens(ax: Any, fig: Any, layer: dict) -> None:
    experts = layer["experts"]
    top = max((len(e["top_tokens"]) for e in experts), default=0)
    share = np.full((top, len(experts)), np.nan)
    for e in experts:
        for r, t in enumerate(e["top_tokens"]):
            share[r, e["expert"]] = t["share"]
    im = ax.imshow(share, aspect="auto", cmap="magma", vmin=0.0)
    for e in experts:
        for r, t in enumerate(e["top_tokens"]):
            ax.text(
                e["expert"],
                r,
                shown(t["text"]),
                ha="center",
                va="center",
                fontsize=7,
                color="w" if t["share"] < 0.6 * np.nanmax(share) else "k",
            )
    ax.set_yticks(range(top), [f"#{r + 1}" for r in range(top)], fontsize=8)
    ax.set_xticks(
        range(len(experts)), [f"{e['expert']}\n{e['share']:.0%}" for e in experts], fontsize=7
    )
    ax.set_xlabel("expert (its share of all assignments)")
    ax.set_title("tokens each expert prefers (colour: share of its assignments)", fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02)


def _given(ax: Any, fig: Any, layer: dict) -> None:
    rows = [(s, g) for s, g in layer["tokens"].items() if g["share"] is not None]
    if not rows:
        ax.text(0.5, 0.5, "none of the given strings occurs", ha="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    share = np.array([g["share"] for _, g in rows])
    _heat(
        ax,
        fig,
        [f"{shown(s)} ({g['positions']})" for s, g in rows],
        share,
        "experts chosen for given strings (positions)",
    )


def _training(ax: Any, layer: dict) -> None:
    curves = layer["training"]
    if "load_max" not in curves:
        ax.text(
            0.5,
            0.5,
            "load balance not logged in metrics.jsonl",
            ha="center",
            transform=ax.transAxes,
        )
        ax.set_axis_off()
        return
    c = curves["load_max"]
    ax.plot(c["steps"], c["values"], color="C0", label="busiest expert's load / mean")
    if "dropped" in curves:
        d = curves["dropped"]
        ax.plot(d["steps"], d["values"], color="C3", label="dropped share")
    ax.axhline(1.0, color="0.6", lw=0.8, ls=":")
    ax.set_xlabel("step")
    ax.set_ylabel("load")
    ax.set_title("load balance over training", fontsize=10)
    lines, labels = ax.get_legend_handles_labels()
    if "bias_min" in curves and "bias_max" in curves:
        twin = ax.twinx()
        lo, hi = curves["bias_min"], curves["bias_max"]
        twin.fill_between(
            lo["steps"],
            lo["values"],
            hi["values"],
            color="C2",
            alpha=0.25,
            label="balancing bias range (right)",
        )
        twin.set_ylabel("bias")
        more = twin.get_legend_handles_labels()
        lines, labels = lines + more[0], labels + more[1]
    ax.legend(lines, labels, fontsize=7, loc="upper right")


def draw(results: dict[str, Any], out: Path) -> list[Path]:
    """One figure per MoE layer of `results` in `out` (experts_<layer>.png and .svg)."""
    paths: list[Path] = []
    for name, layer in results["layers"].items():
        fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
        _domains(axes[0, 0], fig, layer)
        _top_tokens(axes[0, 1], fig, layer)
        _given(axes[1, 0], fig, layer)
        _training(axes[1, 1], layer)
        fig.suptitle(
            f"{name}: {results['router']} router, top {results['top_k']} of "
            f"{results['routed_experts']} experts, step {results['step']}; "
            f"I(expert; domain) {layer['mi_domain_bits']:.2f} bits, "
            f"I(expert; token) {layer['mi_token_bits']:.2f} bits",
            fontsize=11,
        )
        paths += figstyle.save(fig, out, f"experts_{name}")
    return paths
