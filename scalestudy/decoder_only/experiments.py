"""The "why decoder-only" experiments and their report (`decoder_only.md`).

Run after a study's training by `scalestudy study` when the spec has an `experiments:` block.
Runs are grouped by label "arch/objective/variant" (the spec's variants). Sections:

1. inference cost per dialogue turn (`inference_cost.py`): cache reuse vs recomputation;
2.-5. each `comparisons` entry: its groups' validation loss and zero-shot probe accuracy, every
   group against the first by paired differences over common seeds (`stats.py`);
6. attention rank over training: the `attention_rank.py` measures on every kept checkpoint of
   every seed of each `rank` group, per layer: for decoder-only models on the block of the input
   (prefix) positions, bidirectional in the non-causal decoder and causal in the causal one;
   for the encoder-decoder on its encoder and decoder stacks.

Each section ends in verdict sentences with their intervals, n and Holm-adjusted p-values over
all the report's tests, or says a difference is not distinguishable. Figures are drawn by
`decoder_only/claims_figures.py`, the text by `decoder_only/claims_report.py`.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import jax
import numpy as np

from scalestudy.data.pipeline import make_iterator
from scalestudy.decoder_only import (
    attention_rank,
    claims_figures,
    inference_cost,
    order_floor,
    stats,
)
from scalestudy.decoder_only.claims_report import render
from scalestudy.models.api import build_model
from scalestudy.study.plan.spec import ComparisonConfig, StudySpec
from scalestudy.study.record.rows import RunRow, read_curves, read_rows
from scalestudy.study.report import comparisons
from scalestudy.study.report import page as report
from scalestudy.study.run.main_job import REGISTRY_NAME
from scalestudy.train.rundir.saved_run import checkpoint_dir, restore_params

REPORT_NAME = "decoder_only.md"


def label(arch: str, objective: str, variant: str = "") -> str:
    return "/".join(p for p in (arch, objective, variant) if p)


def group_runs(planned: list, registry_rows: list[RunRow]) -> dict[str, list[RunRow]]:
    """Finished registry rows by group label, seeds in order."""
    by_id = {r.run_id: r for r in registry_rows if r.status == "done"}
    groups: dict[str, list[RunRow]] = defaultdict(list)
    for run in sorted(planned, key=lambda r: r.seed):
        if run.run_id in by_id:
            groups[label(run.arch, run.objective, run.variant)].append(by_id[run.run_id])
    return dict(groups)


# ----------------------------------------------------------------------------- comparisons


def _loss_at(
    rows: list[RunRow], curves: dict[str, dict[int, float]], fraction: float
) -> list[RunRow]:
    """Each run's validation loss at its last evaluation at or before `fraction` of training."""
    out = []
    for r in rows:
        steps = {s: v for s, v in curves.get(r.run_id, {}).items() if v is not None}
        early = [s for s in steps if s <= fraction * (r.steps or 0)]
        out.append(r.replace(loss=steps[max(early)] if early else None))
    return out


def _pairwise_tests(
    spec: ComparisonConfig, groups: dict, present: list[str], curves: dict
) -> list[stats.PairedTest]:
    tests = []
    for g in present[1:]:
        pairs = [("loss", "validation loss", True), ("acc", "probe accuracy", False)]
        for kind, what, lower in (p for p in pairs if p[0] in spec.metrics):
            est = stats.paired_difference(groups[g], groups[present[0]], kind)
            tests.append(stats.PairedTest(g, present[0], what, lower, est))
        if spec.also_at is not None:
            a = _loss_at(groups[g], curves, spec.also_at)
            b = _loss_at(groups[present[0]], curves, spec.also_at)
            what = f"validation loss at {spec.also_at:.0%} of training"
            est = stats.paired_difference(a, b, "loss")
            tests.append(stats.PairedTest(g, present[0], what, True, est))
    return tests


