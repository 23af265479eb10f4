"""What each `scalestudy` command does: one `cmd_<name>` handler per subcommand.

A handler takes the parsed arguments (`cli.parse_args`) and returns the exit status. Heavy
modules (JAX, TensorFlow) are imported inside the handlers so that `scalestudy --help` and
config errors answer instantly.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from scalestudy.cli import args as cli_args
from scalestudy.config.errors import ScalestudyError
from scalestudy.config.experiment import ExperimentConfig, load_config


def print_dict(obj: dict, as_json: bool) -> None:
    """Print `obj` as indented JSON, or one aligned `key  value` line per item."""
    if as_json:
        print(json.dumps(obj, indent=2, sort_keys=False, default=str))
    else:
        width = max(len(k) for k in obj)
        for k, v in obj.items():
            print(f"{k:<{width}}  {v}")


def _print_results(compute: Callable[[], dict], as_json: bool) -> int:
    """Print the results `compute` returns (exit status 0). Results computed but not saved in
    the run directory are printed too, before the one error line saying why."""
    from scalestudy.train.rundir.layout import RunNotUpdated

    try:
        results = compute()
    except RunNotUpdated as e:
        print_dict(e.results, as_json)
        raise
    print_dict(results, as_json)
    return 0


def _join_job() -> None:
    """Join a multi-host job when the environment says this is one (train/sharding.py), with
    the TPU compiler's flags set first (train/plan/aot.py)."""
    from scalestudy.train.plan.aot import set_compiler_flags
    from scalestudy.train.sharding import initialize_distributed

    set_compiler_flags()
    initialize_distributed()


def _load_config(path: str | Path, overrides: list[str]) -> ExperimentConfig:
    """The experiment config of a command, with the evaluation tasks it names checked: a
    misspelt task, or a task file that is not there, would otherwise be found only when the
    trained run is evaluated (evaluate/tasks.py `check_names`)."""
    from scalestudy.evaluate.tasks import check_names

    cfg = load_config(path, overrides)
    check_names(cfg.eval.tasks)
    for task, file in cfg.eval.fewshot_files.items():
        cli_args.checked_path(file, f"eval.fewshot_files.{task}", "a file", must_exist=True)
    return cfg


