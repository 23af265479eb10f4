"""Members: K runs of one shape trained as one compiled program.

The runs of a group share everything that decides the program (architecture, objective,
sizes, lengths, batch, mesh, optimizer kind, schedule shape, steps and cadence). They may
differ in the keys of `MEMBER_KEYS`: the seeds (initialisation and data order) and the
numbers of the optimizer and its schedule. The group's program is the single run's train
step over a leading member axis of the train state, the batches and the differing numbers
(which the step receives as traced scalars), vmapped or looped. A member's slice of the state
has the structure of a run's state, so its checkpoints are those of a run trained alone and
either can resume the other; the numbers are the same bit for bit only in the same program
(a member resumes exactly inside its own group: train/loop.py).

The compiled program is train/program.py; the loop that trains a group, with one run
directory per member, is train/loop.py (a run alone is a group of one).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import ExperimentConfig
from scalestudy.config.yamlio import flatten

# Keys that members may differ in. `name` is the run's own; the seeds change the numbers of
# the initial state and the data order, not the program; the optimizer's numbers enter the
# step as traced scalars.
SEED_KEYS = ("train.seed", "data.seed")
OPTIM_KEYS = (
    "optim.learning_rate",
    "optim.warmup_steps",
    "optim.weight_decay",
    "optim.final_lr_fraction",
    "optim.b1",
    "optim.b2",
    "optim.eps",
    "optim.grad_clip_norm",
    "optim.cooldown_fraction",
    "optim.cooldown_steps",
    "optim.decay_rate",
    "optim.clipping_threshold",
)
MEMBER_KEYS = ("name", *SEED_KEYS, *OPTIM_KEYS)
_INT_KEYS = ("optim.warmup_steps", "optim.cooldown_steps")


def flat_config(cfg: ExperimentConfig) -> dict[str, Any]:
    """{dotted key: value} of a resolved config."""
    return flatten(cfg.model_dump(mode="json"))


def differences(cfgs: Sequence[ExperimentConfig]) -> dict[str, list[Any]]:
    """{dotted key: each member's value} for every key the configs do not share."""
    flats = [flat_config(c) for c in cfgs]
    keys = sorted(set().union(*flats))
    return {
        k: [f.get(k) for f in flats]
        for k in keys
        if any(f.get(k) != flats[0].get(k) for f in flats)
    }


def program_key(cfg: ExperimentConfig) -> str:
    """What a run shares with every member of its group: its config less the member keys
    (with adafactor, weight decay stays: it decides that optimizer's structure)."""
    free = set(MEMBER_KEYS)
    if cfg.optim.name == "adafactor":
        free.discard("optim.weight_decay")
    return json.dumps({k: v for k, v in flat_config(cfg).items() if k not in free}, sort_keys=True)


def program_difference(cfgs: Sequence[ExperimentConfig]) -> str | None:
    """Why these configs cannot train as members of one program (one line naming the
    first key), or None when they can."""
    for key, values in differences(cfgs).items():
        if key not in MEMBER_KEYS:
            return (
                f"{key} differs between members ({_values(values)}); members may differ only "
                f"in {', '.join(k for k in MEMBER_KEYS if k != 'name')}"
            )
        if None in values:  # e.g. clipping on for some members, off for others
            return (
                f"{key} is None for some members and set for others ({_values(values)}): "
                "that changes the program; give every member a value, or none"
            )
        if key == "optim.weight_decay" and cfgs[0].optim.name == "adafactor":
            return (
                "optim.weight_decay differs between adafactor members: with adafactor it "
                "decides the optimizer's structure; train those runs as separate groups"
            )
    return None


def check_group(cfgs: Sequence[ExperimentConfig]) -> None:
    """Raise ConfigError unless `cfgs` (at least one) can train as one group."""
    if not cfgs:
        raise ConfigError("a group needs at least one member; the member grid is empty")
    why = program_difference(cfgs)
    if why is not None:
        raise ConfigError(why)
    # Members may share a name (a learning-rate search trains one run of a study at several
    # rates); their run directories tell them apart, and no two may be the same run.
    hashes = [c.model_copy(update={"name": ""}).hash() for c in cfgs]
    if len(set(hashes)) < len(hashes):
        raise ConfigError(
            "two members have the same config (they would train the same run twice); "
            "give each member its own seed or optimizer setting"
        )


def _values(values: list[Any], most: int = 4) -> str:
    shown = ", ".join(repr(v) for v in values[:most])
    return shown + (", ..." if len(values) > most else "")


def hyperparameters(cfgs: Sequence[ExperimentConfig]) -> dict[str, np.ndarray]:
    """{optimizer field: [K] values} for the optimizer keys the members differ in."""
    diff = differences(cfgs)
    out = {}
    for key in OPTIM_KEYS:
        if key in diff:
            dtype = np.int32 if key in _INT_KEYS else np.float32
            out[key.split(".", 1)[1]] = np.asarray(diff[key], dtype)
    return out


def seeded(cfg: ExperimentConfig, k: int) -> list[ExperimentConfig]:
    """`k` replicates of `cfg` as a group: seeds 0 .. k-1 (initialisation and data order)."""
    return [
        cfg.replace(
            name=f"{cfg.name}.seed{s}",
            train=cfg.train.replace(seed=s),
            data=cfg.data.replace(seed=s),
        )
        for s in range(k)
    ]


# The most members one group may hold (`train --members`, a study's `members`): a group's
# state and batches are K times a run's, and past a few members on a CPU the step costs
# K times one run's anyway (docs/performance.md#members).
MAX_MEMBERS = 64


def check_count(count: Any, where: str, hint: str = "") -> int:
    """`count` as a number of members of one group (1 to MAX_MEMBERS), or one ConfigError
    naming `where` it was given (`--members`, a spec's `members`) and the accepted range."""
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_MEMBERS:
        raise ConfigError(f"{where}: got {count!r}; a group holds 1 to {MAX_MEMBERS} members{hint}")
    return count