def _interaction_tests(
    spec: ComparisonConfig, groups: dict, curves: dict
) -> list[stats.PairedTest]:
    """(B' - B) - (A' - A) on validation loss, seed by seed: positive when the change hurts
    B more than A."""
    a0, a1, b0, b1 = spec.groups
    moments = [(None, "validation loss")]
    if spec.also_at is not None:
        moments.append((spec.also_at, f"validation loss at {spec.also_at:.0%} of training"))
    tests = []
    for fraction, what in moments:
        rows = {
            g: groups[g] if fraction is None else _loss_at(groups[g], curves, fraction)
            for g in spec.groups
        }
        change = {}
        for g0, g1 in ((a0, a1), (b0, b1)):
            before = {r.seed: r.loss for r in rows[g0] if r.loss is not None}
            change[g0] = [
                r.replace(loss=r.loss - before[r.seed])
                for r in rows[g1]
                if r.loss is not None and r.seed in before
            ]
        est = stats.paired_difference(change[b0], change[a0], "loss")
        name, ref = f"({b1} - {b0})", f"({a1} - {a0})"
        tests.append(stats.PairedTest(name, ref, what, True, est))
    return tests


def held_equal(group: str, ref: str, groups: dict, tolerance: float = 0.03) -> dict[str, Any]:
    """What `group` changes from `ref` (the parts of their labels that differ), and which of
    the counted quantities (`study.comparisons.QUANTITIES`) the two hold equal and which not."""
    names = ("architecture", "objective", "variant")
    a, b = group.split("/"), ref.split("/")
    changed = [
        f"{w} ({y or '-'} -> {x or '-'})"
        for w, x, y in zip(names, a + [""] * 3, b + [""] * 3, strict=False)
        if x != y
    ]
    same, differ = comparisons.held_equal(groups[group], groups[ref], tolerance)
    return {"group": group, "reference": ref, "changed": changed, "same": same, "differ": differ}


def compare_groups(
    spec: ComparisonConfig,
    groups: dict[str, list[RunRow]],
    curves: dict | None = None,
    tolerance: float = 0.03,
) -> dict[str, Any]:
    """Per group: seeds, parameters, training FLOPs, loss and accuracy statistics; what each
    group holds equal with the first (`held_equal`, within `tolerance`); and the paired tests
    (verdicts are worded by the report, after Holm's correction over all of them). `curves`:
    validation loss by step per run id, for `also_at`."""
    curves = curves or {}
    out: dict[str, Any] = {"title": spec.title, "question": spec.question, "groups": []}
    out["missing"] = [g for g in spec.groups if g not in groups]
    present = [g for g in spec.groups if g in groups]
    for g in present:
        rows = groups[g]
        out["groups"].append(
            {
                "label": g,
                "seeds": len(rows),
                "params_total": rows[0].params_total,
                "flops": sum(r.flops or 0.0 for r in rows) / len(rows),
                "steps": rows[0].steps,
                "loss": stats.loss_stats(rows),
                "acc": report.acc_stats(rows),
            }
        )
    out["held"] = [held_equal(g, present[0], groups, tolerance) for g in present[1:]]
    if spec.kind == "interaction":
        out["tests"] = _interaction_tests(spec, groups, curves) if not out["missing"] else []
    else:
        out["tests"] = _pairwise_tests(spec, groups, present, curves)
    return out


# ----------------------------------------------------------------------------- rank over training


def _checkpoint_steps(workdir: Path) -> list[int]:
    directory = checkpoint_dir(Path(workdir))
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _validation_rows(cfg: Any, n: int) -> dict[str, np.ndarray]:
    iterator = make_iterator(cfg, "validation")
    batches, rows = [], 0
    while rows < n:
        batches.append(next(iterator))
        rows += len(batches[-1]["decoder_input_tokens"])
    return {k: np.concatenate([b[k] for b in batches])[:n] for k in batches[0]}


RANK_MEASURES = (
    "rank_rel",
    "full",
    *(f"full@{name}" for name in attention_rank.TOLERANCES),
    "exact_full",
    "eff_rank_rel",
    "stable_rank_rel",
    "log10_cond",
    "hidden_eff_rank_rel",
    "hidden_cos",
    "entropy",
)


