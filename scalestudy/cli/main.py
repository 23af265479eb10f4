"""The `scalestudy` command line: the parser, and `main`, which runs one command.

Each subcommand's handler is `cli_commands.cmd_<name>`; argument types and checks are in
`cli/args.py`. Every `ScalestudyError` is printed as `error: ...` with exit status 2, without a
traceback.
"""

from __future__ import annotations

import os
import signal
import sys


def _stopped_at_once(signum: int, frame: object) -> None:
    """A stop signal while the command's own modules are still importing: one `stopped:`
    line and the signal's exit status (nothing has started that a stop must wind down)."""
    name = signal.Signals(signum).name
    os.write(2, f"stopped: {name} during start-up; nothing was started\n".encode())
    os._exit(128 + signum)


# The command (the console script, or `python -m scalestudy.cli.main`): from its first line, a
# SIGTERM or SIGINT ends it with a `stopped:` line, not by the signal; `main` replaces this
# with the handler that lets a started command wind down (train/runtime/stop_signals.py).
if __name__ == "__main__" or os.path.basename(sys.argv[0]) == "scalestudy":
    for _signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(_signum) is not signal.SIG_IGN:
            signal.signal(_signum, _stopped_at_once)

import argparse  # noqa: E402
from typing import NoReturn  # noqa: E402

from scalestudy.cli import args as cli_args  # noqa: E402
from scalestudy.config.errors import ScalestudyError  # noqa: E402
from scalestudy.train.runtime import stop_signals as stops  # noqa: E402

# The commands' modules are imported when the parser is built, not with this module: the
# command's signal handler is set first, so a Ctrl-C during the imports is answered like
# any other (train/runtime/stop_signals.py).


def _add_config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--config", required=required, help="experiment or model YAML file")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted config overrides")


def _add_step_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--step",
        type=cli_args.checkpoint_step,
        default=None,
        help="checkpoint step (default: latest)",
    )


def _add_run_commands(sub: argparse._SubParsersAction) -> None:
    """Commands on one run: describe, train, eval, harness, compile, attention-rank, experts."""
    # Added in this order, which is the order `scalestudy --help` lists them in.
    _add_train_commands(sub)
    _add_eval_commands(sub)
    _add_compile_command(sub)
    _add_measure_commands(sub)


def _add_train_commands(sub: argparse._SubParsersAction) -> None:
    """describe (counts of a config) and train."""
    from scalestudy.cli import commands

    p = sub.add_parser("describe", help="parameter and FLOP counts of a config (no weights)")
    _add_config_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=commands.cmd_describe)

    p = sub.add_parser("train", help="train one run; resumes from --workdir by default")
    _add_config_args(p, required=False)
    p.add_argument("--workdir", required=True)
    p.add_argument("--eval", action="store_true", help="then evaluate eval.tasks zero-shot")
    p.add_argument(
        "--members",
        nargs="+",
        default=None,
        metavar="KEY=V1,V2",
        help="train every combination as members of one program, each in WORKDIR/<member>",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=commands.cmd_train)


def _add_eval_commands(sub: argparse._SubParsersAction) -> None:
    """eval (the project's own scorer) and harness (lm-eval's command line)."""
    from scalestudy.cli import commands

    p = sub.add_parser("eval", help="zero-shot evaluation of a run's checkpoint")
    p.add_argument("--workdir", required=True)
    p.add_argument("--tasks", nargs="*", default=None, help="task names or task YAML files")
    p.add_argument("--data-dir", default=None, help="directory holding released task files")
    _add_step_arg(p)
    p.add_argument("--max-examples", type=cli_args.positive_int, default=None, help="per task")
    p.add_argument(
        "--num-fewshot",
        type=cli_args.shot_counts,
        default=None,
        metavar="K[,K...]",
        help=(
            "demonstrations before each question, for every task (eval.num_fewshot; "
            "clears eval.num_fewshot_per_task); several: 0,1,2,4,8"
        ),
    )
    p.add_argument("--out", default=None, help="write the scores to this JSON file instead")
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*", metavar="eval.key=value", help="evaluation settings")
    p.set_defaults(fn=commands.cmd_eval)

    p = sub.add_parser(
        "harness",
        help="lm-eval's command line with the model 'scalestudy' (a run directory) registered",
        add_help=False,
    )
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="lm-eval's own arguments")
    p.set_defaults(fn=commands.cmd_harness)


