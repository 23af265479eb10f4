"""NoPE vs RoPE at several training budgets, each a finished schedule: slower optimisation or
a worse final loss?

For every (architecture, position scheme, seed) of a study spec (`nope_order.yaml`) one
warmup-stable-decay run trains to the largest budget, keeping checkpoints where the others
branch off; each smaller budget S is a cooldown branch started from that run's checkpoint at
S - cooldown (`train.init_from`, docs/training.md), so every budget's loss ends a decayed
schedule. The validation losses at each budget go to `nope_budgets.json`; `budget_gap.py`
turns them into the gap by budget, its trend and its asymptote, and `nope_budgets.md` states
the calls.

    python -m scalestudy.decoder_only.nope_budgets --spec configs/studies/nope_order_budgets.yaml \
        --out runs/nope_budgets
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from scalestudy.config.errors import ConfigError, ScalestudyError
from scalestudy.config.experiment import ExperimentConfig
from scalestudy.decoder_only import budget_gap, order_floor, stats
from scalestudy.decoder_only.budget_gap import BudgetRun
from scalestudy.study.plan.spec import BudgetSweepConfig, StudySpec
from scalestudy.study.run.main_job import PlannedRun, expand, load_study
from scalestudy.train.rundir import layout as rundir

RESULTS_NAME = "nope_budgets.json"
REPORT_NAME = "nope_budgets.md"


def cooldown(sweep: BudgetSweepConfig, budget: int) -> int:
    """Cooldown steps of the schedule that ends at `budget`."""
    return max(1, round(sweep.cooldown_fraction * budget))


def load_sweep(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> StudySpec:
    """Read a study spec with an `experiments.budgets` block and check that block."""
    study = load_study(path, overrides)
    sweep = study.experiments.budgets if study.experiments else None
    if sweep is None:
        raise ConfigError(f"{path}: no experiments.budgets block (steps, reference, treatment)")
    if list(sweep.steps) != sorted(set(sweep.steps)) or sweep.steps[0] < 1:
        raise ConfigError(
            f"experiments.budgets.steps: positive step counts in increasing order; got "
            f"{list(sweep.steps)}"
        )
    if sweep.interaction and len(sweep.interaction) != 2:
        raise ConfigError(
            "experiments.budgets.interaction names two architectures [A, B] (B's gap minus "
            f"A's); got {list(sweep.interaction)}"
        )
    names = {v.name for v in study.variants}
    for key in ("reference", "treatment"):
        if getattr(sweep, key) not in names:
            raise ConfigError(
                f"experiments.budgets.{key}={getattr(sweep, key)!r} is not a variant of the "
                f"study; variants: {sorted(names)}"
            )
    return study


def _branch_points(sweep: BudgetSweepConfig) -> list[int]:
    return [b - cooldown(sweep, b) for b in sweep.steps[:-1]]


def plan_budget_runs(
    study: StudySpec, spec_dir: Path, out: Path
) -> list[tuple[PlannedRun, dict[int, ExperimentConfig]]]:
    """Each run of the study's reference and treatment variants (seed-major, so finished
    seeds come first) with its config per budget: the largest budget's is the stable run
    (in `workdir(out, run, largest)`), the others branch from its checkpoints."""
    sweep = study.experiments.budgets
    runs = [r for r in expand(study, spec_dir) if r.variant in (sweep.reference, sweep.treatment)]
    points = _branch_points(sweep)
    k = runs[0].cfg.train.steps_per_call
    keep = math.gcd(*points)
    if keep % k or any(b % k for b in sweep.steps):
        raise ConfigError(
            f"experiments.budgets.steps {list(sweep.steps)} and their branch points {points} "
            f"must be multiples of train.steps_per_call={k}"
        )
    top = sweep.steps[-1]
    planned = []
    for run in sorted(runs, key=lambda r: r.seed):
        stable = run.cfg.replace(
            optim=run.cfg.optim.replace(schedule="wsd", cooldown_steps=cooldown(sweep, top)),
            train=run.cfg.train.replace(steps=top, keep_every=keep, checkpoint_every=keep),
        )
        configs = {top: stable}
        branch = {"init_from": str(workdir(out, run, top)), "keep_every": None}
        for budget, point in zip(sweep.steps[:-1], points):
            configs[budget] = stable.replace(
                optim=stable.optim.replace(cooldown_steps=cooldown(sweep, budget)),
                train=stable.train.replace(steps=budget, init_step=point, **branch),
            )
        planned.append((run, configs))
    return planned


def workdir(out: Path, run: PlannedRun, budget: int) -> Path:
    return out / "runs" / run.cfg.name / f"steps{budget}"


def _finished(workdir: Path, steps: int) -> dict | None:
    summary = rundir.read_summary(workdir)
    if summary and summary.get("complete", True) and summary.get("steps", 0) >= steps:
        return summary
    return None


def _previous_cpu(out: Path) -> dict[str, float]:
    """CPU seconds of the runs an earlier invocation trained (a finished run is not retrained,
    so its cost is only known from then)."""
    path = out / RESULTS_NAME
    if not path.is_file():
        return {}
    rows = [BudgetRun(**r) for r in json.loads(path.read_text()).get("rows", [])]
    return {r.workdir: r.cpu_s for r in rows}


def train_all(study: StudySpec, spec_dir: Path, out: Path) -> list[BudgetRun]:
    """Train (or resume) every stable run and branch; one result row per (run, budget) with
    its validation loss, the task's loss floor on the same batches and the CPU it took."""
    from scalestudy.train import loop

    rows: list[BudgetRun] = []
    floors: dict[int, float] = {}
    bags: dict[tuple[int, str], float] = {}  # the bag floor: non-causal decoders only
    before = _previous_cpu(out)
    for run, configs in plan_budget_runs(study, spec_dir, out):
        for budget in sorted(configs, reverse=True):  # the stable run first: branches need it
            cfg, where = configs[budget], workdir(out, run, budget)
            cpu0 = time.process_time()
            summary = _finished(where, budget)
            cpu = before.get(str(where), 0.0) if summary else None
            summary = summary or loop.train(cfg, where)
            if run.seed not in floors and cfg.data.source == "order":
                floors[run.seed] = order_floor.validation_floor(cfg)
            bag = (run.seed, run.arch) if run.arch == "noncausal_decoder" else None
            if bag and bag not in bags and cfg.data.source == "order":
                bags[bag] = order_floor.validation_bag_floor(cfg)
            rows.append(
                BudgetRun(
                    arch=run.arch,
                    variant=run.variant,
                    seed=run.seed,
                    budget=budget,
                    val_loss=summary["final_val_loss"],
                    floor=floors.get(run.seed),
                    bag_floor=bags.get((run.seed, run.arch)),
                    position=cfg.model.position,
                    params=run.params["total"],
                    wall_s=summary.get("wall_time_s"),
                    cpu_s=cpu if cpu is not None else time.process_time() - cpu0,
                    workdir=str(where),
                )
            )
            print(f"{run.cfg.name} steps {budget}: val loss {rows[-1].val_loss:.4f}")
            text = json.dumps({"rows": [r.as_dict() for r in rows]}, indent=1)
            rundir.write_atomic(out / RESULTS_NAME, text)
    return rows


