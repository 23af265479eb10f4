"""Checkpoints: everything needed to resume a run exactly, via orbax.

A checkpoint (`<workdir>/checkpoints/<step>/`) holds these items, each with one of orbax's
own handlers, so that plain `ocp.CheckpointManager(dir).restore(step)` reads all of them
without this package:

- `params`: the parameters (restorable alone, for evaluation; StandardCheckpointHandler);
- `train`: the rest of the train state (step, optimizer state, RNG key; the same handler);
- `data`: the data iterator state of process 0 (JsonCheckpointHandler, from
  `BatchIterator.state()` and the loop's totals); on several processes, one more JSON item
  per process, `data_process_<i>-of-<n>`, written by that process: each process streams its
  own shard and restores its own state;
- `config`: the resolved `ExperimentConfig` (JsonCheckpointHandler).

Checkpoints of older releases (one `data` item of `process_<i>-of-<n>.json` files, written
by a handler of this package) still resume here; plain orbax cannot read their `data`.

Saves are asynchronous (the device-to-host copy blocks, the writing does not) and atomic:
orbax writes into a temporary directory and renames it when complete, so an interrupted save
never looks like a checkpoint. Each save has a directory of its own for that
(`.save-<step>-<token>-<n>`, see train/rundir/checkpoint_writers.py), never the one of an earlier
save of the same step. A save that fails (disk full, unwritable directory) raises
`CheckpointWriteError` naming the step and the cause at that save, or for an asynchronous
save at the next `poll()`/`wait()`, i.e. the next step boundary. Before it raises, the failed
save is over: orbax's writer threads are joined, no file of it is open, and its directory is
sealed (replaced by an empty file), so that the writes tensorstore still holds for it (orbax
no longer awaits them) can only fail. The same process can resume, remount or exit at once.

Restoring through damage is train/rundir/checkpoint_recovery.py; reading a finished run (its config,
its parameters) is train/rundir/saved_run.py. Nothing is deleted except by the keep-last-N /
keep-every-K policy after a successful save.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import random
import re
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import (
    AnyPreservationPolicy,
    EveryNSteps,
    LatestN,
)

from scalestudy.config.errors import ScalestudyError
from scalestudy.config.experiment import ExperimentConfig
from scalestudy.train.rundir import checkpoint_writers
from scalestudy.train.runtime import distributed

ITEMS = ("params", "train", "data", "config")
# Written into each step directory once its save is complete: sha256 of every file in it.
CHECKSUMS = "checksums.json"


class CheckpointError(ScalestudyError):
    """No usable checkpoint where one was expected."""


def process_file(index: int, count: int) -> str:
    """The name of process `index`'s data state file in a `data` item of an older release
    (one file per process inside `data/`, written by a handler of this package)."""
    return f"process_{index}-of-{count}.json"


def data_item(index: int, count: int) -> str:
    """The checkpoint item holding process `index`'s data state (of `count` processes):
    `data` for process 0, `data_process_<i>-of-<n>` for the others."""
    return "data" if index == 0 else f"data_process_{index}-of-{count}"


def data_handlers() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """orbax's handlers for the data items of this process layout: orbax's own JSON handler
    for each, with the process whose state it holds as its writer (orbax writes a JSON item
    from one process only), so plain orbax restores every item without this package."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    _, count = distributed.process_layout()
    for index in range(count):
        options = ocp.options.MultiprocessingOptions(primary_host=index)
        handler = ocp.JsonCheckpointHandler(multiprocessing_options=options)
        registry.add(data_item(index, count), ocp.args.JsonSave, handler)
        registry.add(data_item(index, count), ocp.args.JsonRestore, handler)
    return registry


def data_state_file(directory: Any) -> Any:
    """The file holding the data state this process restores, given a checkpoint step's
    `data` item directory: its own item's; with another process count, process 0's (the
    iterator says whether it fits); in a checkpoint of an older release, the matching file
    of its one `data` item. FileNotFoundError when there is none."""
    index, count = distributed.process_layout()
    own = directory.parent / data_item(index, count) / "metadata"
    candidates = [
        own,
        directory / process_file(index, count),
        directory / "metadata",
        *sorted(directory.glob("process_0-of-*.json")),
    ]
    for path in candidates:
        if path.exists():
            return path
    raise FileNotFoundError(errno.ENOENT, f"no data state file in {directory} (looked for {own})")


def file_checksums(step_dir: Path) -> dict[str, str]:
    """{path relative to `step_dir`: sha256} of every file of a checkpoint step."""
    out = {}
    for path in sorted(step_dir.rglob("*")):
        if path.is_file() and path.name not in (CHECKSUMS, CHECKSUMS + ".tmp"):
            with path.open("rb") as f:
                out[str(path.relative_to(step_dir))] = hashlib.file_digest(f, "sha256").hexdigest()
    return out


