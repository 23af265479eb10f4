"""Checkpoints: everything needed to resume a run exactly, via orbax.

A checkpoint (`<workdir>/checkpoints/<step>/`) holds four items:

- `params`: the parameters (restorable alone, for evaluation);
- `train`: the rest of the train state (step, optimizer state, RNG key);
- `data`: the data iterator state of every process, one JSON file each
  (`process_<i>-of-<n>.json`, from `BatchIterator.state()` and the loop's totals): each
  process streams its own shard and restores its own state;
- `config`: the resolved `ExperimentConfig` (JSON).

Saves are asynchronous (the device-to-host copy blocks, the writing does not) and atomic:
orbax writes into a temporary directory and renames it when complete, so an interrupted save
never looks like a checkpoint. A save that fails (disk full, unwritable directory) raises
`CheckpointWriteError` naming the step and the cause at that save, or for an asynchronous
save at the next `poll()`/`wait()`, i.e. the next step boundary.

When a checkpoint fails to restore, `verify` reads its files back on their own (metadata and
every array, on the host): only a checkpoint that is verified unreadable (items missing,
metadata or array files unreadable) is moved to `<workdir>/corrupt_checkpoints/` and the
previous one is tried, with a warning. Any other failure (a state that does not fit, memory,
a transient I/O error) is an error and nothing is moved. When every checkpoint is unreadable
the restore stops with an error instead of starting over. On several processes all of them
restore the step the primary chooses, and set a checkpoint aside only together. Nothing is
deleted except by the keep-last-N / keep-every-K policy after a successful save.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint.checkpoint_managers import (
    AnyPreservationPolicy,
    EveryNSteps,
    LatestN,
)

from scalestudy.config import ExperimentConfig
from scalestudy.errors import ScalestudyError
from scalestudy.yamlio import validate

ITEMS = ("params", "train", "data", "config")
CHECKPOINTS = "checkpoints"
CORRUPT = "corrupt_checkpoints"


class CheckpointError(ScalestudyError):
    """No usable checkpoint where one was expected."""


def process_layout() -> tuple[int, int]:
    """(this process's index, number of processes)."""
    return jax.process_index(), jax.process_count()


def process_file(index: int, count: int) -> str:
    """The name of process `index`'s data state file in a checkpoint of `count` processes."""
    return f"process_{index}-of-{count}.json"


class ProcessJsonHandler(ocp.JsonCheckpointHandler):
    """A JSON item written by every process into its own file (orbax's JSON item is written
    by the primary host only). Restore reads this process's file; a checkpoint of another
    process count gives process 0's state (the iterator says whether it fits), and one of an
    older release its single file."""

    async def _save_fn(self, x: Any, directory: Any) -> None:
        path = directory / process_file(*process_layout())
        path.write_text(json.dumps(x))

    def restore(self, directory: Any, item: Any = None, args: Any = None) -> Any:
        return json.loads(data_state_file(directory).read_text())


def data_state_file(directory: Any) -> Any:
    """The file of a checkpoint's `data` item that this process restores (see
    ProcessJsonHandler); FileNotFoundError when there is none."""
    own = directory / process_file(*process_layout())
    candidates = [own, *sorted(directory.glob("process_0-of-*.json")), directory / "metadata"]
    for path in candidates:
        if path.exists():
            return path
    raise FileNotFoundError(
        errno.ENOENT, f"no data state file in {directory} (looked for {own.name})"
    )


@ocp.args.register_with_handler(ProcessJsonHandler, for_save=True)
@dataclasses.dataclass
class ProcessJsonSave(ocp.args.CheckpointArgs):
    item: Any


@ocp.args.register_with_handler(ProcessJsonHandler, for_restore=True)
@dataclasses.dataclass
class ProcessJsonRestore(ocp.args.CheckpointArgs):
    pass


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (disk full, unwritable directory)."""


# Errors that say nothing about the files themselves: never a reason to set a checkpoint aside.
_TRANSIENT_ERRNOS = {
    errno.EACCES,
    errno.EPERM,
    errno.ENOMEM,
    errno.EAGAIN,
    errno.EINTR,
    errno.ETIMEDOUT,
    errno.EMFILE,
    errno.ENFILE,
    errno.EBUSY,
}


def _os_error(e: BaseException | None) -> OSError | None:
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


def _describe(e: BaseException) -> str:
    """One line for an exception: the OSError's text when there is one, else type and start."""
    os_error = _os_error(e)
    if os_error is not None:
        return str(os_error)
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


def _agreed(value: int) -> int:
    """The primary process's `value`, on every process."""
    if jax.process_count() == 1:
        return value
    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def _all(flag: bool) -> bool:
    """Whether `flag` holds on every process."""
    if jax.process_count() == 1:
        return flag
    return bool(np.all(multihost_utils.process_allgather(np.int32(flag))))


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def checkpoint_dir(path: Path) -> Path:
    """The orbax directory for `path`, which may be a run directory or the directory itself."""
    path = Path(path)
    return (
        path
        if path.name == CHECKPOINTS or not (path / CHECKPOINTS).exists()
        else path / CHECKPOINTS
    )


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
        options = ocp.CheckpointManagerOptions(
            preservation_policy=AnyPreservationPolicy(policies),
            enable_async_checkpointing=async_save,
            create=not read_only,
            read_only=read_only,
            cleanup_tmp_directories=not read_only,
        )
        self.read_only = read_only
        self._pending: int | None = None  # step of a save not yet checked for errors
        self._failed: int | None = None  # step whose save failed (reported once)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: dict, data_state: dict, cfg: ExperimentConfig) -> None:
        """Start saving `state` (a dict with "params" and the rest) at `step`; every process
        calls this with its own `data_state`."""
        rest = {k: v for k, v in state.items() if k != "params"}
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(state["params"]),
            train=ocp.args.StandardSave(rest),
            data=ProcessJsonSave(data_state),
            config=ocp.args.JsonSave(cfg.model_dump(mode="json")),
        )
        self.wait()  # orbax waits for the previous save anyway; its error names its step
        self._pending = step
        with self._write_errors(step):
            self._manager.save(step, args=args, force=True)

    def poll(self) -> None:
        """Raise CheckpointWriteError if the last asynchronous save has failed (cheap: only
        looks when orbax says the save is over)."""
        if self._pending is not None and not self._manager.is_saving_in_progress():
            self.wait()  # returns at once; raises what the background save raised

    def wait(self) -> None:
        """Block until pending saves are on disk."""
        with self._write_errors(self._pending):
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        self._pending = None

    def close(self) -> None:
        try:
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
            if _os_error(e) is None:
                raise
            self._pending = None
            if self._failed is not None:  # already reported; later saves fail alike
                raise CheckpointWriteError(
                    f"checkpoint saving failed at step {self._failed}"
                ) from None
            self._failed = step
            try:
                self._manager.reload()
                kept = self.all_steps()
            except Exception:
                kept = []
            raise CheckpointWriteError(
                f"cannot write the checkpoint of step {step} to {self.directory}: "
                f"{_describe(e)}. Earlier checkpoints are intact "
                f"(steps {kept or 'none'}); free space or fix permissions, then run the same "
                "command again to resume"
            ) from None

    def _restore_step(self, step: int, abstract_state: dict) -> tuple[dict, dict]:
        rest = {k: v for k, v in abstract_state.items() if k != "params"}
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(abstract_state["params"]),
                train=ocp.args.StandardRestore(rest),
                data=ProcessJsonRestore(),
            ),
        )
        return {"params": out["params"], **out["train"]}, out["data"]

    def restore(
        self, abstract_state: dict, step: int | None = None
    ) -> tuple[dict, dict, int] | None:
        """(state, data_state, step) from `step` or the newest good checkpoint; None if none.

        `abstract_state` gives structure, dtypes and shardings (jax.ShapeDtypeStruct leaves).
        With `step=None`, a checkpoint verified unreadable is set aside with a warning (left
        in place when read-only) and the previous one is tried; any other failure raises
        CheckpointError. Every process restores the step the primary chose.
        """
        if step is not None:
            if step not in self.all_steps():
                raise CheckpointError(
                    f"no checkpoint for step {step} in {self.directory}; "
                    f"available: {self.all_steps() or 'none'}"
                )
            return self._restore_agreed(step, abstract_state, fall_back=False)
        unreadable: list[int] = []
        while True:
            candidates = [s for s in self.all_steps() if s not in unreadable]
            s = _agreed(candidates[-1] if candidates else -1)
            if s < 0:
                break
            out = self._restore_agreed(s, abstract_state, fall_back=True)
            if out is not None:
                return out
            unreadable.append(s)
        aside = self.directory.parent / CORRUPT
        if unreadable or (not self.read_only and aside.is_dir() and any(aside.iterdir())):
            raise CheckpointError(
                f"no readable checkpoint in {self.directory}: the unreadable ones are in "
                f"{aside if not self.read_only else self.directory} (never deleted). Refusing "
                "to start the run over from step 0; to do so deliberately, delete "
                f"{aside} and {self.directory}"
            )
        return None

    def _restore_agreed(
        self, s: int, abstract_state: dict, *, fall_back: bool
    ) -> tuple[dict, dict, int] | None:
        """Restore step `s` on every process; None (after setting it aside) when it is
        verified unreadable and `fall_back`; CheckpointError otherwise, on every process."""
        error: BaseException | None = None
        try:
            state, data_state = self._restore_step(s, abstract_state)
        except Exception as e:  # orbax raises many types; classified below
            error = e
        if _all(error is None):
            return state, data_state, s
        primary = jax.process_index() == 0
        reason = None
        if primary:
            try:
                reason = self.verify(s)
            except Exception as e:  # could not even check: say so, move nothing
                error = error or e
        unreadable = bool(_agreed(int(reason is not None)))
        if not (unreadable and fall_back):
            cause = _describe(error) if error is not None else "it failed on another process"
            what = (
                "is unreadable" if unreadable else "is intact but cannot be restored into this run"
            )
            raise CheckpointError(
                f"checkpoint at step {s} in {self.directory} {what} ({reason or cause}); "
                "nothing was moved or deleted. If the config differs from the one it was "
                "saved with, resume with the run's own config.yaml; if memory or storage ran "
                "out, fix that and run the same command again"
            ) from None
        moved = self._set_aside(s) if primary and not self.read_only else None
        _barrier(f"scalestudy_set_aside_{s}")
        if not self.read_only:
            self._manager.reload()
        warnings.warn(
            f"checkpoint at step {s} cannot be restored: it is unreadable ({reason}); "
            + (f"moved it to {moved}; " if moved else "")
            + "trying the previous one",
            stacklevel=3,
        )
        return None

    def verify(self, step: int) -> str | None:
        """Why the checkpoint at `step` is unreadable, or None when all its files read back.

        Reads every array on the host (memory: one copy of the state on this process).
        Errors that say nothing about the files (permissions, memory, timeouts) propagate.
        """
        d = self.directory / str(step)
        missing = [i for i in ITEMS if not (d / i).is_dir()]
        if missing:
            return f"items missing: {', '.join(missing)}"
        for item in ("data", "config"):
            try:
                path = data_state_file(d / item) if item == "data" else d / item / "metadata"
                json.loads(path.read_text())
            except (OSError, ValueError) as e:
                if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
                    raise
                return f"{item}: {_describe(e)}"
        checkpointer = ocp.PyTreeCheckpointer()
        for item in ("params", "train"):
            try:
                tree = checkpointer.metadata(d / item).item_metadata.tree
                if tree is None:
                    return f"{item}: metadata unreadable"
                target = jax.tree.map(
                    lambda m: np.empty(m.shape, m.dtype),
                    tree,
                    is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"),
                )
                checkpointer.restore(
                    d / item,
                    args=ocp.args.PyTreeRestore(
                        item=target,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                    ),
                )
            except MemoryError:
                raise
            except Exception as e:
                os_error = _os_error(e)
                if os_error is not None and os_error.errno in _TRANSIENT_ERRNOS:
                    raise
                return f"{item}: {_describe(e)}"
        return None

    def _set_aside(self, step: int) -> Path:
        """Move a bad step directory out of orbax's sight (kept for inspection)."""
        src = self.directory / str(step)
        dst = self.directory.parent / CORRUPT / str(step)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.exists():
            shutil.rmtree(dst)  # an older copy of the same corrupt step
        shutil.move(src, dst)
        return dst


