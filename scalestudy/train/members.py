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


def flat(cfg: ExperimentConfig) -> dict[str, Any]:
    """{dotted key: value} of a resolved config."""
    return flatten(cfg.model_dump(mode="json"))


def differences(cfgs: Sequence[ExperimentConfig]) -> dict[str, list[Any]]:
    """{dotted key: each member's value} for every key the configs do not share."""
    flats = [flat(c) for c in cfgs]
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
    return json.dumps({k: v for k, v in flat(cfg).items() if k not in free}, sort_keys=True)


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


def check(cfgs: Sequence[ExperimentConfig]) -> None:
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


# `seed=S` in a member grid: the run's whole replicate, initialisation and data order.
SEED_SHORTHAND = "seed"


def parse_grid(items: Sequence[str], overrides: Sequence[str] = ()) -> list[tuple[str, list[str]]]:
    """A member grid (`seed=0,1,2 optim.learning_rate=3e-3,1e-2`: every combination) as
    (directory name, overrides) per member, in grid order. `seed=S` sets train.seed and
    data.seed; other keys are dotted config keys that members may differ in. A key set by two
    axes, or by an axis and one of the shared `overrides`, is refused naming both."""
    axes: list[tuple[str, list[str]]] = []
    accepted = f"{SEED_SHORTHAND}, " + ", ".join(k for k in MEMBER_KEYS if k != "name")
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--members: {item!r} is not KEY=V1,V2,...; e.g. seed=0,1,2")
        if key != SEED_SHORTHAND and key not in MEMBER_KEYS[1:]:
            raise ConfigError(
                f"--members: {key} cannot differ between members (it changes the program or "
                f"is not a key); accepted: {accepted}. Overrides shared by every member go "
                "before --members"
            )
        parts = [v.strip() for v in values.split(",")]
        if not values or "" in parts:
            raise ConfigError(f"--members: {key} has an empty value in {item!r}")
        twice = sorted({v for v in parts if parts.count(v) > 1})
        if twice:
            raise ConfigError(f"--members: {key} lists {twice} twice (duplicate members)")
        if key in (k for k, _ in axes):
            raise ConfigError(f"--members: {key} is given twice; give its values once")
        axes.append((key, parts))
    if not axes:
        raise ConfigError(f"--members: the grid is empty; give KEY=V1,V2,... ({accepted})")
    _check_one_place(axes, overrides)
    grid: list[tuple[str, list[str]]] = [("", [])]
    for key, values in axes:
        short = key.rsplit(".", 1)[-1]
        grid = [
            (f"{name}-{short}{v}".lstrip("-"), [*ov, *_overrides(key, v)])
            for name, ov in grid
            for v in values
        ]
    check_count(len(grid), "--members (the grid's members)", "; split it over several commands")
    return grid


def _check_one_place(axes: list[tuple[str, list[str]]], overrides: Sequence[str]) -> None:
    """Refuse a config key that two places set (`seed=0,1` with `train.seed=...`, as a shared
    override or another axis): one would silently win over the other."""
    setters: dict[str, str] = {}
    for key, values in axes:
        for item in _overrides(key, values[0]):
            target = item.partition("=")[0]
            if target in setters:
                raise ConfigError(
                    f"--members: {setters[target]}=... and {key}=... both set {target}; "
                    "give it in one place"
                )
            setters[target] = key
    for item in overrides:
        target = item.partition("=")[0]
        if target in setters:
            raise ConfigError(
                f"{item} and --members {setters[target]}=... both set {target}: the members' "
                f"values would win; give {target} in one place (in --members to vary it)"
            )


def _overrides(key: str, value: str) -> list[str]:
    if key == SEED_SHORTHAND:
        return [f"train.seed={value}", f"data.seed={value}"]
    return [f"{key}={value}"]