def gaps_by_budget(
    sweep: BudgetSweepConfig, rows: list[BudgetRun]
) -> dict[str, dict[tuple[int, int], float]]:
    """Treatment minus reference validation loss per architecture, keyed (seed, budget); with
    `interaction` [A, B] also B's gap minus A's."""
    losses = {(r.arch, r.variant, r.seed, r.budget): r.val_loss for r in rows}
    gaps: dict[str, dict[tuple[int, int], float]] = {}
    for arch, variant, seed, budget in losses:
        treated = losses.get((arch, sweep.treatment, seed, budget))
        if variant == sweep.reference and treated is not None:
            gaps.setdefault(arch, {})[(seed, budget)] = (
                treated - losses[(arch, variant, seed, budget)]
            )
    if sweep.interaction and all(a in gaps for a in sweep.interaction):
        first, second = (gaps[a] for a in sweep.interaction)
        name = f"{sweep.interaction[1]} - {sweep.interaction[0]}"
        gaps[name] = {k: second[k] - first[k] for k in second if k in first}
    return gaps


def proved_floors(sweep: BudgetSweepConfig, rows: list[BudgetRun]) -> dict[str, float]:
    """Per architecture, a proved lower bound on the final gap where the treatment reads no
    positions and the architecture has a bag floor (`order_floor.py`): the treatment's loss
    never goes below the bag floor, and the reference's, we assume, does not rise with more
    training, so the final gap is at least bag floor - the reference's loss at the largest
    budget; the least over seeds."""
    top = max(r.budget for r in rows) if rows else None
    bounds: dict[str, list[float]] = {}
    for r in rows:
        if r.variant != sweep.reference or r.budget != top:
            continue
        treated = [
            t for t in rows if (t.arch, t.seed, t.variant) == (r.arch, r.seed, sweep.treatment)
        ]
        bag = r.bag_floor
        if bag is not None and treated and all(t.position == "none" for t in treated):
            bounds.setdefault(r.arch, []).append(bag - r.val_loss)
    return {arch: min(b) for arch, b in bounds.items() if min(b) > 0}


def main(argv: list[str] | None = None) -> int:
    """Command line: train what is missing, then write the JSON results and the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", required=True, help="a study spec with experiments.budgets")
    parser.add_argument("--out", required=True, help="output directory (resumed when present)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the spec")
    args = parser.parse_args(argv)
    try:
        spec = Path(args.spec)
        study = load_sweep(spec, args.overrides)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        rows = train_all(study, spec.parent, out)
        sweep = study.experiments.budgets
        results = budget_gap.analyse(gaps_by_budget(sweep, rows), proved_floors(sweep, rows))
        results["rows"] = rows
        results["seconds"] = {
            "wall": time.perf_counter() - t0,
            "cpu": sum(r.cpu_s for r in rows),
        }
        text = json.dumps(results, indent=1, default=stats.as_json)
        rundir.write_atomic(out / RESULTS_NAME, text)
        rundir.write_atomic(out / REPORT_NAME, budget_gap.render(results))
        print(f"report: {out / REPORT_NAME}")
    except ScalestudyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