def _add_compile_command(sub: argparse._SubParsersAction) -> None:
    """compile: ahead-of-time plans of the train step."""
    from scalestudy.cli import tool_commands as tools

    p = sub.add_parser("compile", help="ahead-of-time compile the train step (OOM check)")
    _add_config_args(p, required=False)
    p.add_argument("--spec", default=None, help="a study spec: plan every shape it trains")
    p.add_argument(
        "--topology", default=None, help="TPU: v4:4x4x8, v4-256, v5e-8 (default: local devices)"
    )
    p.add_argument(
        "--memory-only",
        action="store_true",
        help="report memory and fit only: no FLOPs or roofline (skips the cost probe compiles)",
    )
    p.add_argument(
        "--search",
        action="store_true",
        help="--topology: rank every data x fsdp x tensor and remat policy by estimated step time "
        "(mesh.AXIS=N or model.remat=P given as overrides are held)",
    )
    p.add_argument(
        "--members",
        type=cli_args.positive_int,
        default=1,
        metavar="K",
        help="plan a group of K runs of the shape as one program (split as mesh.members says)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=tools.cmd_compile)


def _add_measure_commands(sub: argparse._SubParsersAction) -> None:
    """Measures of a checkpoint: attention-rank and experts."""
    from scalestudy.cli import commands

    p = sub.add_parser(
        "attention-rank", help="attention rank and representation collapse of a checkpoint"
    )
    p.add_argument("--workdir", required=True)
    _add_step_arg(p)
    p.add_argument("--out", default=None, help="write the measures to this JSON file instead")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=commands.cmd_attention_rank)

    p = sub.add_parser(
        "experts", help="MoE routing pictures: experts per domain and token, load over training"
    )
    p.add_argument("--workdir", required=True)
    _add_step_arg(p)
    p.add_argument(
        "--out", default=None, help="directory for the figures and JSON (default: WORKDIR/experts)"
    )
    p.add_argument(
        "--tokens",
        nargs="+",
        default=None,
        metavar="TEXT",
        help="strings whose chosen experts are drawn (default: '.' ',' ' the' ' and')",
    )
    p.add_argument(
        "--rows",
        type=cli_args.positive_int,
        default=64,
        help="rows of validation text read (default 64)",
    )
    p.add_argument(
        "--top", type=cli_args.positive_int, default=6, help="tokens shown per expert (default 6)"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=commands.cmd_experts)


