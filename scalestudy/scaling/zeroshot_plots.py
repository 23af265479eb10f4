"""Zero-shot accuracy task by task across a study's runs: a figure and a trend test.

Reads flat run records (a study registry's rows: `arch`, `objective`, `size`, `flops`,
`params_*` and `eval/<task>/<metric>` or, for a task with parts such as the synthetic probes,
`eval/<task>/<part>/<metric>`); every part with a recorded `n` is a task of its own here, up
to `MAX_PARTS` parts per task.

- `fig_task_accuracy`: a panel per task, accuracy against training compute per cell, Wilson
  95% intervals from the task's example count, and the task's chance line (1 / choices).
- `accuracy_trend`: per cell, the trend of accuracy with log10 compute with the **run as the
  unit of replication** (`run_slope`): each run's empirical log-odds of a right answer,
  centred per task and averaged over the tasks, regressed on log10 compute by least squares,
  with a t interval and p-value on runs - 2 degrees of freedom. Compute varies only between
  runs, and runs of one size differ by more than their examples' binomial noise (seeds), so
  the examples of one run are not independent replicates of the trend. The per-example
  logistic fit (`logistic_slope`) is kept beside it as `per_example`, labelled as such: its
  interval counts examples as replicates and is too narrow whenever runs vary.
  tests/scaling/test_zeroshot_plots.py checks the run-level interval's coverage and the
  test's false-positive rate on simulated ladders with seed noise.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from scalestudy.evaluate.fewshot import shots_of
from scalestudy.scaling import figstyle as fs
from scalestudy.scaling import render
from scalestudy.scaling.intervals import span

Z95 = 1.959964
MAX_PARTS = 12  # parts of one task drawn as panels of their own


@dataclass(frozen=True)
class TaskScore:
    """One run's result on one task: k of n examples right, a uniform guess's accuracy."""

    task: str
    cell: str
    size: str
    flops: float
    params: float
    acc: float
    n: int
    chance: float | None
    run: str = ""  # the run's id: several seeds share a size and its compute

    @property
    def correct(self) -> int:
        return round(self.acc * self.n)


@dataclass(frozen=True)
class ScoredRun:
    """One run as the per-task section reads it: its cell, size, training FLOPs, parameters,
    id (several seeds share a size and its compute) and final scores by name
    (`eval/<task>[/<part>]/<metric>`, metric `acc`, `n` or `chance`)."""

    cell: str
    size: str
    flops: float | None
    params: float
    run: str
    evals: Mapping[str, float | None]


def task_scores(runs: list[ScoredRun]) -> list[TaskScore]:
    """Per run and task, its accuracy and example count (parts of a task count as tasks;
    a task with parts is not counted again as a whole)."""
    out = []
    for run in runs:
        if not run.flops:
            continue
        evals = run.evals
        keys = [k for k in evals if k.startswith("eval/") and k.endswith("/acc")]
        # zero-shot rows only: few-shot ones ("<task>.<K>shot") have the in-context section
        keys = [k for k in keys if not shots_of(k.split("/")[1])]
        n_parts: dict[str, int] = defaultdict(int)
        for k in keys:
            if k.count("/") == 3 and evals.get(k.removesuffix("acc") + "n"):
                n_parts[k.split("/")[1]] += 1
        parted = {task for task, count in n_parts.items() if count <= MAX_PARTS}
        # A task with more parts than panels (BLiMP's 67 paradigms) is one task here; its
        # breakdown has a section of its own. Tag breakdowns (eval/<task>/<tag>/<value>/acc)
        # never count as tasks.
        keys = [k for k in keys if k.count("/") == 2 or k.split("/")[1] in parted]
        for key in keys:
            parts = key.split("/")
            if evals[key] is None or (len(parts) == 3 and parts[1] in parted):
                continue
            n = evals.get(key.removesuffix("acc") + "n")
            if not n:
                continue
            chance = evals.get(key.removesuffix("acc") + "chance")
            out.append(
                TaskScore(
                    task=parts[-2],
                    cell=run.cell,
                    size=run.size,
                    flops=float(run.flops),
                    params=run.params,
                    acc=float(evals[key]),
                    n=int(n),
                    chance=None if chance is None else float(chance),
                    run=run.run,
                )
            )
    return out


def task_order(scores: list[TaskScore]) -> list[str]:
    """Task names, easiest first: by mean accuracy above chance over every run."""
    gain: dict[str, list[float]] = defaultdict(list)
    for s in scores:
        gain[s.task].append(s.acc - (s.chance or 0.0))
    return sorted(gain, key=lambda task: (-float(np.mean(gain[task])), task))


def wilson(k: float, n: float, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k / n (stays inside [0, 1])."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # Around p itself: at p = 1 (or 0) rounding can leave the bound a hair inside p, and a
    # negative error bar stops matplotlib.
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))


def logistic_slope(
    groups: list[int], x: np.ndarray, k: np.ndarray, n: np.ndarray
) -> dict[str, float] | None:
    """Maximum-likelihood fit of logit P(correct) = a[group] + b * x to k-of-n counts.

    Returns the slope `b`, its standard error, Wald 95% interval and two-sided p-value; None
    when x does not vary or the fit does not converge (e.g. every answer right)."""
    x, k, n = (np.asarray(v, np.float64) for v in (x, k, n))
    if x.size < 2 or np.ptp(x) == 0:
        return None
    labels = sorted(set(groups))
    X = np.zeros((x.size, len(labels) + 1))
    X[np.arange(x.size), [labels.index(g) for g in groups]] = 1.0
    X[:, -1] = x - x.mean()  # centred: better conditioned, same slope
    beta = np.zeros(X.shape[1])
    for _ in range(100):
        p = 1.0 / (1.0 + np.exp(-(X @ beta)))
        grad = X.T @ (k - n * p)
        hess = (X * (n * p * (1 - p))[:, None]).T @ X
        try:
            step = np.linalg.solve(hess, grad)
        except np.linalg.LinAlgError:
            return None
        beta += step
        if np.max(np.abs(step)) < 1e-10:
            break
    else:
        return None
    p = 1.0 / (1.0 + np.exp(-(X @ beta)))
    cov = np.linalg.pinv((X * (n * p * (1 - p))[:, None]).T @ X)
    b, se = float(beta[-1]), float(math.sqrt(max(cov[-1, -1], 0.0)))
    if not math.isfinite(se) or se == 0.0:
        return None
    return {
        "slope": b,
        "se": se,
        "lo": b - Z95 * se,
        "hi": b + Z95 * se,
        "p": math.erfc(abs(b / se) / math.sqrt(2.0)),
    }


def empirical_logit(k: np.ndarray, n: np.ndarray) -> np.ndarray:
    """log((k + 1/2) / (n - k + 1/2)): finite at 0 and n, nearly unbiased for n >= 50."""
    k, n = np.asarray(k, np.float64), np.asarray(n, np.float64)
    return np.log((k + 0.5) / (n - k + 0.5))


def run_slope(x: np.ndarray, y: np.ndarray) -> dict[str, float] | None:
    """Least-squares slope of one value per run (`y`) on `x`, with its t 95% interval and
    two-sided p-value on len(x) - 2 degrees of freedom; None with fewer than 3 runs or when
    x does not vary."""
    from scipy import stats

    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.size < 3 or np.ptp(x) == 0:
        return None
    xc = x - x.mean()
    b = float(xc @ (y - y.mean()) / (xc @ xc))
    resid = y - y.mean() - b * xc
    df = x.size - 2
    se = float(math.sqrt(max(resid @ resid / df, 0.0) / (xc @ xc)))
    if se == 0.0:
        return None
    q = float(stats.t.ppf(0.975, df))
    return {
        "slope": b,
        "se": se,
        "lo": b - q * se,
        "hi": b + q * se,
        "p": float(2 * stats.t.sf(abs(b / se), df)),
        "df": df,
    }


def run_scores(rows: list[TaskScore]) -> tuple[np.ndarray, np.ndarray]:
    """(log10 compute, score) per run: the run's empirical log-odds on each task, less that
    task's mean over the runs, averaged over the tasks it has."""
    by_task: dict[str, list[TaskScore]] = defaultdict(list)
    for r in rows:
        by_task[r.task].append(r)
    centred: dict[str, list[float]] = defaultdict(list)
    flops: dict[str, float] = {}
    for task_rows in by_task.values():
        logits = empirical_logit([r.correct for r in task_rows], [r.n for r in task_rows])
        for r, value in zip(task_rows, logits - logits.mean()):
            centred[r.run].append(float(value))
            flops[r.run] = r.flops
    runs = sorted(centred)
    x = np.log10([flops[r] for r in runs])
    return x, np.array([np.mean(centred[r]) for r in runs])


