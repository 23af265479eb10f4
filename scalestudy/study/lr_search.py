"""Learning rates chosen on held-out text before a study's runs train (the spec's `lr_search`).

At every searched point of a study (a cell, variant, size and budget) the first seed trains once
per rate of `lr_search.rates`, as members of one program where they fit. Each search run is
scored by its final validation loss, on the validation split of the training corpus; the search
runs are not evaluated on the zero-shot tasks at all, so the choice cannot read an example the
report scores. The rate with the lowest loss is the point's; a size not searched takes the rate
of the nearest searched size (lower on a tie), passed through the ladder's `lr_scaling` rule as
every rate is. The study's runs then train at the chosen rates. The first seed's run at the
chosen rate is the search's own run (the same config, so the same run id): it is copied into the
study and evaluated there rather than trained again.

The search keeps its own registry and run directories in `OUT/lr_search/` (so a stopped search
resumes like a study), and `OUT/lr_search/choice.json` holds every rate's loss, the chosen rate,
whether it lies at an end of the range, and its sensitivity (Wortsman et al. 2023): the mean over
the swept rates of how much worse than the best each is, a run that diverged or ended above the
loss at initialisation (ln of the vocabulary) counting as that loss. The report's section on
it is `study/lr_report.py`.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scalestudy.config import ExperimentConfig
from scalestudy.errors import ConfigError
from scalestudy.study import executors
from scalestudy.study.lr_report import CHOICE
from scalestudy.study.registry import Registry
from scalestudy.study.spec import StudySpec
from scalestudy.train import rundir

DIVERGED = "NonFiniteLoss"  # a search run that stopped on a non-finite loss: data, not a fault

Point = tuple[str, str, str, str, str]  # (arch, objective, variant, size, budget)
Expand = Callable[..., list]  # sweep.expand(study, spec_dir, rates=None): the study's runs


def point(run: Any) -> Point:
    return (run.arch, run.objective, run.variant, run.size, run.budget)


def plan(
    study: StudySpec, spec_dir: Path | None, expand: Expand, order: dict[str, int] | None = None
) -> list:
    """The search's runs: the study's first seed at each searched size, once per rate.
    `expand`: `sweep.expand`; `order`: `sizes_of`'s answer where the caller has it."""
    search = study.lr_search
    sizes = list(order or sizes_of(study, spec_dir, expand))
    unknown = [s for s in map(str, search.sizes) if s not in sizes]
    if unknown:
        raise ConfigError(f"lr_search.sizes: {unknown} are not sizes of the study ({sizes})")
    searched = set(map(str, search.sizes)) or set(sizes)
    runs = []
    for rate in search.rates:
        runs += [
            r
            for r in expand(study, spec_dir, rates=lambda _, rate=rate: rate)
            if r.seed == study.seeds[0] and r.size in searched
        ]
    return runs


def sizes_of(study: StudySpec, spec_dir: Path | None, expand: Expand) -> dict[str, int]:
    """The study's size names -> their place on the ladder."""
    return {r.size: r.size_index for r in expand(study, spec_dir)}


def initial_loss(cfg: ExperimentConfig) -> float:
    """The loss of a uniform guess over the vocabulary: where an untrained model starts."""
    return math.log(cfg.model.vocab_size)


def sensitivity(losses: list[float | None], start: float) -> float:
    """Wortsman et al. (2023)'s learning-rate sensitivity over the swept rates: the mean of
    min(loss, start) - best, a diverged run (None) counting as `start`."""
    capped = [start if v is None or not math.isfinite(v) else min(v, start) for v in losses]
    return sum(capped) / len(capped) - min(capped)


def choose(
    search_runs: list, losses: dict[str, float | None], rates: tuple[float, ...]
) -> dict[Point, dict[str, Any]]:
    """Each searched point's curve and chosen rate from the search runs' final validation
    losses (run id -> loss; None: diverged). `rates` are the spec's values, before the
    ladder's rule, in the order `plan` gives the runs; `peak` is the rate each trained at."""
    out: dict[Point, dict[str, Any]] = {}
    for run in search_runs:
        got = out.setdefault(point(run), {"rates": list(rates), "peak": [], "loss": []})
        got["peak"].append(run.cfg.optim.learning_rate)
        got["loss"].append(losses.get(run.run_id))
        got["start"] = initial_loss(run.cfg)
    for p, got in out.items():
        finite = [(v, i) for i, v in enumerate(got["loss"]) if v is not None and math.isfinite(v)]
        if not finite:
            raise executors.StudyRunError(
                f"lr_search: every rate diverged at {'/'.join(x for x in p if x)}; give lower "
                "lr_search.rates"
            )
        best = min(finite)[1]
        got["chosen_index"] = best
        got["edge"] = best in (0, len(got["loss"]) - 1)
        got["sensitivity"] = sensitivity(got["loss"], got["start"])
    return out