def cmd_describe(args: argparse.Namespace) -> int:
    cfg = _load_config(args.config, args.overrides)
    from scalestudy.models import counting

    info = counting.describe(cfg)
    if args.json:
        print_dict(info, True)
        return 0
    shapes = info.pop("shapes")
    print_dict({k: f"{v:,.0f}" if type(v) in (int, float) else v for k, v in info.items()}, False)
    print("parameters (shape, logical axes):")
    width = max(len(k) for k in shapes)
    for name, shape in shapes.items():
        print(f"  {name:<{width}}  {shape}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from scalestudy.train.loop import Preempted, train
    from scalestudy.train.rundir import layout as rundir

    workdir = cli_args.run_dir(args.workdir, must_exist=False)
    if args.members is not None:
        return _train_members(args, workdir)
    cfg_path = args.config
    if cfg_path is not None:
        cli_args.check_recorded_config(workdir)
    if cfg_path is None:
        resolved = rundir.config_path(workdir)
        if not resolved.is_file():
            raise ScalestudyError(
                f"--config not given and {resolved} does not exist; give --config FILE to "
                "start a run, or --workdir of an existing run to resume it"
            )
        cfg_path = resolved
    cfg = _load_config(cfg_path, args.overrides)
    _join_job()
    from scalestudy.train import sharding

    # The mesh against the model and batch before any data is read or anything compiles.
    sharding.make_mesh(cfg.mesh, model=cfg.model, batch=cfg.train)
    eval_fn = None
    if args.eval:  # zero-shot, on this run's mesh, before the job ends
        from scalestudy.evaluate.rank import make_eval_fn

        eval_fn = make_eval_fn(cfg, workdir)
    try:
        summary = train(cfg, workdir, eval_fn=eval_fn)
    except Preempted as e:  # checkpoint saved: exit without a traceback, resumable
        print(f"stopped: {e}", file=sys.stderr)
        return 128 + e.signum
    except OSError as e:  # a file the run needs cannot be read or written: one line
        raise ScalestudyError(str(e)) from None
    print_dict({k: v for k, v in summary.items() if not isinstance(v, dict)}, args.json)
    return 0


def _train_members(args: argparse.Namespace, workdir: Path) -> int:
    """`train --members`: one group, each member in its own `workdir/<member>` directory."""
    from scalestudy.train.loop import Preempted, train_group

    base, cfgs, dirs = _member_configs(args, workdir)
    _join_job()
    from scalestudy.train import sharding

    mesh = sharding.make_mesh(base.mesh, model=base.model, batch=base.train)
    sharding.check_members_fit(base.mesh, dict(mesh.shape), len(cfgs))
    eval_fns = [None] * len(cfgs)
    if args.eval:
        from scalestudy.evaluate.rank import make_eval_fn

        eval_fns = [make_eval_fn(c, d) for c, d in zip(cfgs, dirs)]
    try:
        results = train_group(cfgs, dirs, eval_fns)
    except Preempted as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 128 + e.signum
    except OSError as e:
        raise ScalestudyError(str(e)) from None
    return _report_members(cfgs, dirs, results, args.json)


def _member_configs(
    args: argparse.Namespace, workdir: Path
) -> tuple[ExperimentConfig, list[ExperimentConfig], list[Path]]:
    """`train --members`: the base config, each member's config and each member's directory,
    checked before any device is touched."""
    from scalestudy.cli import member_grid
    from scalestudy.train import members
    from scalestudy.train.rundir import layout as rundir

    grid = member_grid.parse_grid(args.members, args.overrides)
    dirs = [workdir / name for name, _ in grid]
    cfg_path = args.config
    for d in dirs if cfg_path is not None else ():
        cli_args.check_recorded_config(d)
    if cfg_path is None:  # resuming: the first member's recorded config, re-gridded
        cfg_path = rundir.config_path(dirs[0])
        if not cfg_path.is_file():
            raise ScalestudyError(
                f"--config not given and {cfg_path} does not exist; give --config FILE to "
                "start the group, or the --workdir and --members of an existing group"
            )
    base = _load_config(cfg_path, args.overrides)
    cfgs = [
        load_config(cfg_path, [*args.overrides, *ov, f"name={base.name}.{name}"])
        for name, ov in grid
    ]
    members.check_group(cfgs)
    return base, cfgs, dirs


def _report_members(
    cfgs: list[ExperimentConfig], dirs: list[Path], results: list, as_json: bool
) -> int:
    """Print one row per member (its summary, or the error that stopped it); exit status 1
    when any member stopped."""
    rows = []
    for cfg, d, result in zip(cfgs, dirs, results):
        if isinstance(result, Exception):
            rows.append({"name": cfg.name, "workdir": str(d), "error": str(result)})
        else:
            plain = {k: v for k, v in result.items() if not isinstance(v, dict)}
            rows.append({"workdir": str(d), **plain})
    if as_json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        for row in rows:
            what = row.get("error") or f"final_val_loss {row.get('final_val_loss'):.4f}"
            print(f"{row['workdir']}  {what}")
    failed = [r for r in rows if "error" in r]
    if failed:
        print(
            f"error: {len(failed)} of {len(rows)} members stopped (listed above); the others "
            "finished",
            file=sys.stderr,
        )
        return 1
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    workdir = cli_args.run_dir(args.workdir, must_exist=True)
    if args.tasks == []:
        raise ScalestudyError(
            "--tasks given without names; give task names or task YAML files (e.g. --tasks "
            "synthetic_probes), or leave out --tasks for the run's eval.tasks"
        )
    cli_args.check_step(workdir, args.step)
    cli_args.output_file(args.out)
    _join_job()
    from scalestudy.evaluate.rank import evaluate_run
    from scalestudy.train.rundir import logfile

    # `--tasks a b eval.x=1` hands the override to --tasks: `dotted.key=value` is an override.
    is_override = re.compile(r"^[A-Za-z_][\w.]*=").match
    tasks = [t for t in args.tasks or () if not is_override(t)] or None
    overrides = [*(t for t in args.tasks or () if is_override(t)), *args.overrides]
    _check_per_task_keys(tasks, overrides)
    if args.num_fewshot is not None:
        # for every task scored: a run's per-task numbers give way to the command line's
        overrides += [f"eval.num_fewshot={args.num_fewshot}", "eval.num_fewshot_per_task=null"]

    def evaluate() -> dict:
        with logfile.library_logs_of(workdir):
            given = {"data_dir": args.data_dir, "step": args.step, "out": args.out}
            return evaluate_run(
                workdir, tasks, **given, max_examples=args.max_examples, overrides=overrides
            )

    return _print_results(evaluate, args.json)


def _check_per_task_keys(tasks: list[str] | None, overrides: list[str]) -> None:
    """`eval --tasks A B eval.num_fewshot_per_task={C: [1]}`: a per-task key given on the
    command line names a task scored by it, as `train` requires of its config (the run's
    recorded keys may name its other tasks). Task files name their tasks inside: not looked."""
    from scalestudy.config.yamlio import apply_overrides

    if not tasks or any(":" in t or t.endswith((".yaml", ".yml")) for t in tasks):
        return
    given = apply_overrides({}, overrides).get("eval", {})
    for key in ("num_fewshot_per_task", "fewshot_files"):
        named = given.get(key) if isinstance(given, dict) else None
        unknown = [str(k) for k in named or {} if k not in tasks] if isinstance(named, dict) else []
        if unknown:
            raise ScalestudyError(
                f"eval.{key} names {unknown[0]!r}, which is not a task scored here "
                f"(--tasks {' '.join(tasks)}); accepted: one of those names"
            )


def cmd_harness(args: argparse.Namespace) -> int:
    """lm-eval's own command line, `argv` unchanged, with the model "scalestudy" registered
    (lm-eval finds no models outside its package by itself)."""
    _join_job()
    # Registers the model; one error line naming the extra when lm-eval is not installed.
    from scalestudy.evaluate.harness_model import run_cli

    return run_cli(args.lm_eval_args)


def cmd_study(args: argparse.Namespace) -> int:
    if args.status:  # read the registry only: runs, status, lineage
        from scalestudy.study.run.status import status_table

        print(status_table(args.out))
        return 0
    cli_args.checked_path(args.spec, "--spec", "a YAML file", must_exist=True)
    cli_args.output_dir(args.out)
    if args.stage_run is not None and not args.stage_run.strip():
        raise ScalestudyError("--stage-run is empty; give a run's name (see --status)")
    _join_job()
    if args.stage_run and (args.collect or args.dry_run):
        raise ScalestudyError(
            "--stage-run trains one stage run: give it without --collect/--dry-run"
        )
    if args.stage_run:  # one stage run, as a cluster task after its parent's job
        return _study_stage_run(args)
    from scalestudy.decoder_only import experiments
    from scalestudy.study.run.interrupts import StudyInterrupted
    from scalestudy.study.run.order import run_main_job

    try:
        run_main_job(
            Path(args.spec),
            Path(args.out),
            args.overrides,
            dry_run=args.dry_run,
            collect=args.collect,
            workers=args.workers,
            experiments=experiments.run_experiments,
        )
    except StudyInterrupted as e:  # running runs checkpointed: resumable, no traceback
        print(f"stopped: {e}", file=sys.stderr)
        return 128 + e.signum
    except OSError as e:  # a study file cannot be read or written: one line
        raise ScalestudyError(str(e)) from None
    return 0


def _study_stage_run(args: argparse.Namespace) -> int:
    """`study --stage-run NAME`: train that one stage run and print its summary."""
    from scalestudy.study.run import after_pretraining
    from scalestudy.train.loop import Preempted

    try:
        summary = after_pretraining.run_named(
            Path(args.spec), Path(args.out), args.stage_run, args.overrides
        )
    except Preempted as e:  # checkpoint saved: the task requeues itself and resumes
        print(f"stopped: {e}", file=sys.stderr)
        return 128 + e.signum
    print_dict({k: v for k, v in summary.items() if not isinstance(v, dict)}, False)
    return 0


def cmd_fit(args: argparse.Namespace) -> int:
    from scalestudy.cli.fit_commands import fit_main, fit_settings
    from scalestudy.study.report.fits import load_table

    cli_args.check_data_kinds(args)
    settings = fit_settings(args)
    return fit_main(args, settings, load_table(args.source, settings.data))


def cmd_plot(args: argparse.Namespace) -> int:
    from scalestudy.cli.fit_commands import plot_main, plot_settings
    from scalestudy.study.report.fits import load_table

    cli_args.check_data_kinds(args)
    settings = plot_settings(args)
    return plot_main(args, settings, load_table(args.source, settings.data))


def cmd_launch(args: argparse.Namespace) -> int:
    from scalestudy.study.run.after_pretraining import launch

    cli_args.checked_path(args.spec, "--spec", "a YAML file", must_exist=True)
    out = cli_args.output_dir(args.out)
    print(launch(Path(args.spec), args.executor, out, submit=args.submit))
    return 0


def cmd_attention_rank(args: argparse.Namespace) -> int:
    workdir = cli_args.run_dir(args.workdir, must_exist=True)
    cli_args.check_step(workdir, args.step)
    cli_args.output_file(args.out)
    _join_job()
    from scalestudy.decoder_only.attention_rank import measure_run
    from scalestudy.train.rundir import logfile

    def measure() -> dict:
        with logfile.library_logs_of(workdir):  # orbax's notes to the run's log
            return measure_run(workdir, step=args.step, out=args.out)

    return _print_results(measure, args.json)


def cmd_experts(args: argparse.Namespace) -> int:
    from scalestudy.train.rundir import layout as rundir

    workdir = cli_args.run_dir(args.workdir, must_exist=True)
    cli_args.check_step(workdir, args.step)
    if args.out is not None:  # a folder made for the figures, never a whole missing path
        out = cli_args.output_dir(args.out, parent_must_exist=True)
    else:
        out = rundir.experts_dir(workdir)
    cli_args.writable_dir(out, "--out" if args.out is not None else "the run's experts folder")
    if args.tokens is not None and (empty := [t for t in args.tokens if not t]):
        raise ScalestudyError(
            f"--tokens has {len(empty)} empty string(s); give strings such as '.' ' the'"
        )
    _join_job()
    from scalestudy.analysis import experts
    from scalestudy.train.rundir import logfile

    strings = experts.DEFAULT_TOKENS if args.tokens is None else tuple(args.tokens)
    with logfile.library_logs_of(workdir):  # orbax's notes to the run's log, not the terminal
        results = experts.measure_run(
            workdir, args.step, out, strings=strings, rows=args.rows, top=args.top
        )
    print_dict(results, args.json)
    return 0


def cmd_vocab(args: argparse.Namespace) -> int:
    from scalestudy.data.vocab import train_sentencepiece

    out = cli_args.checked_path(args.out, "--out", "a file", writable=True)
    path = train_sentencepiece([Path(p) for p in args.inputs], out, vocab_size=args.vocab_size)
    print(path)
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    from scalestudy.study.plan import stages_spec
    from scalestudy.study.run import stages
    from scalestudy.train.rundir import logfile

    cli_args.checked_path(args.parent, "--from", "a run directory")
    cli_args.output_dir(args.out)
    settings = stages_spec.FinetuneConfig if args.command == "finetune" else stages_spec.AdaptConfig
    cli_args.check_stage_keys(args.command, args.overrides, settings.model_fields)
    _join_job()
    prepare = stages.prepare_finetune if args.command == "finetune" else stages.prepare_adapt
    with logfile.library_logs_dropped():  # orbax's notes on the parent's checkpoints
        cfg, record = prepare(Path(args.parent), Path(args.out), args.overrides)
    summary = stages.run_stage(cfg, record, Path(args.out), evaluate=args.command == "finetune")
    print_dict({k: v for k, v in summary.items() if not isinstance(v, dict)}, args.json)
    return 0