def accuracy_trend(scores: list[TaskScore]) -> dict[str, dict[str, Any]]:
    """Per cell: the run-level trend of accuracy with log10 training FLOPs (`fit`, from
    `run_slope` over `run_scores`), the per-example logistic fit (`per_example`), and the
    numbers of runs, sizes and examples behind them."""
    per: dict[str, list[TaskScore]] = defaultdict(list)
    for s in scores:
        per[s.cell].append(s)
    out = {}
    for cell, rows in sorted(per.items()):
        per_example = logistic_slope(
            [r.task for r in rows],
            np.log10([r.flops for r in rows]),
            np.array([r.correct for r in rows]),
            np.array([r.n for r in rows]),
        )
        x, y = run_scores(rows)
        out[cell] = {
            "runs": len(x),
            "sizes": len({r.size for r in rows}),
            "examples": sum(r.n for r in rows),
            "fit": run_slope(x, y),
            "per_example": per_example,
        }
    return out


TREND_TEXT = (
    "Trend test, the run as the unit: per cell, each run's log-odds of a right answer "
    "(centred per task, averaged over the tasks) regressed on log10 training FLOPs; the "
    "slope is log-odds per decade of compute, with its t 95% interval and two-sided p on "
    "runs - 2 degrees of freedom. The per-example p (a logistic fit that counts every example "
    "as a replicate) is shown for comparison only: it ignores how much runs vary."
)


