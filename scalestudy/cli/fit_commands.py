"""`scalestudy fit` and `scalestudy plot`: their flags, checked settings and handlers.

The command line checks the flags first (`fit_settings`, `plot_settings`), then reads the runs
at its input side (`scalestudy.study.report.fits.load_table`: a registry or a table) and hands the
table to `fit_main` / `plot_main`.

Every bad value (a non-positive tolerance, NaN, an unreadable path, malformed `--fits` JSON,
fits made from other data) is one `ScalingDataError` line; a closed output pipe
(`scalestudy fit ... | head -1`) ends the command quietly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from scalestudy.scaling.fit_plots import make_all_plots
from scalestudy.scaling.fit_text import format_table, format_task_laws, write_json
from scalestudy.scaling.laws import FitSettings, fit_cells
from scalestudy.scaling.table import DataSettings, RunTable, ScalingDataError, fingerprint
from scalestudy.scaling.task_law import TASK_FORMS, fit_task_laws


def add_data_args(p: argparse.ArgumentParser) -> None:
    """Flags that say how a registry or table of runs maps to N, D, C and loss."""
    # In this order, which is the order `--help` lists them in.
    _add_column_args(p)
    _add_unit_args(p)
    _add_filter_args(p)


def _add_column_args(p: argparse.ArgumentParser) -> None:
    """Which column holds N, D, C, loss, the run id, the budget and the groups."""
    p.add_argument("--n-col", default=None, help="column of parameter counts N")
    p.add_argument("--d-col", default=None, help="column of training tokens D")
    p.add_argument("--c-col", default=None, help="column of training FLOPs C")
    p.add_argument("--loss-col", default=None, help="column of final loss")
    p.add_argument("--run-col", default=None, help="run id column (repeated ids: curve points)")
    p.add_argument(
        "--curve-points",
        choices=["mid_schedule", "finished"],
        default="mid_schedule",
        help="with repeated run ids: rows logged mid-way through one schedule (not used for "
        "L(C) or approach 1), or each the end of a finished schedule (cooldown branches)",
    )
    p.add_argument(
        "--budget-col",
        default=None,
        help="IsoFLOP budget column (default 'budget' when present); a numeric label is the "
        "budget's compute",
    )
    p.add_argument(
        "--group-cols",
        default=None,
        help="comma-separated columns fitted apart (default arch,objective if "
        "present; '' for one group)",
    )


def _add_unit_args(p: argparse.ArgumentParser) -> None:
    """The units of N, D and C, and which count each is."""
    p.add_argument("--n-unit", default="", help="multiplier of N values: 1e6, M, B, ...")
    p.add_argument("--d-unit", default="", help="multiplier of D values: 1e9, B, T, ...")
    p.add_argument("--c-unit", default="", help="multiplier of C values: 1e18, PF-days, ...")
    p.add_argument(
        "--n-kind",
        choices=["total", "non_embedding", "active"],
        default="non_embedding",
        help="registry: which parameter count is N (active: non-embedding, used per token)",
    )
    p.add_argument(
        "--d-kind",
        choices=["positions", "tokens"],
        default="positions",
        help="registry: D as processed positions or loss-bearing tokens",
    )
    p.add_argument(
        "--c-kind",
        choices=["counted", "6nd"],
        default=None,
        help="C as counted FLOPs or 6ND (default: counted if a C column exists)",
    )


def _add_filter_args(p: argparse.ArgumentParser) -> None:
    """Which runs are fitted: invalid rows, conditions, exclusions, unplanned runs."""
    p.add_argument(
        "--drop-invalid",
        action="store_true",
        help="drop runs with NaN/non-positive values instead of failing",
    )
    p.add_argument(
        "--where",
        action="append",
        default=[],
        metavar="COND",
        help="keep only runs meeting COND, e.g. 'N>=1e8', 'arch=causal_decoder' (repeatable)",
    )
    p.add_argument("--exclude", default=None, help="comma-separated run ids to leave out")
    p.add_argument(
        "--all-runs",
        action="store_true",
        help="a study's registry: also the runs its spec no longer plans (left out by default)",
    )


def data_settings_from_args(args) -> DataSettings:
    """DataSettings from parsed data flags."""
    groups = None
    if args.group_cols is not None:
        groups = tuple(g.strip() for g in args.group_cols.split(",") if g.strip())
    exclude = tuple(e.strip() for e in (args.exclude or "").split(",") if e.strip())
    return DataSettings(
        n_col=args.n_col,
        d_col=args.d_col,
        c_col=args.c_col,
        loss_col=args.loss_col,
        run_col=args.run_col,
        curve_points=args.curve_points,
        budget_col=args.budget_col,
        group_cols=groups,
        n_kind=args.n_kind,
        d_kind=args.d_kind,
        c_kind=args.c_kind,
        n_unit=args.n_unit,
        d_unit=args.d_unit,
        c_unit=args.c_unit,
        drop_invalid=args.drop_invalid,
        where=tuple(args.where),
        exclude=exclude,
        all_runs=args.all_runs,
    )


def add_fit_args(p: argparse.ArgumentParser) -> None:
    """Flags of `scalestudy fit` beyond the data flags."""
    p.add_argument("--law", default="auto", help="comma-separated laws, or auto")
    p.add_argument("--bootstrap", type=int, default=200, help="resamples of runs (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ci", type=float, default=0.95, help="interval coverage, in (0, 1)")
    p.add_argument("--huber-delta", type=float, default=1e-3)
    p.add_argument("--flops-per-nd", type=float, default=None, help="k in C = k N D")
    p.add_argument("--holdout", type=int, default=0, help="hold out the N largest-C runs")
    p.add_argument(
        "--isoflop-tol", type=float, default=0.1, help="dex; widest spread of one IsoFLOP budget"
    )
    p.add_argument("--compare-at", default=None, help="comma-separated compute budgets")
    p.add_argument(
        "--at-compute",
        default=None,
        help="comma-separated compute budgets: N_opt, D_opt and D/N there, with intervals",
    )
    p.add_argument(
        "--kfold",
        default="0",
        help="cross-validate each law: K folds, or 'loo' for leave-one-out (0: off)",
    )
    p.add_argument(
        "--task-law",
        action="store_true",
        help="fit task laws instead of loss laws: task loss in N and D (or C), then a sigmoid "
        "to accuracy, per task with eval/<task>/task_loss and eval/<task>/acc columns",
    )
    p.add_argument(
        "--holdout-largest",
        action="store_true",
        help="with --task-law: backtest by fitting all sizes but the largest and predicting "
        "its accuracy",
    )
    p.add_argument(
        "--task-form",
        default="auto",
        help=f"with --task-law: the law of task loss ({', '.join(TASK_FORMS)}; auto: "
        "chinchilla3 when N and D each take 3+ values, else kaplan_n)",
    )
    p.add_argument("--task-loss-metric", default="task_loss", help="eval/<task>/<this> column")
    p.add_argument("--task-acc-metric", default="acc", help="eval/<task>/<this> column")
    p.add_argument(
        "--min-points-per-param",
        type=float,
        default=3.0,
        help="fits with fewer points per parameter are flagged",
    )


def _budgets(text: str | None, flag: str) -> tuple[float, ...]:
    if not text:
        return ()
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ScalingDataError(
            f"{flag} {text!r}: not comma-separated numbers; give e.g. 1e21,1e22"
        ) from None


def fit_settings(args) -> FitSettings:
    """FitSettings from parsed `scalestudy fit` arguments, every flag and --out checked."""
    kfold_text = str(args.kfold).strip().lower()
    try:
        kfold = -1 if kfold_text in ("loo", "-1") else int(kfold_text)
    except ValueError:
        raise ScalingDataError(
            f"--kfold {args.kfold!r} is not accepted; give 0 (off), 'loo' or an integer >= 2"
        ) from None
    settings = FitSettings(
        laws=tuple(x.strip() for x in args.law.split(",")),
        data=data_settings_from_args(args),
        bootstrap=args.bootstrap,
        seed=args.seed,
        ci=args.ci,
        huber_delta=args.huber_delta,
        flops_per_nd=args.flops_per_nd,
        holdout=args.holdout,
        isoflop_tol=args.isoflop_tol,
        compare_at=_budgets(args.compare_at, "--compare-at"),
        at_compute=_budgets(args.at_compute, "--at-compute"),
        kfold=kfold,
        min_points_per_param=args.min_points_per_param,
    )
    if args.task_form not in TASK_FORMS:
        raise ScalingDataError(f"--task-form {args.task_form!r}; accepted: {', '.join(TASK_FORMS)}")
    if args.holdout_largest and not args.task_law:
        raise ScalingDataError("--holdout-largest backtests task laws: add --task-law")
    if args.out:
        _writable_file(args.out, "--out")
    return settings


def _writable_file(path: str, flag: str) -> Path:
    """A path a file can be written to (its folder is created), or a clear error."""
    p = Path(path)
    if p.is_dir():
        raise ScalingDataError(f"{flag} {p} is a directory; give a file name such as fits.json")
    parent = next((q for q in p.absolute().parents if q.exists()), None)
    if parent is not None and (not parent.is_dir() or not os.access(parent, os.W_OK)):
        raise ScalingDataError(f"{flag} {p}: cannot write under {parent}")
    return p


def _writable_dir(path: str, flag: str) -> Path:
    """A directory the figures can go to, checked without creating it (a refused command
    leaves the disk as it found it; the figures' writer makes it)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ScalingDataError(f"{flag} {p} is a file; give a directory for the figures")
    here = next(q for q in (p.absolute(), *p.absolute().parents) if q.exists())
    if not here.is_dir() or not os.access(here, os.W_OK):
        what = "the directory is" if here == p.absolute() else f"{here} is"
        raise ScalingDataError(f"{flag} {p}: {what} not a writable directory")
    return p


def _quiet_broken_pipe() -> int:
    """The reader of stdout went away (`| head`): stop printing, without a traceback."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 141  # 128 + SIGPIPE, as a shell reports a pipeline cut short


def fit_main(args, settings: FitSettings, table: RunTable) -> int:
    """`scalestudy fit`: fit, print a table (or JSON), optionally write the JSON."""
    sizes = {c: table.cell.count(c) for c in table.cells()}
    if sizes and settings.holdout >= min(sizes.values()):
        cell, n = min(sizes.items(), key=lambda kv: kv[1])
        raise ScalingDataError(
            f"--holdout {settings.holdout}: cell {cell!r} has only {n} run(s); hold out fewer "
            f"than {n} so that some remain to fit"
        )
    out = Path(args.out) if args.out else None
    if args.task_law:
        result = {
            "settings": {"bootstrap": settings.bootstrap, "seed": settings.seed, "ci": settings.ci},
            "data": table.choices,
            "data_fingerprint": fingerprint(table),
            "cells": {},
            "task_laws": fit_task_laws(
                table,
                settings,
                args.task_form,
                args.holdout_largest,
                args.task_loss_metric,
                args.task_acc_metric,
            ),
        }
    else:
        result = fit_cells(table, settings=settings)
    if out is not None:
        try:
            write_json(result, out)
        except OSError as e:
            raise ScalingDataError(f"--out {out}: cannot write ({e.strerror})") from None
    if args.json:
        text = json.dumps(result, indent=2, default=str)
    else:
        text = format_task_laws(result["task_laws"]) if args.task_law else format_table(result)
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        return _quiet_broken_pipe()
    return 0


def read_fits(path: str, table) -> dict:
    """Fits written by `scalestudy fit --out`, checked to be JSON fits of these very runs."""
    p = Path(path)
    if not p.is_file():
        raise ScalingDataError(f"--fits: no such file {p}")
    try:
        fits = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ScalingDataError(f"--fits {p}: not valid JSON ({e})") from None
    except OSError as e:
        raise ScalingDataError(f"--fits {p}: cannot read ({e.strerror})") from None
    if not isinstance(fits, dict) or not isinstance(fits.get("cells"), dict):
        raise ScalingDataError(
            f"--fits {p}: not a fit result (no 'cells'); give the JSON `scalestudy fit --out` wrote"
        )
    want, got = fits.get("data_fingerprint"), fingerprint(table)
    if want is None:
        raise ScalingDataError(
            f"--fits {p} records no data fingerprint (written by an older version); refit it"
        )
    if want != got:
        raise ScalingDataError(
            f"--fits {p} was fitted to other runs (data fingerprint {want}; these runs give "
            f"{got}); refit, or give the source, columns and --where/--exclude used for the fit"
        )
    return fits


def plot_settings(args) -> FitSettings:
    """FitSettings (without --fits) from parsed `scalestudy plot` arguments; --out checked."""
    settings = FitSettings(bootstrap=args.bootstrap, data=data_settings_from_args(args))
    _writable_dir(args.out, "--out")
    return settings


def plot_main(args, settings: FitSettings, table: RunTable) -> int:
    """`scalestudy plot`: figures of a table of runs, with fits from --fits or fitted here."""
    fits = read_fits(args.fits, table) if args.fits else fit_cells(table, settings=settings)
    paths = make_all_plots(table, fits, Path(args.out))
    try:
        for p in paths:
            print(p)
        sys.stdout.flush()
    except BrokenPipeError:
        return _quiet_broken_pipe()
    return 0
