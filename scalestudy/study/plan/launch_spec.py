"""Cluster settings of a study spec: the SLURM job array and the TPU VM that `scalestudy launch`
renders (study/run/cluster.py)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, Field

from scalestudy.config.base import Frozen, Tuple
from scalestudy.config.errors import ConfigError

_SLURM_TIME = re.compile(r"^(\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|UNLIMITED|INFINITE)$", re.I)


def _slurm_time(value: Any) -> Any:
    if isinstance(value, str) and not _SLURM_TIME.match(value.strip()):
        raise ConfigError(
            f"slurm.time={value!r} is not a SLURM time limit; accepted: MINUTES, MM:SS, "
            "HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (e.g. 24:00:00 or 2-00:00:00)"
        )
    return value


class SlurmConfig(Frozen):
    """SLURM job-array settings (the job array rendered by study/run/cluster.py)."""

    partition: str | None = None
    account: str | None = None
    time: Annotated[str, AfterValidator(_slurm_time)] = "24:00:00"
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=0)
    cpus_per_task: int = Field(16, ge=1)
    mem: str | None = None
    max_parallel: int | None = Field(None, ge=1)
    # SIGTERM this many seconds before the time limit: the run checkpoints and is requeued.
    signal_seconds: int = Field(120, ge=1)
    setup: Tuple = ()  # shell lines run before training (module load, venv activation, ...)
    scalestudy: str = "scalestudy"  # the command, e.g. /path/.venv/bin/scalestudy


class TpuConfig(Frozen):
    """TPU VM settings for `gcloud compute tpus` (the script rendered by study/run/cluster.py)."""

    name: str = "scalestudy"
    project: str | None = None
    zone: str = "us-central2-b"
    accelerator_type: str = "v4-8"
    runtime_version: str = "tpu-ubuntu2204-base"
    queued: bool = True  # queued resources rather than a directly created TPU VM
    spot: bool = False
    # Give up (non-zero exit) when a queued resource is not ACTIVE after this long.
    queue_timeout_minutes: float = Field(24 * 60, gt=0)
    repo_dir: str = "~/scalestudy"
    setup: Tuple = ()
    scalestudy: str = ".venv/bin/scalestudy"
