"""Learning rates chosen on held-out text before a study's runs train (the spec's `lr_search`).

At every searched point of a study (a cell, variant, size and budget) a seed of the search's
own (`lr_search.seed`, never one of the study's scored seeds) trains once per rate of
`lr_search.rates`, as members of one program where they fit. Each search run is scored by its
final validation loss, on the validation split of the training corpus; the search runs are not
evaluated on the zero-shot tasks at all, so the choice cannot read an example the report
scores. The rate with the lowest loss is the point's. A choice at an end of the rates tried
extends them: one more rate beyond that end (the ratio between the two rates at that end),
trained and compared, at most `lr_search.extensions` times per point. A size not searched takes
the rate of the nearest searched size (lower on a tie), passed through the ladder's
`lr_scaling` rule as every rate is. The study's runs, every scored seed included, then train at
the chosen rates; no search run is a study run, so none enters a verdict, a fit or a table
other than the report's learning-rate section.

The search keeps its own registry and run directories in `OUT/lr_search/` (so a stopped search
resumes like a study), and `OUT/lr_search/choice.json` holds every rate's loss, the chosen rate,
whether it lies at an end of the rates tried, how many rates were added beyond the spec's, and
its sensitivity (Wortsman et al. 2023): the mean over the swept rates of how much worse than the
best each is, a run that diverged or ended above the loss at initialisation (ln of the
vocabulary) counting as that loss. The report's section on it is `study/report/lr_report.py`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import ExperimentConfig
from scalestudy.study.plan.spec import RepeatSeedsConfig, StudySpec
from scalestudy.study.record.registry import Registry
from scalestudy.study.report.lr_report import CHOICE
from scalestudy.study.run import executors

DIVERGED = "NonFiniteLoss"  # a search run that stopped on a non-finite loss: data, not a fault

Point = tuple[str, str, str, str, str]  # (arch, objective, variant, size, budget)
Expand = Callable[..., list]  # sweep.expand(study, spec_dir, rates=None): the study's runs
Tried = list[tuple[float, Any]]  # (the spec's rate, the search run that trained it)


def point(run: Any) -> Point:
    return (run.arch, run.objective, run.variant, run.size, run.budget)


def search_study(study: StudySpec) -> StudySpec:
    """The study as its search trains it: the search's own seed, no scored seed (and no
    search of its own: its runs are the search's)."""
    seeds = (study.lr_search.seed,)
    return study.replace(seeds=seeds, repeat_seeds=RepeatSeedsConfig(), lr_search=None)


def searched_sizes(study: StudySpec, order: dict[str, int]) -> set[str]:
    """The sizes the search trains at (`lr_search.sizes`, or every size), checked against
    the study's sizes (`order`: `sizes_of`'s answer)."""
    unknown = [s for s in map(str, study.lr_search.sizes) if s not in order]
    if unknown:
        raise ConfigError(f"lr_search.sizes: {unknown} are not sizes of the study ({list(order)})")
    return set(map(str, study.lr_search.sizes)) or set(order)


def _runs_at(
    study: StudySpec, spec_dir: Path | None, expand: Expand, sizes: set[str], rate_of: Callable
) -> Tried:
    """The search seed's runs at `sizes`, each point at `rate_of(point)` (None: not trained)."""
    return [
        (rate_of(point(r)), r)
        for r in expand(search_study(study), spec_dir, rates=rate_of)
        if r.size in sizes and rate_of(point(r)) is not None
    ]


def plan_search(
    study: StudySpec, spec_dir: Path | None, expand: Expand, order: dict[str, int] | None = None
) -> Tried:
    """The search's grid: its seed at each searched size, once per rate of the spec, as
    (rate, run) pairs. `expand`: `sweep.expand`; `order`: `sizes_of`'s answer where the
    caller has it. Extensions beyond the grid's ends are planned from its losses (`extend`)."""
    sizes = searched_sizes(study, order or sizes_of(study, spec_dir, expand))
    tried: Tried = []
    for rate in study.lr_search.rates:
        tried += _runs_at(study, spec_dir, expand, sizes, lambda _, rate=rate: rate)
    return tried


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
    tried: Tried, losses: dict[str, float | None], grid: tuple[float, ...]
) -> dict[Point, dict[str, Any]]:
    """Each searched point's curve and chosen rate from the search runs' final validation
    losses (run id -> loss; None: diverged). `tried`: (the spec's rate, run) pairs; `grid`:
    the spec's rates (those beyond it count as extensions). A point's `rates` are ascending,
    `peak` the rate each trained at after the ladder's rule; `edge`: the choice is the lowest
    or the highest rate tried."""
    by: dict[Point, list[tuple[float, float, float | None, float]]] = {}
    for rate, run in tried:
        by.setdefault(point(run), []).append(
            (rate, run.cfg.optim.learning_rate, losses.get(run.run_id), initial_loss(run.cfg))
        )
    out: dict[Point, dict[str, Any]] = {}
    for p, rows in by.items():
        rows.sort(key=lambda row: row[0])
        got = {
            "rates": [row[0] for row in rows],
            "peak": [row[1] for row in rows],
            "loss": [row[2] for row in rows],
            "start": rows[0][3],
        }
        finite = [(v, i) for i, v in enumerate(got["loss"]) if v is not None and math.isfinite(v)]
        if not finite:
            raise executors.StudyRunError(
                f"lr_search: every rate diverged at {'/'.join(x for x in p if x)}; give lower "
                "lr_search.rates"
            )
        best = min(finite)[1]
        got["chosen_index"] = best
        got["edge"] = best in (0, len(rows) - 1)
        got["extended"] = sum(r not in grid for r in got["rates"])
        got["sensitivity"] = sensitivity(got["loss"], got["start"])
        out[p] = got
    return out


