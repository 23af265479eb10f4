"""The `scalestudy` command: a thin layer that parses arguments and calls the package.

Each subcommand has one `_cmd_<name>` handler. Heavy modules (JAX, TensorFlow) are imported
inside the handlers so that `scalestudy --help` and config errors answer instantly.
Every `ScalestudyError` is printed as `error: ...` with exit status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from scalestudy import cli_args
from scalestudy.config import load_config
from scalestudy.errors import ScalestudyError
from scalestudy.scaling import command as scaling_command


def _add_config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--config", required=required, help="experiment or model YAML file")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted config overrides")


def _print(obj: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(obj, indent=2, sort_keys=False, default=str))
    else:
        width = max(len(k) for k in obj)
        for k, v in obj.items():
            print(f"{k:<{width}}  {v}")


def _join_job() -> None:
    """Join a multi-host job when the environment says this is one (train/sharding.py)."""
    from scalestudy.train.sharding import initialize_distributed

    initialize_distributed()


# ----------------------------------------------------------------------------- handlers


def _cmd_describe(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    from scalestudy.models import counting

    info = counting.describe(cfg)
    if args.json:
        _print(info, True)
        return 0
    shapes = info.pop("shapes")
    _print({k: f"{v:,.0f}" if type(v) in (int, float) else v for k, v in info.items()}, False)
    print("parameters (shape, logical axes):")
    width = max(len(k) for k in shapes)
    for name, shape in shapes.items():
        print(f"  {name:<{width}}  {shape}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from scalestudy.train import rundir
    from scalestudy.train.loop import Preempted, train

    workdir = cli_args.run_dir(args.workdir, must_exist=False)
    cfg_path = args.config
    if cfg_path is None:
        resolved = rundir.config_path(workdir)
        if not resolved.is_file():
            raise ScalestudyError(
                f"--config not given and {resolved} does not exist; give --config FILE to "
                "start a run, or --workdir of an existing run to resume it"
            )
        cfg_path = resolved
    cfg = load_config(cfg_path, args.overrides)
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
    _print({k: v for k, v in summary.items() if not isinstance(v, dict)}, args.json)
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    workdir = cli_args.run_dir(args.workdir, must_exist=True)
    if args.tasks == []:
        raise ScalestudyError(
            "--tasks given without names; give task names or task YAML files (e.g. --tasks "
            "synthetic_probes), or leave out --tasks for the run's eval.tasks"
        )
    cli_args.check_step(workdir, args.step)
    _join_job()
    from scalestudy.evaluate.rank import evaluate_run
    from scalestudy.train.rundir import RunNotUpdated

    # `--tasks a b eval.x=1` hands the override to --tasks: `dotted.key=value` is an override.
    is_override = re.compile(r"^[A-Za-z_][\w.]*=").match
    tasks = [t for t in args.tasks or () if not is_override(t)] or None
    overrides = [*(t for t in args.tasks or () if is_override(t)), *args.overrides]
    try:
        results = evaluate_run(
            workdir,
            tasks=tasks,
            data_dir=args.data_dir,
            step=args.step,
            max_examples=args.max_examples,
            overrides=overrides,
            out=args.out,
        )
    except RunNotUpdated as e:  # computed, not saved: show them, then the one error line
        _print(e.results, args.json)
        raise
    _print(results, args.json)
    return 0


def _cmd_study(args: argparse.Namespace) -> int:
    if args.status:  # read the registry only: runs, status, lineage
        from scalestudy.study.status import status_table

        print(status_table(args.out))
        return 0
    _join_job()
    from scalestudy.study.stopping import StudyInterrupted
    from scalestudy.study.sweep import run_study

    try:
        study, runs = run_study(
            Path(args.spec),
            Path(args.out),
            overrides=args.overrides,
            dry_run=args.dry_run,
            collect=args.collect,
            workers=args.workers,
        )
        if not args.dry_run and study.experiments is not None:  # the decoder-only experiments
            from scalestudy.decoder_only import run as decoder_only

            decoder_only.run(study, runs, Path(args.out))
        if study.stages is not None and args.collect:  # collecting never trains
            print("stages after pretraining: not run by --collect; run without it to train them")
        elif study.stages is not None:  # adaptation and finetuning after pretraining
            from scalestudy.study import pipeline

            pipeline.run(study, Path(args.spec).parent, Path(args.out), runs, dry_run=args.dry_run)
    except StudyInterrupted as e:  # running runs checkpointed: resumable, no traceback
        print(f"stopped: {e}", file=sys.stderr)
        return 128 + e.signum
    except OSError as e:  # a study file cannot be read or written: one line
        raise ScalestudyError(str(e)) from None
    return 0


def _cmd_fit(args: argparse.Namespace) -> int:
    from scalestudy.scaling.command import fit_main, fit_settings
    from scalestudy.study.fits import load_table

    cli_args.check_data_kinds(args)
    settings = fit_settings(args)
    return fit_main(args, settings, load_table(args.source, settings.data))


def _cmd_plot(args: argparse.Namespace) -> int:
    from scalestudy.scaling.command import plot_main, plot_settings
    from scalestudy.study.fits import load_table

    cli_args.check_data_kinds(args)
    settings = plot_settings(args)
    return plot_main(args, settings, load_table(args.source, settings.data))


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.config and args.preset:
        raise ScalestudyError(
            f"--config and --preset {args.preset} exclude each other: --config gives the whole "
            "shape, --preset a built-in one; give one"
        )
    args.preset = args.preset or "small"
    if args.what == "train":
        return _bench_train(args)
    if args.what == "peer":
        from scalestudy.bench.peer import PEER_SHAPE, bench_peer
        from scalestudy.bench.train import preset_config

        overrides = (*PEER_SHAPE, *args.overrides)
        cfg = (
            load_config(args.config, overrides)
            if args.config
            else preset_config(args.preset, args.seq, overrides)
        )
        _print(bench_peer(cfg, steps=args.steps, which=args.peer), args.json)
        return 0
    if args.what == "data":
        from scalestudy.bench.data import bench as bench_fn
    else:
        from scalestudy.bench.eval import bench as bench_fn
    cfg = load_config(args.config, args.overrides) if args.config or args.overrides else None
    _print(bench_fn(cfg, steps=args.steps), args.json)
    return 0


def _bench_train(args: argparse.Namespace) -> int:
    from scalestudy.bench.train import bench, preset_config

    if args.config:
        cfg = load_config(args.config, args.overrides)
    else:
        cfg = preset_config(args.preset, args.seq, tuple(args.overrides))
    archs = tuple(args.arch.split(",")) if args.arch else None
    result = bench(cfg, steps=args.steps, archs=archs)
    if args.json:
        _print(result, True)
        return 0
    rows = {k: v for k, v in result.items() if isinstance(v, dict)}  # one per architecture
    _print({k: v for k, v in result.items() if not isinstance(v, dict)}, False)
    cols = list(next(iter(rows.values())))
    print("\n" + "  ".join(f"{c:>17}" for c in ["arch", *cols]))
    for arch, row in rows.items():
        print("  ".join(f"{v!s:>17}" for v in [arch, *row.values()]))
    return 0


def _cmd_compile(args: argparse.Namespace) -> int:
    if args.topology:  # the TPU compiler needs no local TPU: keep JAX off any TPU runtime
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from scalestudy.train.aot import compile_plan

    if (args.config is None) == (args.spec is None):
        raise ScalestudyError("compile: give --config FILE (one run) or --spec STUDY (every shape)")
    if args.spec:  # every shape of the study: pretraining and the stages after it
        from scalestudy.study.compile_plan import compile_study

        plans = compile_study(args.spec, args.overrides, args.topology)
        if args.json:
            print(json.dumps(plans, indent=2, default=str))
        for plan in [] if args.json else plans:
            _print(plan, False)
            print()
        return 0
    cfg = load_config(args.config, args.overrides)
    _print(compile_plan(cfg, topology=args.topology), args.json)
    return 0


def _cmd_launch(args: argparse.Namespace) -> int:
    from scalestudy.study.sweep import launch

    print(launch(Path(args.spec), args.executor, Path(args.out), submit=args.submit))
    return 0


def _cmd_probe(args: argparse.Namespace) -> int:
    workdir = cli_args.run_dir(args.workdir, must_exist=True)
    cli_args.check_step(workdir, args.step)
    _join_job()
    from scalestudy.decoder_only.attention_rank import probe_run
    from scalestudy.train.rundir import RunNotUpdated

    try:
        results = probe_run(workdir, step=args.step, out=args.out)
    except RunNotUpdated as e:  # computed, not saved: show them, then the one error line
        _print(e.results, args.json)
        raise
    _print(results, args.json)
    return 0


def _cmd_vocab(args: argparse.Namespace) -> int:
    from scalestudy.data.vocab import train_sentencepiece

    path = train_sentencepiece(
        [Path(p) for p in args.inputs], Path(args.out), vocab_size=args.vocab_size
    )
    print(path)
    return 0


# ----------------------------------------------------------------------------- parser


def _cmd_stage(args: argparse.Namespace) -> int:
    from scalestudy.study import stages

    _join_job()
    prepare = stages.prepare_finetune if args.command == "finetune" else stages.prepare_adapt
    cfg, record = prepare(Path(args.parent), Path(args.out), args.overrides)
    summary = stages.run_stage(cfg, record, Path(args.out), evaluate=args.command == "finetune")
    _print({k: v for k, v in summary.items() if not isinstance(v, dict)}, args.json)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scalestudy", description="Architecture x objective scaling studies in JAX/Flax."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("describe", help="parameter and FLOP counts of a config (no weights)")
    _add_config_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_cmd_describe)

    p = sub.add_parser("train", help="train one run; resumes from --workdir by default")
    _add_config_args(p, required=False)
    p.add_argument("--workdir", required=True)
    p.add_argument("--eval", action="store_true", help="then evaluate eval.tasks zero-shot")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_cmd_train)

    p = sub.add_parser("eval", help="zero-shot evaluation of a run's checkpoint")
    p.add_argument("--workdir", required=True)
    p.add_argument("--tasks", nargs="*", default=None, help="task names or task YAML files")
    p.add_argument("--data-dir", default=None, help="directory holding released task files")
    p.add_argument(
        "--step",
        type=cli_args.checkpoint_step,
        default=None,
        help="checkpoint step (default: latest)",
    )
    p.add_argument("--max-examples", type=cli_args.positive_int, default=None, help="per task")
    p.add_argument("--out", default=None, help="write the scores to this JSON file instead")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*", metavar="eval.key=value", help="evaluation settings")
    p.set_defaults(fn=_cmd_eval)

    p = sub.add_parser("study", help="run (or resume) a whole study from its spec")
    p.add_argument("--spec", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true", help="expand and validate, do not train")
    p.add_argument("--status", action="store_true", help="list the runs in --out; train none")
    p.add_argument(
        "--workers",
        type=cli_args.positive_int,
        default=1,
        help="runs trained at a time on this host, each in its own process (default 1)",
    )
    p.add_argument(
        "--collect", action="store_true", help="record cluster-trained runs; never train"
    )
    p.add_argument("overrides", nargs="*", metavar="key.sub=value")
    p.set_defaults(fn=_cmd_study)

    for name, what in (
        ("finetune", "multitask prompted finetuning of a finished run, then held-out zero-shot"),
        ("adapt", "continue a finished run under another objective and/or mask"),
    ):
        p = sub.add_parser(name, help=what)
        p.add_argument("--from", dest="parent", required=True, help="a finished run directory")
        p.add_argument("--out", required=True, help="the new run's directory")
        p.add_argument("--json", action="store_true")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="stage or run keys")
        p.set_defaults(fn=_cmd_stage)

    p = sub.add_parser("fit", help="fit scaling laws to a study registry or a CSV/JSONL of runs")
    p.add_argument("source", help="registry .sqlite, study directory, .csv/.tsv or .jsonl")
    scaling_command.add_data_args(p)
    scaling_command.add_fit_args(p)
    p.add_argument("--out", default=None, help="write the fit JSON here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_cmd_fit, n_kind=None, d_kind=None)

    p = sub.add_parser("plot", help="figures (PNG + SVG) from a study's results and fits")
    p.add_argument("source", help="registry .sqlite, study directory, .csv/.tsv or .jsonl")
    p.add_argument("--out", required=True, help="directory for the figures")
    p.add_argument("--fits", default=None, help="fit JSON from `scalestudy fit --out`")
    p.add_argument(
        "--bootstrap", type=int, default=0, help="without --fits: resamples for the bands"
    )
    scaling_command.add_data_args(p)
    p.set_defaults(fn=_cmd_plot, n_kind=None, d_kind=None)

    p = sub.add_parser("bench", help="benchmarks: data pipeline, train step, evaluation")
    p.add_argument("what", choices=["data", "train", "eval", "peer"])
    _add_config_args(p, required=False)
    p.add_argument("--steps", type=cli_args.positive_int, default=20)
    p.add_argument("--preset", default=None, help="train: size preset instead of --config (small)")
    p.add_argument("--seq", type=int, default=None, help="train: positions per row (preset)")
    p.add_argument("--arch", default=None, help="train: only these architectures (a,b)")
    p.add_argument(
        "--peer", default="auto", help="peer: auto (nanodo if importable), minimal, nanodo"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_cmd_bench)

    p = sub.add_parser("compile", help="ahead-of-time compile the train step (OOM check)")
    _add_config_args(p, required=False)
    p.add_argument("--spec", default=None, help="a study spec: plan every shape it trains")
    p.add_argument(
        "--topology", default=None, help="TPU: v4:4x4x8, v4-256, v5e-8 (default: local devices)"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_cmd_compile)

    p = sub.add_parser("launch", help="render (and optionally submit) cluster jobs for a study")
    p.add_argument("--spec", required=True)
    p.add_argument("--executor", choices=["slurm", "tpu"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--submit", action="store_true")
    p.set_defaults(fn=_cmd_launch)

    p = sub.add_parser("probe", help="attention-rank and representation-collapse probes")
    p.add_argument("--workdir", required=True)
    p.add_argument(
        "--step",
        type=cli_args.checkpoint_step,
        default=None,
        help="checkpoint step (default: latest)",
    )
    p.add_argument("--out", default=None, help="write the probes to this JSON file instead")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_cmd_probe)

    p = sub.add_parser("vocab", help="train a SentencePiece vocabulary from text files")
    p.add_argument("action", choices=["train"])
    p.add_argument("inputs", nargs="+")
    p.add_argument("--out", required=True, help="output .model path")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.set_defaults(fn=_cmd_vocab)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line as `main` reads it (argparse exits 2 on an error)."""
    parser = build_parser()
    argv = cli_args.attach_negative_values(list(argv))
    # Overrides may follow options (`bench data --config F key=value`), which argparse cannot
    # assign to a second positional by itself.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        status = args.fn(args)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        return cli_args.quiet_broken_pipe()
    except ScalestudyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