def _add_study_commands(sub: argparse._SubParsersAction) -> None:
    """Commands on a study and the stages after pretraining: study, finetune, adapt, launch."""
    from scalestudy.cli import commands

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
    p.add_argument(
        "--stage-run",
        metavar="NAME",
        help="train one stage run (its parent finished); a cluster task",
    )
    p.add_argument("overrides", nargs="*", metavar="key.sub=value")
    p.set_defaults(fn=commands.cmd_study)

    for name, what in (
        ("finetune", "multitask prompted finetuning of a finished run, then held-out zero-shot"),
        ("adapt", "continue a finished run under another objective and/or mask"),
    ):
        p = sub.add_parser(name, help=what)
        p.add_argument("--from", dest="parent", required=True, help="a finished run directory")
        p.add_argument("--out", required=True, help="the new run's directory")
        p.add_argument("--json", action="store_true")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="stage or run keys")
        p.set_defaults(fn=commands.cmd_stage)

    p = sub.add_parser("launch", help="render (and optionally submit) cluster jobs for a study")
    p.add_argument("--spec", required=True)
    p.add_argument("--executor", choices=["slurm", "tpu"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--submit", action="store_true")
    p.set_defaults(fn=commands.cmd_launch)


def _add_results_commands(sub: argparse._SubParsersAction) -> None:
    """Commands on results tables: fit, plot."""
    from scalestudy.cli import commands
    from scalestudy.cli import fit_commands as scaling_command

    p = sub.add_parser("fit", help="fit scaling laws to a study registry or a CSV/JSONL of runs")
    p.add_argument("source", help="registry .sqlite, study directory, .csv/.tsv or .jsonl")
    scaling_command.add_data_args(p)
    scaling_command.add_fit_args(p)
    p.add_argument("--out", default=None, help="write the fit JSON here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=commands.cmd_fit, n_kind=None, d_kind=None)

    p = sub.add_parser("plot", help="figures (PNG + SVG) from a study's results and fits")
    p.add_argument("source", help="registry .sqlite, study directory, .csv/.tsv or .jsonl")
    p.add_argument("--out", required=True, help="directory for the figures")
    p.add_argument("--fits", default=None, help="fit JSON from `scalestudy fit --out`")
    p.add_argument(
        "--bootstrap", type=int, default=0, help="without --fits: resamples for the bands"
    )
    scaling_command.add_data_args(p)
    p.set_defaults(fn=commands.cmd_plot, n_kind=None, d_kind=None)


def _add_tool_commands(sub: argparse._SubParsersAction) -> None:
    """Benchmarks and the vocabulary trainer: bench, vocab."""
    from scalestudy.cli import commands
    from scalestudy.cli import tool_commands as tools

    p = sub.add_parser("bench", help="benchmarks: data pipeline, train step, evaluation")
    p.add_argument("what", choices=["data", "train", "eval", "peer", "gpu"])
    _add_config_args(p, required=False)
    p.add_argument("--steps", type=cli_args.positive_int, default=20)
    p.add_argument("--preset", default=None, help="train: size preset instead of --config (small)")
    p.add_argument("--seq", type=int, default=None, help="train: positions per row (preset)")
    p.add_argument("--arch", default=None, help="train: only these architectures (a,b)")
    p.add_argument(
        "--members",
        type=cli_args.positive_int,
        default=None,
        help="train: K runs as one program against runs alone (step curve and whole runs)",
    )
    p.add_argument("--steps-only", action="store_true", help="train --members: the step curve only")
    p.add_argument(
        "--peer", default="auto", help="peer: auto (nanodo if importable), minimal, nanodo"
    )
    p.add_argument("--profile", default=None, help="peer: also trace both steps into this folder")
    p.add_argument("--out", default=None, help="gpu: append each row to this JSON-lines file")
    p.add_argument(
        "--budget", type=float, default=420.0, help="gpu: start no row after this many seconds"
    )
    p.add_argument("--only", default=None, help="gpu: only rows whose name contains this")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=tools.cmd_bench)

    p = sub.add_parser("vocab", help="train a SentencePiece vocabulary from text files")
    p.add_argument("action", choices=["train"])
    p.add_argument("inputs", nargs="+")
    p.add_argument("--out", required=True, help="output .model path")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.set_defaults(fn=commands.cmd_vocab)


class Parser(argparse.ArgumentParser):
    """argparse with the package's refusal: one `error:` line (what is wrong, where to read
    what is accepted), exit 2, instead of a usage block before argparse's own error line."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    """The `scalestudy` argument parser, one subparser per command (subparsers inherit
    the parser's class, so every command refuses the same way)."""
    parser = Parser(
        prog="scalestudy", description="Architecture x objective scaling studies in JAX/Flax."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run_commands(sub)
    _add_study_commands(sub)
    _add_results_commands(sub)
    _add_tool_commands(sub)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line as `main` reads it (argparse exits 2 on an error)."""
    parser = build_parser()
    if argv[:1] == ["harness"]:  # lm-eval parses its own arguments, handed over unchanged
        args = parser.parse_args(["harness"])
        args.lm_eval_args = list(argv[1:])
        return args
    argv = cli_args.attach_negative_values(list(argv))
    # Overrides may follow options (`bench data --config F key=value`), which argparse cannot
    # assign to a second positional by itself.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(
                _override_form(argv, extra) or f"unrecognized arguments: {' '.join(extra)}"
            )
    return args


def _override_form(argv: list[str], extra: list[str]) -> str | None:
    """For an override written as another tool's flag (`--model.d_model=64`,
    `--model.d_model 64`, `--config.model.d_model=64`): the one form this CLI reads."""
    for item in extra:
        name, eq, value = item.partition("=")
        if not (name.startswith("--") and "." in name):
            continue
        if not eq and item in argv and argv.index(item) + 1 < len(argv):
            value = argv[argv.index(item) + 1]
        key = name[2:].removeprefix("config.")
        given = item if eq else f"{item} {value}".strip()
        return f"{given}: config overrides are written key=value without dashes: {key}={value}"
    return None


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the command itself, not a caller in Python
        stops.catch()  # first: a signal at any moment gets one `stopped:` line
    try:
        if argv is None:  # before TF is imported
            from scalestudy.train.rundir import logfile

            logfile.quiet_terminal()
        args = parse_args(sys.argv[1:] if argv is None else argv)
        cli_args.check_environment()
        status = args.fn(args)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        return cli_args.quiet_broken_pipe()
    except ScalestudyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # raised where JAX first starts, which may be any command's work
        error = cli_args.backend_error(e)
        if error is None:
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (stops.Stopped, KeyboardInterrupt) as e:  # KeyboardInterrupt: a second Ctrl-C
        return _stopped(getattr(e, "signum", signal.SIGINT), argv)
    except Exception:
        # A library that wraps what its callbacks raise (pydantic's JSON serializer turns a
        # Stopped raised inside a field's callback into an error of its own) still ends as a
        # stop once a stop signal came.
        signum = stops.pending()
        if signum is None:
            raise
        return _stopped(signum, argv)


def _stopped(signum: int, argv: list[str] | None) -> int:
    print(f"stopped: {stops.Stopped(signum)}", file=sys.stderr)
    if argv is None:  # the command itself: no interpreter shutdown (see stops.leave)
        stops.leave(128 + signum)
    return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
