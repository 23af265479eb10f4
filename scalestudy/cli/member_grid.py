"""`train --members KEY=V1,V2,...`: a member grid, every combination of the values given, as
one run directory name and its overrides per member (which keys may differ between members
is train/members.py)."""

from __future__ import annotations

from collections.abc import Sequence

from scalestudy.config.errors import ConfigError
from scalestudy.train.members import MEMBER_KEYS, check_count

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
