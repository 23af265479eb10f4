"""Slower optimisation or a worse final loss: the verdict on a gap measured at several budgets.

Input: per comparison, a loss gap (treatment minus reference, e.g. NoPE minus RoPE) for each
(seed, budget), every budget the end of a finished schedule (`nope_budgets.py`). The seed is
the unit of replication; every interval is a t-interval over the seeds common to all budgets.

- The gap at each budget: its mean over seeds, 95% interval and p against 0.
- Its trend: each seed's least-squares slope of the gap on log2(budget), i.e. the change per
  doubling of training. A gap that closes has a slope of the opposite sign to the gap.
- Its asymptote, the gap left after unlimited training: where the trend shows the gap closing
  (unadjusted p < 0.05), each seed's gap fitted as `gap(b) = inf + c * (b / b_max) ** -alpha`
  with `alpha` profiled (least squares over `ALPHAS`) on the seeds' mean curve, then `inf`
  and `c` per seed by linear least squares; otherwise each seed's gap at the largest budget
  (a gap that shows no sign of closing is taken where training left it, not extrapolated
  along a power law the data do not show). Intervals are conditional on that choice.

The call, after Holm's correction over every test of the report:
- "final loss": the asymptote is distinguishable from 0, the trend does not close the gap and
  the gap has measurably stopped widening: the trend's interval excludes widening by more
  than `STOPPED` of the largest budget's gap per doubling (a slower learner's gap widens for
  as long as the faster one is still improving, so a widening gap says nothing yet about the
  final loss);
- "floor": the gap still widens (or has not measurably stopped) but a proved bound holds it
  above `floor` at any budget (e.g. the bag floor of a position-free bidirectional model):
  a final-loss effect of at least that bound, the rest of the gap undetermined;
- "widening": the gap is distinguishable from 0 and has not measurably stopped widening, and
  no bound is proved: no call between speed and final loss;
- "both": the trend closes the gap, but towards a nonzero asymptote;
- "speed": the trend closes the gap and the asymptote is not distinguishable from 0 while its
  whole interval lies closer to 0 than the gap at the largest budget;
- "no gap": no budget's gap and no asymptote is distinguishable from 0;
- "not distinguishable": anything else (the intervals cannot tell these apart);
- "one seed": no call, since one seed gives no between-run interval.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats as sps

from scalestudy.decoder_only import stats
from scalestudy.scaling import intervals
from scalestudy.scaling import render as md


@dataclass(frozen=True)
class BudgetRun:
    """One run of a budget sweep at one budget (`nope_budgets.train_all`): its group (`arch`,
    `variant`), `seed` and `budget` (steps), final validation loss, the task's loss floor and
    bag floor on the same batches (None where not known), its position scheme, parameters,
    wall and CPU seconds, and its run directory."""

    arch: str
    variant: str
    seed: int
    budget: int
    val_loss: float
    floor: float | None = None
    bag_floor: float | None = None
    position: str | None = None
    params: int | None = None
    wall_s: float | None = None
    cpu_s: float | None = None
    workdir: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The run as the sweep's results file holds it."""
        return dataclasses.asdict(self)


# exponents profiled for the asymptote; below 0.5 a fit over budgets 8x apart extrapolates a
# noisy curve far beyond the data
ALPHAS = np.round(np.arange(0.5, 3.0001, 0.05), 2)
LEVEL = 0.05
# "stopped widening": the trend's interval excludes widening by more than this share of the
# largest budget's gap per doubling of the budget
STOPPED = 0.25


def t_summary(xs: list[float]) -> dict[str, Any]:
    """Mean of per-seed values, its 95% t-interval and two-sided p against 0 (None below two
    seeds: no between-run interval)."""
    n = len(xs)
    mean = float(np.mean(xs)) if n else math.nan
    if n < 2:
        return {"mean": mean, "low": None, "high": None, "p": None, "n": n}
    se = float(np.std(xs, ddof=1)) / math.sqrt(n)
    half = stats.t95(n - 1) * se
    if se > 1e-12 * max(1.0, abs(mean)):
        p = float(2 * sps.t.sf(abs(mean) / se, n - 1))
    else:  # identical across seeds (up to rounding): exactly 0 or exactly not
        p = 0.0 if abs(mean) > 1e-12 else 1.0
    return {"mean": mean, "low": mean - half, "high": mean + half, "p": p, "n": n}


def _design(budgets: np.ndarray, alpha: float) -> np.ndarray:
    return np.stack([np.ones_like(budgets), (budgets / budgets[-1]) ** -alpha], axis=1)


