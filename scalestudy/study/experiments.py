"""The "why decoder-only" experiments and their report (`decoder_only.md`).

Run after a study's training by `scalestudy study` when the spec has an `experiments:` block.
Runs are grouped by label "arch/objective/variant" (the spec's variants). Sections:

1. inference cost per dialogue turn (`study/inference_cost.py`): cache reuse vs recomputation;
2.-5. each `comparisons` entry: its groups' validation loss (mean over seeds, t-interval) and
   zero-shot probe accuracy (binomial interval widened by the seed spread), every group against
   the first, with the difference's 95% interval;
6. attention rank over training: the `probes.py` measures on every kept checkpoint of the first
   seed of each `rank` group, per layer: for decoder-only models on the block of the input
   (prefix) positions, bidirectional in the non-causal decoder and causal in the causal one;
   for the encoder-decoder on its encoder and decoder stacks.

Each section ends in a verdict sentence with its interval, or says the difference is not
distinguishable at 95%. Figures come from a `plot` callable (the scaling room's, passed in by
the CLI) so that this module stays left of it in the flow of imports.
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from scalestudy.study import report
from scalestudy.study.registry import load_runs
from scalestudy.study.spec import ComparisonConfig

REPORT_NAME = "decoder_only.md"
Plot = Callable[[Path, dict], dict[str, list[str]]]


def label(arch: str, objective: str, variant: str = "") -> str:
    return "/".join(p for p in (arch, objective, variant) if p)


def group_runs(planned: list, registry_rows: list[dict]) -> dict[str, list[dict]]:
    """Finished registry rows by group label, seeds in order."""
    by_id = {r["run_id"]: r for r in registry_rows if r["status"] == "done"}
    groups: dict[str, list[dict]] = defaultdict(list)
    for run in sorted(planned, key=lambda r: r.seed):
        if run.run_id in by_id:
            row = dict(by_id[run.run_id], variant=run.variant)
            groups[label(run.arch, run.objective, run.variant)].append(row)
    return dict(groups)


# ----------------------------------------------------------------------------- statistics


def _t95(df: int) -> float:
    from scipy import stats

    return float(stats.t.ppf(0.975, df))


def loss_stats(rows: list[dict]) -> dict[str, Any]:
    """Mean validation loss over seeds, its sample variance and the 95% t half-width."""
    xs = [r["loss"] for r in rows if r.get("loss") is not None]
    n = len(xs)
    mean = sum(xs) / n if n else math.nan
    var = sum((x - mean) ** 2 for x in xs) / (n - 1) if n > 1 else None
    half = _t95(n - 1) * math.sqrt(var / n) if var is not None else None
    return {"mean": mean, "var": var, "n": n, "half": half}


def acc_stats(rows: list[dict]) -> dict[str, Any]:
    """Mean probe accuracy over seeds and its 95% half-width (binomial, plus seed spread)."""
    points = []
    for r in rows:
        pa = report.probe_accuracy(r)
        if pa:
            points.append({"acc": pa[0], "n": pa[1]})
    if not points:
        return {"mean": math.nan, "half": None, "n": 0}
    n = len(points)
    mean = sum(p["acc"] for p in points) / n
    var = max(mean * (1 - mean), 1e-12) / max(sum(p["n"] for p in points), 1.0)
    if n > 1:  # the spread between seeds, as the variance of their mean
        var += sum((p["acc"] - mean) ** 2 for p in points) / (n - 1) / n
    return {"mean": mean, "half": report.Z95 * math.sqrt(var), "n": n}


def difference(a: dict, b: dict, kind: str) -> tuple[float, float | None]:
    """a - b and the 95% half-width of the difference (Welch for losses; None without seeds)."""
    d = a["mean"] - b["mean"]
    if kind == "acc":
        if a["half"] is None or b["half"] is None:
            return d, None
        return d, math.sqrt(a["half"] ** 2 + b["half"] ** 2)
    if a["var"] is None or b["var"] is None:
        return d, None
    va, vb = a["var"] / a["n"], b["var"] / b["n"]
    se2 = va + vb
    if se2 == 0.0:
        return d, 0.0
    df = se2**2 / (va**2 / (a["n"] - 1) + vb**2 / (b["n"] - 1))
    return d, _t95(max(1, math.floor(df))) * math.sqrt(se2)


def verdict(name: str, ref: str, d: float, half: float | None, what: str, lower: bool) -> str:
    """One sentence: which is better on `what`, with the interval, or not distinguishable."""
    if half is None:
        return (
            f"{name} vs {ref}, {what}: difference {d:+.4f} from a single seed, no interval "
            "(add seeds)."
        )
    span = f"difference {d:+.4f}, 95% interval [{d - half:+.4f}, {d + half:+.4f}]"
    if abs(d) <= half:
        return f"{name} vs {ref}, {what}: not distinguishable at 95% ({span})."
    better = (d < 0) == lower
    return f"{name} is {'better' if better else 'worse'} than {ref} on {what} ({span})."


def compare_groups(spec: ComparisonConfig, groups: dict[str, list[dict]]) -> dict[str, Any]:
    """Per group: seeds, parameters, training FLOPs, loss and accuracy statistics; verdicts of
    every group against the first."""
    out: dict[str, Any] = {"title": spec.title, "question": spec.question, "groups": []}
    missing = [g for g in spec.groups if g not in groups]
    out["missing"] = missing
    present = [g for g in spec.groups if g in groups]
    for g in present:
        rows = groups[g]
        out["groups"].append(
            {
                "label": g,
                "seeds": len(rows),
                "params_total": rows[0].get("params_total"),
                "flops": sum(r.get("flops") or 0.0 for r in rows) / len(rows),
                "steps": rows[0].get("steps"),
                "loss": loss_stats(rows),
                "acc": acc_stats(rows),
            }
        )
    out["verdicts"] = []
    if len(out["groups"]) >= 2:
        ref = out["groups"][0]
        for g in out["groups"][1:]:
            d, h = difference(g["loss"], ref["loss"], "loss")
            out["verdicts"].append(verdict(g["label"], ref["label"], d, h, "validation loss", True))
            d, h = difference(g["acc"], ref["acc"], "acc")
            out["verdicts"].append(verdict(g["label"], ref["label"], d, h, "probe accuracy", False))
    return out


# ----------------------------------------------------------------------------- rank over training


def _checkpoint_steps(workdir: Path) -> list[int]:
    from scalestudy.train.saved import checkpoint_dir

    directory = checkpoint_dir(Path(workdir))
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _validation_rows(cfg: Any, n: int) -> dict[str, np.ndarray]:
    from scalestudy.data.pipeline import make_iterator

    iterator = make_iterator(cfg, "validation")
    batches, rows = [], 0
    while rows < n:
        batches.append(next(iterator))
        rows += len(batches[-1]["decoder_input_tokens"])
    return {k: np.concatenate([b[k] for b in batches])[:n] for k in batches[0]}


def rank_over_training(workdir: Path, examples: int) -> list[dict]:
    """Per kept checkpoint, region and layer: mean relative numerical rank, fraction of
    full-rank matrices and relative effective rank (probes.py's measures and tolerance)."""
    import jax

    from scalestudy import probes
    from scalestudy.models.api import build_model
    from scalestudy.train.saved import restore_params

    out = []
    for step in _checkpoint_steps(workdir):
        cfg, params, _ = restore_params(workdir, step)
        batch = _validation_rows(cfg, examples)
        intermediates = probes.jit_intermediates(build_model(cfg.model))
        per_region: dict[str, list[dict]] = defaultdict(list)
        for start in range(0, examples, probes.ROWS_PER_CALL):
            chunk = {k: v[start : start + probes.ROWS_PER_CALL] for k, v in batch.items()}
            inter = jax.device_get(intermediates(params, chunk))
            if "encoder" not in inter:  # decoder-only: the block of the input (prefix) positions
                inputs = np.asarray(chunk["decoder_loss_weights"]) == 0
                segment = np.asarray(inter["decoder"]["segment_ids"]) * inputs
                inter = {"prefix": {**inter["decoder"], "segment_ids": segment}}
            for region, examples_ in probes.probe_intermediates(inter).items():
                per_region[region].extend(examples_)
        for region, exs in per_region.items():
            rank_rel = np.mean([e["attn_rank_rel"] for e in exs], axis=0)  # [N, H]
            full = np.mean([e["attn_full"] for e in exs], axis=0)
            eff = np.mean([e["attn_eff_rank_rel"] for e in exs], axis=0)
            for layer in range(rank_rel.shape[0]):
                out.append(
                    {
                        "step": step,
                        "region": region,
                        "layer": layer,
                        "rank_rel": float(rank_rel[layer].mean()),
                        "full": float(full[layer].mean()),
                        "eff_rank_rel": float(eff[layer].mean()),
                        "matrices": len(exs) * rank_rel.shape[1],
                        "length": float(np.mean([e["length"] for e in exs])),
                    }
                )
    return out


# ----------------------------------------------------------------------------- entry point


def run(
    spec: Path, out: Path, overrides: list[str] | tuple[str, ...] = (), plot: Plot | None = None
) -> Path | None:
    """Run the spec's experiments over the trained study in `out` and write decoder_only.md;
    None when the spec has no `experiments:` block."""
    from scalestudy.study import inference_cost
    from scalestudy.study.sweep import REGISTRY_NAME, expand, load_study

    spec, out = Path(spec), Path(out)
    study = load_study(spec, overrides)
    if study.experiments is None:
        return None
    exp = study.experiments
    planned = expand(study, spec.parent)
    groups = group_runs(planned, load_runs(out / REGISTRY_NAME))
    results: dict[str, Any] = {"seconds": {}}
    if exp.inference is not None:
        t0 = time.perf_counter()
        largest = max(planned, key=lambda r: r.size_index).cfg.model
        model = largest.replace(**exp.inference.model)
        results["inference_model"] = model.model_dump(mode="json")
        results["inference"] = inference_cost.measure(model, exp.inference)
        results["seconds"]["inference"] = time.perf_counter() - t0
    results["comparisons"] = [compare_groups(c, groups) for c in exp.comparisons]
    if exp.rank is not None:
        t0 = time.perf_counter()
        results["rank"] = {
            g: rank_over_training(Path(groups[g][0]["workdir"]), exp.rank.examples)
            for g in exp.rank.groups
            if g in groups
        }
        results["seconds"]["rank"] = time.perf_counter() - t0
    results["seconds"]["training"] = sum(
        r.get("wall_time_s") or 0.0 for rows in groups.values() for r in rows
    )
    (out / "decoder_only.json").write_text(json.dumps(results, indent=1, default=float))
    figures = plot(out, results) if plot is not None else {}
    from scalestudy.study.experiments_report import render

    text = render(study, results, figures)
    (out / REPORT_NAME).write_text(text)
    print(f"decoder-only report: {out / REPORT_NAME}")
    return out / REPORT_NAME
