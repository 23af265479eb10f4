"""A study's runs grouped as members of one program (train/members.py).

Runs that share every key but the member keys (seeds, learning rate and the optimizer's other
numbers) train together, at most `members` at a time; each stays a run of its own (its run
directory, its registry row). `study.members: auto` groups up to `AUTO_MEMBERS` runs; `1`
trains every run alone. A study given its own `train_fn` trains every run alone (the group
trainer is the package's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# `members: auto`. On a CPU the members' steps run one after another in the group's program,
# so a member-step costs a run's at any K (docs/performance.md#members) and a larger group
# shares more compiling and start-up; on an accelerator a small model's step is bound by
# launches, not arithmetic, and the members share each launch. The cap bounds the K copies
# of the state a group holds.
AUTO_MEMBERS = 8


def cap(members: Any) -> int:
    """The most runs one group may hold for a spec's `members` ("auto" or a count >= 1)."""
    if members == "auto":
        return AUTO_MEMBERS
    from scalestudy.train.members import check_count

    return check_count(members, "members", " (1: every run alone), or auto")


def member_multiple(cfg: Any) -> int:
    """What a group's size must be a multiple of for `cfg`'s mesh: the data axis's size where
    `mesh.members: data` splits the members over it (each data slice trains whole members),
    else 1."""
    from scalestudy.train import sharding

    axis = sharding.member_axis(cfg.mesh)
    if axis is None:
        return 1
    import jax

    return sharding.mesh_shape(cfg.mesh, jax.device_count())[axis]


def plan_groups(runs: list, most: int) -> list[list]:
    """`runs` as groups of at most `most` that can share one program, in the order of each
    group's first run (so a study's size-major order is kept). Where the members are split
    over the data axis, a group's size is a multiple of that axis's (the runs left over train
    alone, without a member axis)."""
    if most <= 1:
        return [[r] for r in runs]
    from scalestudy.train import members

    by_key: dict[str, list] = {}
    for run in runs:
        by_key.setdefault(members.program_key(run.cfg), []).append(run)
    groups: list[list] = []
    for same in by_key.values():
        multiple = member_multiple(same[0].cfg)
        size = most - most % multiple
        whole = len(same) - len(same) % multiple if size else 0
        for i in range(0, whole, size or 1):
            chunk = same[i : min(i + size, whole)]
            if members.program_difference([r.cfg for r in chunk]) is None:
                groups.append(chunk)
            else:  # a member key set for some runs and None for others (clipping on/off)
                groups.extend([r] for r in chunk)
        groups.extend([r] for r in same[whole:])
    order = {id(r): i for i, r in enumerate(runs)}
    return sorted(groups, key=lambda g: order[id(g[0])])


def describe(groups: list[list]) -> str:
    """One line: how many runs train in how many programs."""
    runs = sum(len(g) for g in groups)
    shared = [g for g in groups if len(g) > 1]
    if not shared:
        return f"{runs} runs, each alone (members: 1)"
    sizes = sorted({len(g) for g in shared})
    return (
        f"{runs} runs in {len(groups)} programs: {len(shared)} groups of "
        f"{'/'.join(map(str, sizes))} members, {len(groups) - len(shared)} alone"
    )


def train_group(cfgs: list, workdirs: list[Path], evaluate: bool = True) -> list:
    """Train and (with `evaluate`) evaluate one group (the study's trainer for members): each
    member's summary, or the error that stopped it alone."""
    from scalestudy.evaluate import rank
    from scalestudy.train import loop

    eval_fns = [rank.make_eval_fn(c, w) if evaluate else None for c, w in zip(cfgs, workdirs)]
    return loop.train_group(cfgs, workdirs, eval_fns)