def beyond(got: dict[str, Any]) -> float:
    """The next rate past the end of a point's rates that its choice lies at: the same ratio
    as the two rates at that end (rounded to 6 digits, so that the run's id is stable)."""
    r = got["rates"]
    nxt = r[0] * r[0] / r[1] if got["chosen_index"] == 0 else r[-1] * r[-1] / r[-2]
    return float(f"{nxt:.6g}")


def extensions(chosen: dict[Point, dict[str, Any]], most: int) -> dict[Point, float]:
    """Point -> the rate to try next, for each point whose choice is at an end of its rates
    and that has had fewer than `most` rates added."""
    return {p: beyond(got) for p, got in chosen.items() if got["edge"] and got["extended"] < most}


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


def _train(reg: Registry, where: Path, runs: list, executor: dict[str, Any]) -> dict[str, Any]:
    """Train what is missing of `runs`; returns run id -> final loss (None: diverged).
    Raises StudyRunError naming the runs that failed for another reason."""
    executors.LocalExecutor(reg, where, evaluate=False, **executor).run(runs)
    rows = {r["run_id"]: r for r in reg.runs()}
    faults = [
        f"{r.cfg.name}: {rows[r.run_id].get('error') or rows[r.run_id]['status']}"
        for r in runs
        if rows[r.run_id]["status"] != "done" and DIVERGED not in (rows[r.run_id]["error"] or "")
    ]
    if faults:
        raise executors.StudyRunError(
            f"lr_search: {len(faults)} run(s) did not finish ({'; '.join(faults)}); re-run the "
            "same command to retry them (finished runs are kept)"
        )
    return {k: r["loss"] if r["status"] == "done" else None for k, r in rows.items()}


def train_search(
    study: StudySpec, spec_dir: Path | None, out: Path, expand: Expand, **executor: Any
):
    """Train the search (what is missing), extending each point's rates past an end its
    choice lies at, write choice.json and return (the rate function the study's runs are
    expanded with, the search's runs). `executor`: LocalExecutor's train_fn, workers, members."""
    search = study.lr_search
    order = sizes_of(study, spec_dir, expand)
    sizes, tried = searched_sizes(study, order), plan_search(study, spec_dir, expand, order)
    grid = tuple(search.rates)
    where = Path(out) / "lr_search"
    new = [r for _, r in tried]
    print(f"lr_search: {len(new)} runs ({len(grid)} rates, seed {search.seed})")
    with Registry(where / "registry.sqlite") as reg:
        for round_ in range(search.extensions + 1):
            reg.add_runs(r.row(study.name, where / "runs" / r.dirname) for r in new)
            chosen = choose(tried, _train(reg, where, [r for _, r in tried], executor), grid)
            more = extensions(chosen, search.extensions)
            if not more:
                break
            added = _runs_at(study, spec_dir, expand, sizes, more.get)
            tried += added
            new = [r for _, r in added]
            print(
                f"lr_search: {len(new)} more run(s) past an end of the rates tried "
                f"(extension {round_ + 1} of at most {search.extensions})"
            )
    keys = {"grid": list(grid), "seed": search.seed, "most": search.extensions}
    records = [{"point": list(p), **keys, **got} for p, got in chosen.items()]
    (where / CHOICE).write_text(json.dumps(records, indent=1))
    return rate_for(chosen, order), [r for _, r in tried]


def resolve(
    study: StudySpec, spec_dir: Path | None, out: Path, runs: list, expand: Expand, **executor: Any
) -> list:
    """The study's runs at their chosen rates, with the search trained first (what is
    missing); `runs` for a study without `lr_search`."""
    if study.lr_search is None:
        return runs
    rate, _ = train_search(study, spec_dir, out, expand, **executor)
    return expand(study, spec_dir, rates=rate)


def not_on_clusters(study: StudySpec, what: str) -> None:
    """Refuse `what` for a study with `lr_search`: its rates are chosen by a search that
    `scalestudy study` trains on this host before the study's runs."""
    if study.lr_search is not None:
        raise ConfigError(
            f"{what}: this study chooses its learning rates first (lr_search), which only "
            "`scalestudy study` does, on this host; run it there, or set the chosen rates in "
            "the spec (optim.learning_rate) and drop lr_search"
        )
