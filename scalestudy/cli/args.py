"""Argument types and checks of the `scalestudy` command, run before a handler does any work.

Each turns a mistake in the command line (an empty or wrong kind of path, a step that was never
checkpointed, a flag that does not apply) into one `ScalestudyError` line naming the flag and
what is accepted.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path

from scalestudy.config.errors import ScalestudyError, checked_path


def checkpoint_step(text: str) -> int:
    """argparse type of `--step`: a whole number >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"a checkpoint step (a whole number >= 0); got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type of counts such as `--steps` and `--max-examples`: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1 is accepted; got {text!r}")
    return value


def shot_counts(text: str) -> list[int]:
    """argparse type of `--num-fewshot`: K, or K1,K2,... (demonstrations per prompt, >= 0)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = [-1]
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"a number of demonstrations >= 0, or several joined by commas (0,1,2,4,8); "
            f"got {text!r}"
        )
    if len(set(values)) < len(values):  # the same K scored twice: which was meant?
        twice = next(v for i, v in enumerate(values) if v in values[:i])
        raise argparse.ArgumentTypeError(f"{twice} is given twice in {text!r}; give each K once")
    return values


def output_file(text: str | None, flag: str = "--out") -> Path | None:
    """A results file to be written after the work (`eval --out`): checked before the work,
    so that finished scores are never lost to a path that cannot take them."""
    if text is None:
        return None
    return checked_path(text, flag, "a file", parent_must_exist=True, writable=True)


def output_dir(text: str, flag: str = "--out", *, parent_must_exist: bool = False) -> Path:
    """A directory a command creates or fills (`study`, `launch`, `finetune`, `adapt`,
    `experts`): not empty, not a file, under no file, and writable."""
    return checked_path(
        text, flag, "a directory", parent_must_exist=parent_must_exist, writable=True
    )


def writable_dir(path: Path, what: str) -> None:
    """Raise unless `path` can be created or written: its nearest existing folder is a
    writable directory."""
    checked_path(path, what, "a directory", writable=True)


def run_dir(text: str, *, must_exist: bool) -> Path:
    """--workdir as a Path: not empty, not a file, and (for eval, probe) an existing run."""
    if not str(text).strip():
        raise ScalestudyError("--workdir is empty; give a run directory, e.g. --workdir runs/tiny")
    path = checked_path(text, "--workdir", "a run directory", writable=not must_exist)
    if must_exist and not path.exists():
        raise ScalestudyError(f"--workdir {path}: run directory not found")
    # A folder inside a run (its checkpoints, one step) is not a run: results would land there.
    for inner in (path, path.parent):
        parent = inner.parent
        if inner.name == "checkpoints" and (parent / "config.yaml").is_file():
            raise ScalestudyError(
                f"--workdir {path} is inside the run {parent} (its checkpoints); give the run "
                f"directory itself: --workdir {parent}"
            )
    return path


def check_recorded_config(workdir: Path) -> None:
    """Refuse a run directory whose config.yaml is not a config: training with --config
    would replace it, and the file may be the only record of what the run was."""
    from scalestudy.config.errors import ConfigError
    from scalestudy.config.experiment import load_config
    from scalestudy.train.rundir import layout as rundir

    path = rundir.config_path(workdir)
    if not os.path.lexists(path):
        return
    try:
        load_config(path)
    except ConfigError as e:
        first = str(e).splitlines()[-1].strip()
        raise ScalestudyError(
            f"--workdir {workdir} holds {path.name}, which is not a run's config ({first}); "
            "training would replace it: move it away or mend it, or give another --workdir"
        ) from None


def check_step(workdir: Path, step: int | None) -> None:
    """Raise unless `step` (when given) is a checkpointed step of the run, listing those."""
    if step is None:
        return
    from scalestudy.train.rundir import checkpoint, logfile
    from scalestudy.train.rundir import saved_run as saved

    directory = saved.checkpoint_dir(workdir)
    with logfile.library_logs_dropped():  # orbax's notes on opening them read-only
        steps = checkpoint.Checkpointer(directory, read_only=True).all_steps()
    if step not in steps:
        saved = ", ".join(map(str, steps)) if steps else "none"
        raise ScalestudyError(
            f"--step {step}: {workdir} has no checkpoint at that step; steps saved: {saved} "
            "(leave out --step for the latest)"
        )


def check_data_kinds(args: argparse.Namespace) -> None:
    """--n-kind/--d-kind choose registry columns: refuse them for a table, fill defaults."""
    from scalestudy.study.report.fits import find_registry

    source = Path(args.source)
    given = [f for f, v in (("--n-kind", args.n_kind), ("--d-kind", args.d_kind)) if v]
    if given and source.exists() and find_registry(source) is None:
        raise ScalestudyError(
            f"{' and '.join(given)} only apply to a study registry (they choose which of its "
            f"columns are N and D), not to the table {source}; name the table's columns with "
            "--n-col / --d-col"
        )
    args.n_kind = args.n_kind or "non_embedding"
    args.d_kind = args.d_kind or "positions"


def check_stage_keys(stage: str, overrides: list[str], stage_keys: Iterable[str]) -> None:
    """`finetune` and `adapt` take the stage's own keys (`steps=`, `mixture=`, ...) and the
    run's config keys (`train.log_every=`): refuse any other first key, listing both (the
    config would list only its sections). Keys inside a section are the config's to check."""
    from scalestudy.config.experiment import ExperimentConfig

    own = sorted(stage_keys)
    # a key of both is the stage's (adapt's `objective`: the objective adapted to)
    run = sorted(set(ExperimentConfig.model_fields) - set(own))
    for item in overrides:
        key, sep, _ = item.partition("=")
        top = key.split(".")[0]
        if not sep or not top or top in own or top in run:
            continue  # a malformed override is named as such where overrides are applied
        close = difflib.get_close_matches(top, [*own, *run], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        sections = ", ".join(k if k == "name" else f"{k}.*" for k in run)
        raise ScalestudyError(
            f"{stage}: unknown key {top!r}{hint}; accepted: the {stage} keys {', '.join(own)}; "
            f"or the run's config keys {sections} (e.g. train.log_every=10)"
        )


# A value that starts with "-" and is a number (`--compare-at -1e21`): argparse would take it
# for an option and report the flag's value as missing.
_NEGATIVE_NUMBER = re.compile(r"^-(\d|\.\d)")


def attach_negative_values(argv: list[str]) -> list[str]:
    """`--flag -1e21` -> `--flag=-1e21`, so that the value reaches the flag's own check."""
    out: list[str] = []
    for item in argv:
        prev = out[-1] if out else ""
        if _NEGATIVE_NUMBER.match(item) and prev.startswith("--") and "=" not in prev:
            out[-1] = f"{prev}={item}"
        else:
            out.append(item)
    return out


def quiet_broken_pipe() -> int:
    """The reader of stdout went away (`scalestudy launch ... | head -1`): stop quietly."""
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141  # 128 + SIGPIPE, as a shell reports a pipeline cut short


# XLA's flag for the number of CPU devices (8 fake devices test a mesh on one host).
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


# A flag in XLA_FLAGS: `--name` or `--name=value`; XLA ends the process on anything else.
_XLA_FLAG = re.compile(r"^--[A-Za-z][A-Za-z0-9_]*(=.*)?$")
# Platforms JAX_PLATFORMS may name that need a GPU's device files on this host.
_GPU_PLATFORMS = {"cuda": "/dev/nvidia[0-9]*", "gpu": "/dev/nvidia[0-9]*", "rocm": "/dev/kfd"}


def check_environment(environ: dict[str, str] | None = None) -> None:
    """The environment variables JAX and scalestudy read at start-up, checked before JAX
    starts: a platform this host lacks, XLA flags XLA cannot parse, a device count it cannot
    take, or a compile cache that cannot be written, each refused here by name rather than
    deep inside the backend (or, for the cache, silently switched off)."""
    environ = os.environ if environ is None else environ
    _check_platforms(environ.get("JAX_PLATFORMS", ""))
    for flag in environ.get("XLA_FLAGS", "").split():
        name, _, value = flag.partition("=")
        if not _XLA_FLAG.match(flag):
            raise ScalestudyError(
                f"XLA_FLAGS: {flag!r} is not a flag; XLA takes --name or --name=value "
                "separated by spaces (e.g. --xla_force_host_platform_device_count=8)"
            )
        if name == DEVICE_COUNT_FLAG and not (value.isdecimal() and int(value) >= 1):
            raise ScalestudyError(
                f"XLA_FLAGS: {flag} is not a number of CPU devices; a whole number >= 1 is "
                "accepted (or leave the flag out for one device)"
            )
    if cache := environ.get("SCALESTUDY_JAX_CACHE"):
        checked_path(cache, "SCALESTUDY_JAX_CACHE", "a directory", writable=True)


def _check_platforms(value: str) -> None:
    """Refuse JAX_PLATFORMS naming a TPU or GPU this host has no device files for."""
    import glob

    import scalestudy

    platforms = value.split(",")
    if "tpu" in platforms and not scalestudy.tpu_chip_present():
        raise ScalestudyError(
            f"JAX_PLATFORMS={value!r} asks for a TPU, and this host has none "
            "(no /dev/accel* or /dev/vfio/N); set JAX_PLATFORMS=cpu, or unset it (`compile "
            "--topology` compiles for a TPU without one)"
        )
    for name, files in _GPU_PLATFORMS.items():
        if name in platforms and not glob.glob(files):
            raise ScalestudyError(
                f"JAX_PLATFORMS={value!r} asks for a GPU, and this host has none (no "
                f"{files}); set JAX_PLATFORMS=cpu, or unset it"
            )


def backend_error(e: RuntimeError) -> ScalestudyError | None:
    """The error for a JAX backend that cannot start (JAX_PLATFORMS names a platform this host
    does not have, or none JAX knows), or None for any other RuntimeError."""
    text = str(e)
    if not text.startswith("Unable to initialize backend"):
        return None
    reason = text.split(" (set JAX_PLATFORMS")[0].removeprefix("Unable to initialize backend ")
    chosen = os.environ.get("JAX_PLATFORMS")
    where = f"JAX_PLATFORMS={chosen!r} chose it" if chosen else "no JAX_PLATFORMS was set"
    return ScalestudyError(
        f"cannot start JAX's backend {reason} ({where}); set JAX_PLATFORMS to a platform this "
        "host has (cpu, or cuda/tpu where there is one), or unset it"
    )
