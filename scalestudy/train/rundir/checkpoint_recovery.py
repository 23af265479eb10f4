"""Restoring through damage: a checkpoint that cannot be restored is checked on its own, and
only one verified unreadable is set aside so that the previous one can be used.

When a checkpoint fails to restore, `verify` reads its files back on their own (metadata and
every array, on the host): only a checkpoint that is verified unreadable (items missing,
metadata or array files unreadable) is moved to `<workdir>/corrupt_checkpoints/` and the
previous one is tried, with a warning. Any other failure (a state that does not fit, memory,
a transient I/O error) is an error and nothing is moved. When every checkpoint is unreadable
the restore stops with an error instead of starting over. On several processes all of them
restore the step the primary chooses, and set a checkpoint aside only together.
"""

from __future__ import annotations

import errno
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from scalestudy.config.experiment import ExperimentConfig
from scalestudy.train.rundir import layout as rundir
from scalestudy.train.rundir import saved_run
from scalestudy.train.rundir.checkpoint import (
    CHECKSUMS,
    ITEMS,
    Checkpointer,
    CheckpointError,
    checksum_problem,
    data_state_file,
    describe,
    os_error_of,
)
from scalestudy.train.runtime import distributed

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


def restore(
    ckpt: Checkpointer, abstract_state: dict, step: int | None = None
) -> tuple[dict, dict, int] | None:
    """(state, data_state, step) from `step` or the newest good checkpoint; None if none.

    `abstract_state` gives structure, dtypes and shardings (jax.ShapeDtypeStruct leaves).
    With `step=None`, a checkpoint verified unreadable is set aside with a warning (left
    in place when read-only) and the previous one is tried; any other failure raises
    CheckpointError. Every process restores the step the primary chose.
    """
    if step is not None:
        if step not in ckpt.all_steps():
            raise CheckpointError(
                f"no checkpoint for step {step} in {ckpt.directory}; "
                f"available: {ckpt.all_steps() or 'none'}"
            )
        return _restore_agreed(ckpt, step, abstract_state, fall_back=False)
    unreadable = _set_aside_strays(ckpt)
    while True:
        candidates = [s for s in ckpt.all_steps() if s not in unreadable]
        s = distributed.agreed(candidates[-1] if candidates else -1)
        if s < 0:
            break
        out = _restore_agreed(ckpt, s, abstract_state, fall_back=True)
        if out is not None:
            return out
        unreadable.append(s)
    aside = rundir.corrupt_dir(ckpt.directory.parent)
    if unreadable or (not ckpt.read_only and aside.is_dir() and any(aside.iterdir())):
        raise CheckpointError(
            f"no readable checkpoint in {ckpt.directory}: the unreadable ones are in "
            f"{aside if not ckpt.read_only else ckpt.directory} (never deleted). Refusing "
            "to start the run over from step 0; to do so deliberately, delete "
            f"{aside} and {ckpt.directory}"
        )
    return None


def _set_aside_strays(ckpt: Checkpointer) -> list[int]:
    """Steps whose entry in the checkpoint directory is not a directory (a file put where a
    step was): orbax does not list them, so the run would go back to an older checkpoint,
    or to step 0, without a word. Each is moved to `corrupt_checkpoints/` with a warning."""
    primary = distributed.is_primary()
    strays = (
        sorted(int(p.name) for p in ckpt.directory.iterdir() if p.name.isdigit() and not p.is_dir())
        if primary and ckpt.directory.is_dir()
        else []
    )
    if not distributed.agreed(len(strays)) or ckpt.read_only:
        return strays
    for s in strays:
        moved = set_aside(ckpt.directory, s)
        warnings.warn(
            f"{ckpt.directory / str(s)} is not a checkpoint directory (a file or another kind "
            f"of entry was found there); moved it to {moved}; trying the checkpoints before it",
            stacklevel=3,
        )
    distributed.barrier("scalestudy_set_aside_strays")
    ckpt.reload()
    return strays


