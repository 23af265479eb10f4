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
never looks like a checkpoint. A checkpoint that fails to restore (corrupted files) is moved
to `<workdir>/corrupt_checkpoints/` and the previous one is used, with a warning; nothing is
deleted except by the keep-last-N / keep-every-K policy after a successful save.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import (
    AnyPreservationPolicy,
    EveryNSteps,
    LatestN,
)

from scalestudy.config import ExperimentConfig, ScalestudyError, validate

ITEMS = ("params", "train", "data", "config")
CHECKPOINTS = "checkpoints"
CORRUPT = "corrupt_checkpoints"

# orbax logs every save at INFO through absl; a study saves hundreds of times.
logging.getLogger("absl").setLevel(logging.WARNING)


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
        own = directory / process_file(*process_layout())
        candidates = [own, *sorted(directory.glob("process_0-of-*.json")), directory / "metadata"]
        for path in candidates:
            if path.exists():
                return json.loads(path.read_text())
        raise FileNotFoundError(f"no data state file in {directory} (looked for {own.name})")


@ocp.args.register_with_handler(ProcessJsonHandler, for_save=True)
@dataclasses.dataclass
class ProcessJsonSave(ocp.args.CheckpointArgs):
    item: Any


@ocp.args.register_with_handler(ProcessJsonHandler, for_restore=True)
@dataclasses.dataclass
class ProcessJsonRestore(ocp.args.CheckpointArgs):
    pass


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
        self._manager.save(step, args=args, force=True)

    def wait(self) -> None:
        """Block until pending saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

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
        With `step=None`, a checkpoint that fails to restore is set aside with a warning and
        the previous one is tried.
        """
        candidates = self.all_steps() if step is None else [step]
        if step is not None and step not in self.all_steps():
            raise CheckpointError(
                f"no checkpoint for step {step} in {self.directory}; "
                f"available: {self.all_steps() or 'none'}"
            )
        for s in reversed(candidates):
            try:
                state, data_state = self._restore_step(s, abstract_state)
                return state, data_state, s
            except Exception as e:  # orbax raises many types for unreadable files
                if step is not None:
                    raise CheckpointError(
                        f"checkpoint {self.directory / str(s)} cannot be restored: {e}"
                    ) from e
                moved = self._set_aside(s)
                warnings.warn(
                    f"checkpoint at step {s} cannot be restored ({type(e).__name__}: "
                    f"{str(e)[:200]}); moved it to {moved} and falling back to the previous one",
                    stacklevel=2,
                )
        return None

    def _set_aside(self, step: int) -> Path:
        """Move a bad step directory out of orbax's sight (kept for inspection)."""
        src = self.directory / str(step)
        dst = self.directory.parent / CORRUPT / str(step)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.exists():
            shutil.rmtree(dst)  # an older copy of the same corrupt step
        shutil.move(src, dst)
        self._manager.reload()
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


def restore_params(workdir: Path, step: int | None = None) -> tuple[ExperimentConfig, Any, int]:
    """(config, params, step) from a run directory's checkpoint (default: the latest).

    Parameters land on the first local device; callers re-shard as they need.
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
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
        build_model(cfg.model).abstract_params(),
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
