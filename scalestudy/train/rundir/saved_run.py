"""Reading a saved run: its checkpoint directory, newest step, stored config and parameters
(what evaluation, attention-rank measures and resume checks need, without training)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax

from scalestudy.config.experiment import ExperimentConfig
from scalestudy.config.yamlio import validate
from scalestudy.train.rundir import layout as rundir
from scalestudy.train.rundir.checkpoint import Checkpointer, CheckpointError


def checkpoint_dir(path: Path) -> Path:
    """The orbax directory for `path`, which may be a run directory or the directory itself."""
    path = Path(path)
    return (
        path
        if path.name == rundir.CHECKPOINTS or not rundir.checkpoints_dir(path).exists()
        else rundir.checkpoints_dir(path)
    )


def latest_step(workdir: Path) -> int | None:
    """The newest checkpointed step of a run directory, or None."""
    directory = checkpoint_dir(workdir)
    if not directory.is_dir():
        return None
    return Checkpointer(directory, read_only=True).latest_step()


def load_config(workdir: Path, step: int) -> ExperimentConfig:
    """The resolved config stored with a checkpoint."""
    directory = checkpoint_dir(workdir)
    raw = Checkpointer(directory, read_only=True).restore_config(step)
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
    manager = Checkpointer(directory, read_only=True)
    if step not in manager.all_steps():  # before its config is read: one line, not orbax's
        raise CheckpointError(
            f"no checkpoint for step {step} in {directory}; available: {manager.all_steps()}"
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
    params = manager.restore_params(step, abstract)
    return cfg, params, step