def _restore_agreed(
    ckpt: Checkpointer, s: int, abstract_state: dict, *, fall_back: bool
) -> tuple[dict, dict, int] | None:
    """Restore step `s` on every process; None (after setting it aside) when it is
    verified unreadable and `fall_back`; CheckpointError otherwise, on every process."""
    error: BaseException | None = None
    primary = distributed.is_primary()
    reason = checksum_problem(ckpt.directory / str(s)) if primary else None
    if not distributed.agreed(int(reason is not None)):
        try:
            state, data_state = ckpt.restore_step(s, abstract_state)
        except Exception as e:  # orbax raises many types; classified below
            error = e
        if distributed.on_all(error is None):
            if distributed.on_all(_finite(state)):
                if primary:
                    _warn_unverified(ckpt.directory, s)
                return state, data_state, s
            reason = "it holds NaN or infinite values"
        elif primary:
            try:
                reason = verify(ckpt.directory, s)
            except Exception as e:  # could not even check: say so, move nothing
                error = error or e
    unreadable = bool(distributed.agreed(int(reason is not None)))
    if unreadable and reason is None:  # the primary checked it; its own line says why
        reason = "process 0 found it damaged"
    if not (unreadable and fall_back):
        cause = describe(error) if error is not None else "it failed on another process"
        what = "is unreadable" if unreadable else "is intact but cannot be restored into this run"
        raise CheckpointError(
            f"checkpoint at step {s} in {ckpt.directory} {what} ({reason or cause}); "
            "nothing was moved or deleted. If the config differs from the one it was "
            "saved with, resume with the run's own config.yaml; if memory or storage ran "
            "out, fix that and run the same command again"
        ) from None
    moved = set_aside(ckpt.directory, s) if primary and not ckpt.read_only else None
    distributed.barrier(f"scalestudy_set_aside_{s}")
    if not ckpt.read_only:
        ckpt.reload()
    warnings.warn(
        f"checkpoint at step {s} cannot be restored: it is unreadable ({reason}); "
        + (f"moved it to {moved}; " if moved else "")
        + "trying the previous one",
        stacklevel=3,
    )
    return None


def _warn_unverified(directory: Path, s: int) -> None:
    """Say that the checkpoint at step `s`, just restored, has no checksums to be checked
    against: what could be checked was (every item read back, every value finite), but a
    changed array or data cursor would not have been seen."""
    if (directory / str(s) / CHECKSUMS).exists():
        return
    warnings.warn(
        f"checkpoint at step {s} in {directory} has no {CHECKSUMS}, so its files could not be "
        "checked against what was saved (it was saved by an older release, cut off before "
        "its checksums were written, or they were deleted); it was restored unverified: "
        "every item read back and every value is finite, but a changed array or data "
        "cursor would not be seen",
        stacklevel=4,
    )


def _finite(state: dict) -> bool:
    """Whether every floating-point value of this process's part of `state` is finite (a
    diverged or damaged state must not be resumed; read shard by shard)."""
    for leaf in jax.tree.leaves(state):
        if jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating):
            for shard in leaf.addressable_shards:
                if not np.isfinite(np.asarray(shard.data)).all():
                    return False
    return True


def verify(directory: Path, step: int) -> str | None:
    """Why the checkpoint at `step` is unreadable, or None when all its files read back.

    Reads every array on the host (memory: one copy of the state on this process).
    Errors that say nothing about the files (permissions, memory, timeouts) propagate.
    """
    d = directory / str(step)
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
            return f"{item}: {describe(e)}"
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
            os_error = os_error_of(e)
            if os_error is not None and os_error.errno in _TRANSIENT_ERRNOS:
                raise
            return f"{item}: {describe(e)}"
    return None


def set_aside(directory: Path, step: int) -> Path:
    """Move a bad step directory out of orbax's sight (kept for inspection)."""
    src = directory / str(step)
    dst = rundir.corrupt_dir(directory.parent) / str(step)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.is_dir() and not dst.is_symlink():
        shutil.rmtree(dst)  # an older copy of the same corrupt step
    elif dst.exists() or dst.is_symlink():
        dst.unlink()
    shutil.move(src, dst)
    return dst


def restore_run(
    cfg: ExperimentConfig, ckpt: Checkpointer, abstract_state: Any
) -> tuple[tuple[Any, dict, int] | None, bool]:
    """((state, saved data dict, step) from this run, else from `train.init_from`, else None;
    whether it came from this run)."""
    restored = restore(ckpt, abstract_state)
    if restored is not None:
        return restored, True
    if cfg.train.init_from is not None:
        source = saved_run.checkpoint_dir(Path(cfg.train.init_from))
        if not source.is_dir():
            raise CheckpointError(
                f"train.init_from={cfg.train.init_from!r}: no checkpoints directory there"
            )
        other = Checkpointer(source, read_only=True)
        restored = restore(other, abstract_state, step=cfg.train.init_step)
        if restored is None:
            raise CheckpointError(f"train.init_from: no checkpoint in {source}")
    return restored, False


def warn_missing_rows(workdir: Path, start: int, expected: int | None) -> None:
    """Say when metrics.jsonl holds fewer training rows up to `start` than were written
    (`expected`, counted in the checkpoint; None for checkpoints that did not count)."""
    have = sum("train/loss" in row for row in rundir.read_metrics(workdir))
    if expected is not None and have < expected:
        warnings.warn(
            f"{rundir.metrics_path(workdir)} lacks {expected - have} of the {expected} "
            f"training rows logged up to step {start} (lost before they reached the disk); "
            f"the run resumes, and the rows after step {start} will be complete",
            stacklevel=2,
        )