def write_checksums(step_dir: Path) -> None:
    """Record the checksums of a complete checkpoint step (atomically, fsync'd)."""
    tmp = step_dir / (CHECKSUMS + ".tmp")
    with tmp.open("w") as f:
        json.dump(file_checksums(step_dir), f, indent=0, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(step_dir / CHECKSUMS)


def checksum_problem(step_dir: Path) -> str | None:
    """Why the files of a checkpoint step differ from the checksums saved with it, or None
    (also when it has no checksums: saved by an older release, or cut off before they were
    written)."""
    try:
        want = json.loads((step_dir / CHECKSUMS).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return f"{CHECKSUMS} unreadable: {e}"
    have = file_checksums(step_dir)
    changed = sorted(k for k in want if have.get(k) != want[k])
    if not changed:
        return None
    shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
    return f"files differ from the checksums saved with it: {shown}"


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (disk full, unwritable directory)."""


def os_error_of(e: BaseException | None) -> OSError | None:
    """The OSError behind `e` (itself, or its cause/context chain), if any; tensorstore (which
    writes the arrays) reports one as a ValueError ending in `[os_error_code='28']`."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        code = re.search(r"os_error_code='?(\d+)", str(e))
        if code:
            return OSError(int(code.group(1)), os.strerror(int(code.group(1))))
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


class _NoOrbaxTracebacks(logging.Filter):
    """Drop orbax's error logs with tracebacks (background save threads log them before the
    error is raised here): CheckpointWriteError reports the failure in one line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


# orbax logs every save at INFO through absl; a study saves hundreds of times.
logging.getLogger("absl").setLevel(logging.WARNING)
logging.getLogger("absl").addFilter(_NoOrbaxTracebacks())

# orbax divides each replicated array's writing between the replicas ("replica-parallel"):
# one device slice per replica and array, each an operation dispatched on its own. That pays
# for large arrays on many hosts, but a small model's state on a few devices then costs
# thousands of dispatches a save, most of a tiny run's save time
# (docs/testing.md#how-long-it-takes). Below this many bytes per replica's slice, one replica
# writes the array whole, as orbax does without replicas; the arrays written are the same.
REPLICA_PARALLEL_MIN_BYTES = 1 << 20
logging.getLogger("absl").setLevel(logging.ERROR)  # orbax warns of the override it is asked
ocp.type_handlers.register_type_handler(
    jax.Array,
    ocp.type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_BYTES),
    override=True,
)
logging.getLogger("absl").setLevel(logging.WARNING)


def describe(e: BaseException) -> str:
    """One line for an exception: the OSError's text when there is one, else type and start."""
    os_error = os_error_of(e)
    if os_error is not None:
        return str(os_error)
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


class Checkpointer:
    """Saves and restores train states of one run (a thin layer over orbax's manager)."""

    def __init__(
        self,
        directory: Path,
        *,
        keep_last: int = 2,
        keep_every: int | None = None,
        async_save: bool = True,
        read_only: bool = False,
    ):
        self.directory = Path(directory).absolute()
        policies: list[Any] = [LatestN(keep_last)]
        if keep_every is not None:
            policies.append(EveryNSteps(keep_every))
        # {str(final step directory): the directory its save writes in}, for orbax's
        # temporary paths; `_token` and `_saves` name those directories.
        self._save_dirs: dict[str, Path] = {}
        self._token: int | None = None
        self._saves = 0
        options = ocp.CheckpointManagerOptions(
            preservation_policy=AnyPreservationPolicy(policies),
            enable_async_checkpointing=async_save,
            create=not read_only,
            read_only=read_only,
            cleanup_tmp_directories=not read_only,
            temporary_path_class=(
                None if read_only else checkpoint_writers.save_path_class(self._save_dirs)
            ),
        )
        self.read_only = read_only
        self._pending: int | None = None  # step of a save not yet checked for errors
        self._failed: int | None = None  # step whose save failed (reported once)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, handler_registry=data_handlers()
        )
        if not read_only:
            checkpoint_writers.remove_stale_saves(self.directory)

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: dict, data_state: dict, cfg: ExperimentConfig) -> None:
        """Start saving `state` (a dict with "params" and the rest) at `step`; every process
        calls this with its own `data_state`."""
        rest = {k: v for k, v in state.items() if k != "params"}
        index, count = distributed.process_layout()
        # Every process names every item; each data item is written by its own process
        # only, so the others' placeholders are never written.
        data = {
            data_item(i, count): ocp.args.JsonSave(data_state if i == index else {})
            for i in range(count)
        }
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(state["params"]),
            train=ocp.args.StandardSave(rest),
            config=ocp.args.JsonSave(cfg.model_dump(mode="json")),
            **data,
        )
        self.wait()  # orbax waits for the previous save anyway; its error names its step
        self._pending = step
        self._save_dirs[str(self.directory / str(step))] = self._new_save_dir(step)
        with self._write_errors(step):
            self._manager.save(step, args=args, force=True)

    def _new_save_dir(self, step: int) -> Path:
        """The directory the next save (of `step`) writes in: named alike on every process
        (every process saves, in the same order), and by no earlier save of this directory."""
        if self._token is None:
            self._token = distributed.agreed(random.getrandbits(31))
        self._saves += 1
        save_dir = self.directory / checkpoint_writers.save_dir_name(step, self._token, self._saves)
        checkpoint_writers.claim(save_dir)
        return save_dir

    def poll(self) -> None:
        """Raise CheckpointWriteError if the last asynchronous save has failed (cheap: only
        looks when orbax says the save is over)."""
        if self._pending is not None and not self._manager.is_saving_in_progress():
            self.wait()  # returns at once; raises what the background save raised

    def wait(self) -> None:
        """Block until pending saves are on disk, then record their checksums."""
        with self._write_errors(self._pending):
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
            if self._pending is not None and distributed.is_primary() and not self.read_only:
                write_checksums(self.directory / str(self._pending))
        if self._pending is not None:
            save_dir = self._save_dirs.pop(str(self.directory / str(self._pending)), None)
            if save_dir is not None:
                checkpoint_writers.release(save_dir)
        self._pending = None

    def close(self) -> None:
        try:
            self.wait()
            with self._write_errors(self._pending):
                self._manager.close()
        except CheckpointError:
            if self._failed is None:
                raise

    @contextlib.contextmanager
    def _write_errors(self, step: int | None) -> Any:
        """Turn a failed write into one CheckpointWriteError naming step, cause and the
        checkpoints still intact (an error without an OSError behind it is a bug: re-raised)."""
        try:
            yield
        except Exception as e:
            if os_error_of(e) is None:
                raise
            self._pending = None
            if self._failed is not None:  # already reported; later saves fail alike
                raise CheckpointWriteError(
                    f"checkpoint saving failed at step {self._failed}"
                ) from None
            self._failed = step
            with contextlib.suppress(Exception):  # orbax re-raises the failure it already gave
                self._manager.wait_until_finished()
            save_dir = (
                None if step is None else self._save_dirs.get(str(self.directory / str(step)))
            )
            checkpoint_writers.settle_failed_save(self.directory, save_dir, step)
            try:
                self._manager.reload()
                steps = self.all_steps()
            except Exception:
                steps = []
            # orbax may have finished the step before what failed (its checksums): on disk,
            # it is listed, but it is the failed save, not an intact one.
            kept = [s for s in steps if s != step]
            unverified = (
                f"; step {step}'s files were written without their checksums, so a resume "
                "from it is not verified"
                if step in steps
                else ""
            )
            raise CheckpointWriteError(
                f"cannot write the checkpoint of step {step} to {self.directory}: "
                f"{describe(e)}. Earlier checkpoints are intact "
                f"(steps {kept or 'none'}){unverified}; free space or fix permissions, then run "
                "the same command again to resume"
            ) from None

    def reload(self) -> None:
        """Re-read the list of steps from disk (after a checkpoint was moved away)."""
        self._manager.reload()

    def restore_step(self, step: int, abstract_state: dict) -> tuple[dict, dict]:
        """(state, data_state) of the checkpoint at `step`, shaped and placed like
        `abstract_state` (jax.ShapeDtypeStruct leaves); orbax's error when it fails."""
        rest = {k: v for k, v in abstract_state.items() if k != "params"}
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(abstract_state["params"]),
                train=ocp.args.StandardRestore(rest),
            ),
        )
        # Read as orbax's JSON handler reads it, from whichever item or older file holds
        # this process's state (see data_state_file).
        data = json.loads(data_state_file(self.directory / str(step) / "data").read_text())
        return {"params": out["params"], **out["train"]}, data

    def restore_params(self, step: int, abstract_params: Any) -> Any:
        """Only the parameters of the checkpoint at `step`."""
        args = ocp.args.Composite(params=ocp.args.StandardRestore(abstract_params))
        return self._manager.restore(step, args=args)["params"]

    def restore_config(self, step: int) -> dict:
        """The config stored with the checkpoint at `step`, as saved (JSON)."""
        args = ocp.args.Composite(config=ocp.args.JsonRestore())
        return self._manager.restore(step, args=args)["config"]