def profile_alpha(budgets: np.ndarray, mean_gap: np.ndarray) -> float:
    """The exponent whose fit `inf + c * (b / b_max) ** -alpha` leaves the least squared error
    on the mean gap curve; ties (a flat curve fits every exponent) go to the largest, which
    extrapolates least."""
    best, best_sse = float(ALPHAS[-1]), math.inf
    for alpha in ALPHAS[::-1]:
        x = _design(budgets, float(alpha))
        coef, *_ = np.linalg.lstsq(x, mean_gap, rcond=None)
        sse = float(np.sum((x @ coef - mean_gap) ** 2))
        if sse < best_sse * (1 - 1e-6) - 1e-15:
            best, best_sse = float(alpha), sse
    return best


def analyse_one(gaps: dict[tuple[int, int], float]) -> dict[str, Any]:
    """Gap by budget, trend and asymptote of one comparison ((seed, budget) -> gap)."""
    budgets = sorted({b for _, b in gaps})
    seeds = sorted(s for s in {s for s, _ in gaps} if all((s, b) in gaps for b in budgets))
    g = np.array([[gaps[(s, b)] for b in budgets] for s in seeds], dtype=float).reshape(
        len(seeds), len(budgets)
    )
    b = np.array(budgets, dtype=float)
    out: dict[str, Any] = {"budgets": budgets, "seeds": seeds}
    out["by_budget"] = [t_summary(list(g[:, j])) for j in range(len(budgets))]
    log_b = np.log2(b)
    slopes = [float(np.polyfit(log_b, row, 1)[0]) for row in g] if len(budgets) > 1 else []
    out["trend"] = t_summary(slopes)
    trend = out["trend"]
    last = float(np.mean(g[:, -1])) if len(seeds) else 0.0
    closing = trend["p"] is not None and trend["p"] < LEVEL and trend["mean"] * last < 0
    if closing and len(budgets) >= 3:
        alpha = profile_alpha(b, g.mean(axis=0))
        x = _design(b, alpha)
        fits = [np.linalg.lstsq(x, row, rcond=None)[0] for row in g]
        out["alpha"], out["model"] = alpha, "power"
        out["asymptote"] = t_summary([float(f[0]) for f in fits])
    else:  # no sign of closing: the gap stays at least where the largest budget left it
        out["alpha"], out["model"] = None, "last"
        out["asymptote"] = t_summary([float(row[-1]) for row in g])
    return out


def _significant(summary: dict) -> bool:
    return summary.get("p_holm") is not None and summary["p_holm"] < LEVEL


def stopped_widening(result: dict[str, Any]) -> bool:
    """The gap has measurably stopped widening: the trend's 95% interval excludes widening
    faster than `STOPPED` x the last gap per doubling (a slope that is significant but
    smaller than that counts as stopped: the gap is near its final size)."""
    last = result["by_budget"][-1]["mean"]
    sign = 1.0 if last >= 0 else -1.0
    trend = result["trend"]
    if trend["low"] is None:
        return False
    widening_end = max(sign * trend["low"], sign * trend["high"])
    return widening_end < STOPPED * abs(last)


def call(result: dict[str, Any]) -> str:
    """The verdict of one analysed comparison (its summaries carry Holm-adjusted p; its
    "floor", when set, a proved lower bound on the gap's size at any budget)."""
    if len(result["seeds"]) < 2:
        return "one seed"
    last = result["by_budget"][-1]["mean"]
    sign = 1.0 if last >= 0 else -1.0
    trend, inf = result["trend"], result["asymptote"]
    closing = _significant(trend) and sign * trend["mean"] < 0
    if _significant(inf):
        if closing:
            return "both"
        if stopped_widening(result):
            return "final loss"
        return "floor" if (result.get("floor") or 0.0) > 0 else "widening"
    # not distinguishable from 0 (above), and all of its interval closer to 0 than the gap
    if closing and inf["low"] is not None and max(abs(inf["low"]), abs(inf["high"])) < abs(last):
        return "speed"
    if not any(_significant(s) for s in result["by_budget"]):
        return "no gap"
    return "not distinguishable"


def analyse(
    gaps: dict[str, dict[tuple[int, int], float]], floors: dict[str, float] | None = None
) -> dict[str, Any]:
    """Analyse every comparison, apply Holm over all their tests (gap at each budget, trend,
    asymptote) and make each call; `floors` gives a comparison's proved lower bound on the
    size of its gap at any budget, where one is known."""
    results = {name: analyse_one(g) for name, g in gaps.items()}
    for name, floor in (floors or {}).items():
        if name in results and floor > 0:
            results[name]["floor"] = float(floor)
    tests = [s for r in results.values() for s in (*r["by_budget"], r["trend"], r["asymptote"])]
    for s, p in zip(tests, stats.holm([s["p"] for s in tests])):
        s["p_holm"] = p
    for r in results.values():
        r["call"] = call(r)
    return {"comparisons": results, "tests": sum(s["p"] is not None for s in tests)}


