"""What may change when a run directory is resumed, and the check that refuses the rest.

A run directory belongs to one experiment: its `config.yaml` (or, without it, the config
stored in its newest checkpoint). Re-running `scalestudy train --workdir W` with a config that
differs in anything that changes shapes or semantics (model, objective, data, optimizer,
length, seed, ...) would silently turn it into another experiment, so it is refused with the
differing keys named. Only keys in `SAFE_ON_RESUME` (cadence, stopping point, retention,
evaluation, device layout) may differ; the new values are then what `config.yaml` records.

`config.yaml` is itself checked against the config recorded in the newest checkpoint: a
`config.yaml` edited since (a new learning rate, say) would otherwise change the run as it
resumes, with nothing on the command line to say so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scalestudy.config.errors import ConfigError, ScalestudyError
from scalestudy.config.experiment import ExperimentConfig, load_config
from scalestudy.config.yamlio import flatten
from scalestudy.train.rundir import layout as rundir
from scalestudy.train.rundir import saved_run

# Dotted keys (or prefixes ending in ".") that may change between invocations of one run.
SAFE_ON_RESUME: tuple[str, ...] = (
    "name",
    "train.log_every",
    "train.eval_every",
    "train.checkpoint_every",
    "train.keep_last",
    "train.keep_every",
    "train.async_checkpoint",
    "train.stop_after_steps",
    "train.progress",
    "train.steps_per_call",  # how steps are grouped into calls, not what they compute
    "train.init_from",  # only used before the run has checkpoints of its own
    "train.init_step",
    "eval.",  # evaluation reads the parameters, never changes them
    "mesh.",  # device layout: checkpoints restore onto another mesh
    "model.remat",  # memory only
)


class ResumeConfigError(ScalestudyError):
    """The config given for an existing run directory changes what the run is."""


def _safe(key: str) -> bool:
    return any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_ON_RESUME)


def changed_keys(old: ExperimentConfig, new: ExperimentConfig) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (old value, new value)} for every key that differs and may not change."""
    a, b = flatten(old.model_dump(mode="json")), flatten(new.model_dump(mode="json"))
    return {
        k: (a.get(k), b.get(k))
        for k in sorted(a.keys() | b.keys())
        if a.get(k) != b.get(k) and not _safe(k)
    }


def run_config(workdir: Path) -> ExperimentConfig | None:
    """The config the run in `workdir` was trained with, or None when nothing was trained
    there yet (no checkpoint and no summary)."""
    workdir = Path(workdir)
    latest = saved_run.latest_step(workdir)
    if latest is None and not rundir.summary_path(workdir).exists():
        return None
    resolved = rundir.config_path(workdir)
    if resolved.is_file():
        try:
            return load_config(resolved)
        except ConfigError:
            if latest is None:
                raise
    if latest is None:
        return None
    return saved_run.load_config(workdir, latest)


def check_resume(cfg: ExperimentConfig, workdir: Path) -> None:
    """Raise ResumeConfigError when `workdir` holds a run whose config differs from `cfg`
    in a key that may not change on resume."""
    old = run_config(workdir)
    if old is None:
        return
    changed = changed_keys(old, cfg)
    if not changed:
        _check_recorded(cfg, workdir)
        return
    lines = "\n".join(f"  {k}: {a!r} in the run, {b!r} given" for k, (a, b) in changed.items())
    raise ResumeConfigError(
        f"--workdir {workdir} holds a run trained with a different config; these keys would "
        f"change what the run is, so it is not resumed (nothing was changed):\n{lines}\n"
        f"To resume it, run without those overrides (--workdir alone reads its config.yaml). "
        f"To start a new run, use another --workdir. To branch from its checkpoint with the "
        f"new config, use another --workdir and train.init_from={workdir} "
        f"(train.init_step=N for a given step). Keys that may change on resume: "
        f"{', '.join(s.rstrip('.') + ('.*' if s.endswith('.') else '') for s in SAFE_ON_RESUME)}"
    )


def _check_recorded(cfg: ExperimentConfig, workdir: Path) -> None:
    """Raise ResumeConfigError when the config recorded with the newest checkpoint differs
    from `cfg` (read from `config.yaml`, which agrees with it) in a key that may not change:
    `config.yaml` was edited since that checkpoint was saved."""
    latest = saved_run.latest_step(workdir)
    if latest is None or not rundir.config_path(workdir).is_file():
        return  # without config.yaml, run_config read the checkpoint's config itself
    try:
        recorded = saved_run.load_config(workdir, latest)
    except Exception:  # a damaged checkpoint: restoring finds it, sets it aside or stops
        return
    changed = changed_keys(recorded, cfg)
    if not changed:
        return
    path = rundir.config_path(workdir)
    lines = "\n".join(
        f"  {k}: {a!r} in the checkpoint, {b!r} in {path.name}" for k, (a, b) in changed.items()
    )
    raise ResumeConfigError(
        f"{path} differs from the config recorded in the run's checkpoint of step {latest} "
        f"in keys that would change what the run is (was {path.name} edited?), so it is not "
        f"resumed (nothing was changed):\n{lines}\nTo resume the run as it was trained, put "
        f"the checkpoint's values back into {path.name}. To train with the new values, use "
        f"another --workdir with train.init_from={workdir} (a branch from its checkpoint)."
    )