def trend_head(what: str) -> list[str]:
    """The head of a trend table whose third column counts `what` (examples, pairs)."""
    return ["cell", "runs (sizes)", what, "slope per decade [95%]", "p", "per-example p"]


def trend_cells(cell: str, t: dict[str, Any], digits: int = 2) -> list[str]:
    """The cells of one row of a trend table: cell, runs (sizes), examples, slope [95%], p,
    per-example p."""
    f, e = t["fit"], t["per_example"]
    fit = [span(f["slope"], f["lo"], f["hi"], digits), f"{f['p']:.2g}"] if f else []
    fit = fit or ["- (fewer than 3 runs)", "-"]
    each = f"{e['p']:.2g}" if e else "-"
    return [cell, f"{t['runs']} ({t['sizes']})", str(t["examples"]), *fit, each]


def fig_task_accuracy(scores: list[TaskScore], x_key: str = "flops"):
    """A panel per task (easiest first): accuracy vs training compute (`x_key` "flops") or
    non-embedding parameters ("params") per cell, Wilson 95% intervals, chance dotted; None
    without scores."""
    if not scores:
        return None
    tasks = task_order(scores)
    cells = sorted({s.cell for s in scores})
    styles = fs.cell_styles(cells)
    fig, axs = fs.grid(len(tasks), width=4.6, height=3.8)
    for ax, task in zip(axs, tasks, strict=True):
        for cell in cells:
            rows = sorted((s for s in scores if s.task == task and s.cell == cell), key=_x(x_key))
            if not rows:
                continue
            xs = np.array([_x(x_key)(r) for r in rows])
            acc = np.array([r.acc for r in rows])
            lo, hi = np.array([wilson(r.correct, r.n) for r in rows]).T
            st = styles[cell]
            ax.errorbar(
                xs,
                acc,
                yerr=[acc - lo, hi - acc],
                color=st["color"],
                marker=st["marker"],
                ms=4,
                lw=1.0,
                elinewidth=0.7,
                capsize=2,
                alpha=0.85,
                label=cell,
                gid=f"interval:{task}:{cell}",
            )
        chances = [s.chance for s in scores if s.task == task and s.chance is not None]
        if chances:
            chance = float(np.mean(chances))
            ax.axhline(chance, color="0.3", ls=":", lw=1.2, label=f"chance ({chance:.2f})")
        n = max(s.n for s in scores if s.task == task)
        what = "training compute C (FLOPs)" if x_key == "flops" else "non-embedding parameters"
        fs.axes(ax, what, "accuracy", False)
        ax.set_ylim(0.0, 1.0)
        ax.set_title(f"{task} ({n} examples)")
    axs[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("Zero-shot accuracy per task (bars: Wilson 95% intervals)")
    return fig


def _x(x_key: str):
    if x_key not in ("flops", "params"):
        raise ValueError(f"x_key={x_key!r}; accepted: flops, params")
    return lambda s: getattr(s, x_key)


def report_section(runs: list[ScoredRun], out: Path) -> str:
    """The report's per-task zero-shot section for `runs` (finished runs): a table of accuracy
    by cell and size, the trend test per cell, and the figure (written to `out/figures/`).
    Empty when no run has per-task accuracies."""
    scores = task_scores(runs)
    if not scores:
        return ""
    figures = Path(out) / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    fs.save(fig_task_accuracy(scores), figures, "zero_shot_tasks")
    tasks = task_order(scores)
    chance = {t: next((s.chance for s in scores if s.task == t and s.chance), None) for t in tasks}
    by_run: dict[tuple, dict[str, TaskScore]] = defaultdict(dict)
    for s in scores:
        by_run[(s.cell, s.flops, s.size)][s.task] = s
    lines = [
        "",
        "## Zero-shot accuracy per task",
        "",
        "Accuracy of each run on each task (Wilson 95% interval in brackets); chance: "
        + ", ".join(f"{t} {c:.2f}" for t, c in chance.items() if c is not None)
        + ".",
        "",
    ]
    rows = []
    for (cell, _, size), row in sorted(by_run.items()):
        cols = []
        for t in tasks:
            s = row.get(t)
            lo, hi = wilson(s.correct, s.n) if s else (0, 0)
            cols.append(f"{s.acc:.3f} [{lo:.2f}, {hi:.2f}]" if s else "-")
        rows.append([cell, size, *cols])
    trend = [trend_cells(cell, t) for cell, t in accuracy_trend(scores).items()]
    lines += [
        *render.table(["cell", "size", *tasks], rows),
        "",
        TREND_TEXT,
        "",
        *render.table(trend_head("examples"), trend),
        "",
        "![zero_shot_tasks](figures/zero_shot_tasks.png)",
        "",
    ]
    return "\n".join(lines)


@dataclass(frozen=True)
class AnswerPoint:
    """One point of the answer's figure: a run (or, `read` set, a rung an answer row is read
    at: the cell's mean over the rung's runs, with the row's question in `read`)."""

    cell: str
    flops: float
    value: float
    read: str = ""


def fig_answer(points: list[AnswerPoint], metric: str, chance: float | None):
    """The answer's metric (the same as the answer table's, e.g. example-weighted zero-shot
    probe accuracy) against training compute: every run, each cell's rung means joined, the
    chance line dotted, and the points the answer rows are read at ringed (gid
    `read:<question>:<cell>`). None without points."""
    runs = [p for p in points if not p.read]
    if not runs:
        return None
    cells = sorted({p.cell for p in runs})
    styles = fs.cell_styles(cells)
    fig, [ax] = fs.grid(1, width=7.5, height=5.0)
    for cell in cells:
        mine = sorted((p for p in runs if p.cell == cell), key=lambda p: p.flops)
        st = styles[cell]
        ax.scatter(
            [p.flops for p in mine],
            [p.value for p in mine],
            s=14,
            alpha=0.6,
            color=st["color"],
            marker=st["marker"],
            label=cell,
        )
        by_rung: dict[float, list[float]] = defaultdict(list)
        for p in mine:  # runs of one rung share its compute up to rounding
            by_rung[float(f"{p.flops:.3g}")].append(p.value)
        xs = sorted(by_rung)
        ax.plot(xs, [float(np.mean(by_rung[x])) for x in xs], color=st["color"], lw=1.0)
    questions = sorted({p.read for p in points if p.read})
    shapes = dict(zip(questions, ["o", "s", "D", "^", "v", "P"] * 4))
    for p in points:
        if p.read:
            ax.scatter(
                [p.flops],
                [p.value],
                s=150,
                facecolor="none",
                lw=1.4,
                edgecolor=styles.get(p.cell, {}).get("color", "k"),
                marker=shapes[p.read],
                gid=f"read:{p.read}:{p.cell}",
            )
    for q in questions:  # one legend entry per question, in black
        ax.scatter(
            [], [], s=80, facecolor="none", edgecolor="k", marker=shapes[q], label=f"read at: {q}"
        )
    if chance is not None:
        ax.axhline(chance, color="0.3", ls=":", lw=1.2, label=f"chance ({chance:.3f})")
    fs.axes(ax, "training compute C (FLOPs)", metric, False)
    fs.legend(ax)
    ax.set_title(f"The answer's metric: {metric}")
    return fig