def _interval(s: dict, digits: int = 3) -> str:
    if s["low"] is None:
        return f"{s['mean']:+.{digits}f} (n = {s['n']}, no interval)"
    p = f", Holm p {s['p_holm']:.2g}" if s.get("p_holm") is not None else ""
    return intervals.span(s["mean"], s["low"], s["high"], digits) + p


CALLS = {
    "final loss": "a final-loss effect: the gap does not close with training and has stopped "
    "widening",
    "floor": "a final-loss effect of at least the proved floor; the gap still widens, so how "
    "much more of it is final is not known",
    "widening": "no call: the gap still widens with training (as a slower learner's does "
    "before it catches up), and no bound is proved; more budget is needed",
    "both": "slower optimisation and a final-loss effect: the gap narrows towards a nonzero "
    "asymptote",
    "speed": "an optimisation-speed effect: the gap closes towards 0 with training",
    "no gap": "no gap distinguishable at these budgets",
    "one seed": "no call: one seed gives no between-run interval",
    "not distinguishable": "not distinguishable: the intervals cannot tell a closing gap from "
    "a lasting one",
}


def render(results: dict[str, Any]) -> str:
    """The report: per comparison a table of the gap by budget, the trend, the asymptote and
    the call, each with its n; then the validation losses behind them."""
    lines = [
        "# Slower optimisation or a worse final loss: the gap by training budget",
        "",
        "Every budget is the end of a finished warmup-stable-decay schedule (a cooldown branch "
        "of one stable run per architecture, variant and seed). Intervals are 95% t-intervals "
        f"over seeds (paired: each seed's gap); Holm's correction runs over the "
        f"{results['tests']} tests below.",
        "",
    ]
    for name, r in results["comparisons"].items():
        lines += [
            f"## {name}",
            "",
            *md.table(
                ["budget (steps)", "gap, 95% interval", "n seeds"],
                [[b, _interval(s), s["n"]] for b, s in zip(r["budgets"], r["by_budget"])],
            ),
        ]
        alpha = (
            f"power law, alpha {r['alpha']:.2f}"
            if r["alpha"] is not None
            else "no sign of closing: the gap at the largest budget"
        )
        lines += [
            "",
            f"- change per doubling of the budget: {_interval(r['trend'])}",
            f"- asymptote (gap after unlimited training; {alpha}): {_interval(r['asymptote'])}",
            *(
                [f"- proved floor on the gap at any budget: {r['floor']:.3f}"]
                if r.get("floor")
                else []
            ),
            f"- **call: {CALLS[r['call']]}** (n = {len(r['seeds'])} seeds)",
            "",
        ]
    rows = results.get("rows", [])
    if rows:
        lines += _loss_table(rows)
    seconds = results.get("seconds")
    if seconds:
        lines.append(
            f"Time: {seconds['wall'] / 60:.1f} min wall, {seconds['cpu'] / 60:.1f} CPU-min "
            "(training and floors, this invocation's runs plus the recorded cost of earlier ones)."
        )
    return "\n".join(lines) + "\n"


def _loss_table(rows: list[BudgetRun]) -> list[str]:
    budgets = sorted({r.budget for r in rows})
    groups = list(dict.fromkeys((r.arch, r.variant) for r in rows))
    lines = [
        "## Validation loss by budget (mean over seeds ± 95%)",
        "",
    ]
    body = []
    for arch, variant in groups:
        cells = []
        for b in budgets:
            xs = [r.val_loss for r in rows if (r.arch, r.variant, r.budget) == (arch, variant, b)]
            s = t_summary(xs)
            half = f" ± {(s['high'] - s['mean']):.3f}" if s["low"] is not None else ""
            cells.append(f"{s['mean']:.3f}{half}")
        body.append([f"{arch} / {variant}", *cells])
    lines += md.table(["group", *budgets], body)
    for key, what in (
        ("floor", "Task loss floor (`order_floor.py`) on the scored batches"),
        ("bag_floor", "Bag floor (the least loss of a model reading its prefix as a multiset)"),
    ):
        values = {r.seed: v for r in rows if (v := getattr(r, key)) is not None}
        if values:
            lines += ["", f"{what}, mean over seeds: {np.mean(list(values.values())):.3f}."]
    return [*lines, ""]