def rate_for(chosen: dict[Point, dict[str, Any]], order: dict[str, int]):
    """A function of a point giving its chosen rate (the spec's value), for `sweep.expand`;
    points not searched take the nearest searched size's choice (lower on a tie); `order`:
    size name -> place on the ladder."""

    def rate(p: Point) -> float | None:
        same = [(abs(order[q[3]] - order[p[3]]), order[q[3]], q) for q in chosen if q[:3] == p[:3]]
        same = [s for s in same if s[2][4] == p[4]] or same
        if not same:
            return None
        got = chosen[min(same)[2]]
        return got["rates"][got["chosen_index"]]

    return rate


def run(study: StudySpec, spec_dir: Path | None, out: Path, expand: Expand, **executor: Any):
    """Train the search (what is missing), write choice.json and return the rate function the
    study's runs are expanded with. `executor`: LocalExecutor's train_fn, workers, members."""
    order = sizes_of(study, spec_dir, expand)
    search_runs = plan(study, spec_dir, expand, order)
    where = Path(out) / "lr_search"
    with Registry(where / "registry.sqlite") as reg:
        reg.add_runs(r.row(study.name, where / "runs" / r.dirname) for r in search_runs)
        print(f"lr_search: {len(search_runs)} runs ({len(study.lr_search.rates)} rates)")
        executors.LocalExecutor(reg, where, evaluate=False, **executor).run(search_runs)
        rows = {r["run_id"]: r for r in reg.runs()}
    faults = [
        f"{r.cfg.name}: {rows[r.run_id].get('error') or rows[r.run_id]['status']}"
        for r in search_runs
        if rows[r.run_id]["status"] != "done" and DIVERGED not in (rows[r.run_id]["error"] or "")
    ]
    if faults:
        raise executors.StudyRunError(
            f"lr_search: {len(faults)} run(s) did not finish ({'; '.join(faults)}); re-run the "
            "same command to retry them (finished runs are kept)"
        )
    losses = {k: r["loss"] if r["status"] == "done" else None for k, r in rows.items()}
    rates = tuple(study.lr_search.rates)
    chosen = choose(search_runs, losses, rates)
    records = [{"point": list(p), **got} for p, got in chosen.items()]
    (where / CHOICE).write_text(json.dumps(records, indent=1))
    return rate_for(chosen, order), search_runs


def adopt(search_runs: list, runs: list, out: Path) -> int:
    """Copy each search run that is also a study run (same id) into the study's run
    directories where the study has none yet; returns how many were copied."""
    ids = {r.run_id: r for r in search_runs}
    copied = 0
    for r in runs:
        source = Path(out) / "lr_search" / "runs" / r.dirname
        target = Path(out) / "runs" / r.dirname
        if r.run_id in ids and not target.exists() and rundir.read_summary(source) is not None:
            shutil.copytree(source, target, ignore=shutil.ignore_patterns(rundir.LOCK))
            copied += 1
    return copied


def resolve(
    study: StudySpec, spec_dir: Path | None, out: Path, runs: list, expand: Expand, **executor: Any
):
    """(the study's runs at their chosen rates, the ids of the search's runs among them) with
    the search trained first (what is missing) and those runs copied in; (`runs`, none) for a
    study without `lr_search`."""
    if study.lr_search is None:
        return runs, frozenset()
    rate, search_runs = run(study, spec_dir, out, expand, **executor)
    runs = expand(study, spec_dir, rates=rate)
    if copied := adopt(search_runs, runs, out):
        print(f"lr_search: {copied} run(s) at their chosen rate taken into the study")
    return runs, frozenset(r.run_id for r in search_runs) & {r.run_id for r in runs}


def not_on_clusters(study: StudySpec, what: str) -> None:
    """Refuse `what` for a study with `lr_search`: its rates are chosen by a search that
    `scalestudy study` trains on this host before the study's runs."""
    if study.lr_search is not None:
        raise ConfigError(
            f"{what}: this study chooses its learning rates first (lr_search), which only "
            "`scalestudy study` does, on this host; run it there, or set the chosen rates in "
            "the spec (optim.learning_rate) and drop lr_search"
        )