def rank_over_training(workdir: Path, examples: int) -> list[dict]:
    """Per kept checkpoint of one run, region and layer: the attention-rank measures of
    attention_rank.py averaged over heads and `examples` validation rows (RANK_MEASURES;
    "exact_full" is the fraction provably full rank: lower-triangular, positive diagonal)."""
    out = []
    for step in _checkpoint_steps(workdir):
        cfg, params, _ = restore_params(workdir, step)
        batch = _validation_rows(cfg, examples)
        intermediates = attention_rank.jit_intermediates(build_model(cfg.model))
        per_region: dict[str, list[dict]] = defaultdict(list)
        for start in range(0, examples, attention_rank.ROWS_PER_CALL):
            chunk = {k: v[start : start + attention_rank.ROWS_PER_CALL] for k, v in batch.items()}
            inter = jax.device_get(intermediates(params, chunk))
            if "encoder" not in inter:  # decoder-only: the block of the input (prefix) positions
                inputs = np.asarray(chunk["decoder_loss_weights"]) == 0
                segment = np.asarray(inter["decoder"]["segment_ids"]) * inputs
                inter = {"prefix": {**inter["decoder"], "segment_ids": segment}}
            for region, examples_ in attention_rank.measure_intermediates(inter).items():
                per_region[region].extend(examples_)
        for region, exs in per_region.items():
            mean = {k: np.mean([e[k] for e in exs], axis=0) for k in exs[0]}
            keys = {
                "rank_rel": "attn_rank_rel",
                "full": "attn_full",
                **{f"full@{n}": f"attn_full@{n}" for n in attention_rank.TOLERANCES},
                "exact_full": "attn_triangular_full",
                "eff_rank_rel": "attn_eff_rank_rel",
                "stable_rank_rel": "attn_stable_rank_rel",
                "log10_cond": "attn_log10_cond",
                "entropy": "attn_entropy",
            }
            for layer in range(mean["attn_rank"].shape[0]):
                row = {k: float(mean[v][layer].mean()) for k, v in keys.items()}
                row["hidden_eff_rank_rel"] = float(mean["hidden_eff_rank_rel"][layer])
                row["hidden_cos"] = float(mean["hidden_cos"][layer])
                out.append(
                    {
                        "step": step,
                        "region": region,
                        "layer": layer,
                        **row,
                        "matrices": len(exs) * mean["attn_rank"].shape[1],
                        "length": float(mean["length"]),
                        "head_dim": cfg.model.head_dim,
                    }
                )
    return out


# ----------------------------------------------------------------------------- entry point


def run_experiments(study: StudySpec, planned: list, out: Path) -> Path | None:
    """Run the study's decoder-only experiments over its trained runs in `out` (`planned` is
    the study's expansion) and write decoder_only.md; None when the spec has no
    `experiments:` block."""
    if study.experiments is None:
        return None
    out = Path(out)
    exp = study.experiments
    groups = group_runs(planned, read_rows(out / REGISTRY_NAME))
    results: dict[str, Any] = {"seconds": {}}
    if exp.inference is not None:
        t0 = time.perf_counter()
        largest = max(planned, key=lambda r: r.size_index).cfg.model
        model = largest.replace(**exp.inference.model)
        results["inference_model"] = model.model_dump(mode="json")
        results["inference"] = inference_cost.measure(model, exp.inference)
        results["seconds"]["inference"] = time.perf_counter() - t0
    curves: dict[str, dict[int, float]] = defaultdict(dict)
    for point in read_curves(out / REGISTRY_NAME):
        curves[point.run_id][point.step] = point.val_loss
    floors = {
        run.seed: run.cfg
        for run in planned
        if run.cfg.data.source == "order" and run.arch != "encoder_decoder"
    }
    if floors:  # per seed: the data seed sets which validation batches are scored
        results["order_floor"] = {s: order_floor.validation_floor(c) for s, c in floors.items()}
    results["comparisons"] = [
        compare_groups(c, groups, curves, study.match_tolerance) for c in exp.comparisons
    ]
    if exp.rank is not None:
        t0 = time.perf_counter()
        results["rank"] = {  # every seed: the seed is the unit of replication
            g: [
                {**r, "seed": run.seed}
                for run in groups[g]
                for r in rank_over_training(Path(run.workdir), exp.rank.examples)
            ]
            for g in exp.rank.groups
            if g in groups
        }
        results["seconds"]["rank"] = time.perf_counter() - t0
    results["seconds"]["training"] = sum(
        r.wall_time_s or 0.0 for rows in groups.values() for r in rows
    )
    text = json.dumps(results, indent=1, default=stats.as_json)
    (out / "decoder_only.json").write_text(text)
    figures = claims_figures.plot_experiments(out, results)
    (out / REPORT_NAME).write_text(render(study, results, figures))
    print(f"decoder-only report: {out / REPORT_NAME}")
    return out / REPORT_NAME