def latest_step(workdir: Path) -> int | None:
    """The newest checkpointed step of a run directory, or None."""
    directory = checkpoint_dir(workdir)
    if not directory.is_dir():
        return None
    return Checkpointer(directory, read_only=True).latest_step()


def load_config(workdir: Path, step: int) -> ExperimentConfig:
    """The resolved config stored with a checkpoint."""
    directory = checkpoint_dir(workdir)
    manager = ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(read_only=True), item_names=ITEMS
    )
    raw = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
    return validate(ExperimentConfig, raw, f"{directory / str(step)}/config")


def restore_params(
    workdir: Path, step: int | None = None, *, on_run_mesh: bool = False
) -> tuple[ExperimentConfig, Any, int]:
    """(config, params, step) from a run directory's checkpoint (default: the latest).

    Parameters land on the first local device, or with `on_run_mesh` straight into the
    run's parameter shardings on the mesh its config describes (as training placed them;
    each device reads only its own shards).
    """
    from scalestudy.models.api import build_model

    directory = checkpoint_dir(workdir)
    if step is None:
        step = latest_step(directory)
        if step is None:
            raise CheckpointError(
                f"no checkpoint in {directory}; train first (`scalestudy train --workdir ...`)"
            )
    cfg = load_config(directory, step)
    model = build_model(cfg.model)
    if on_run_mesh:
        from scalestudy.train import sharding

        mesh = sharding.make_mesh(cfg.mesh, model=cfg.model)
        placement = sharding.param_shardings(mesh, model.param_axes())
    else:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        placement = jax.tree.map(lambda _: device, model.abstract_params())
    abstract = jax.tree.map(
        lambda a, where: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where),
        model.abstract_params(),
        placement,
    )
    manager = Checkpointer(directory, read_only=True)
    if step not in manager.all_steps():
        raise CheckpointError(
            f"no checkpoint for step {step} in {directory}; available: {manager.all_steps()}"
        )
    params = manager._manager.restore(
        step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract))
    )["params"]
    return cfg, params, step
