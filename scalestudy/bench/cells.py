"""The one loop every benchmark runs: each valid (architecture, objective) cell of a config."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import EXTRA_CELLS, VALID_CELLS, ExperimentConfig


def cells(
    base: ExperimentConfig,
    *,
    archs: tuple[str, ...] | None = None,
    one_per_arch: bool = False,
    extra: bool = False,
    fallback: str = "plm",
    **sections: dict[str, Any],
) -> Iterator[tuple[str, str, ExperimentConfig]]:
    """(architecture, objective, config) of every valid cell of `base`, over `archs` (default:
    all), and with `extra` the cells outside the grid (bmlm). With `one_per_arch`, one cell per
    architecture: `base`'s objective where it is valid, else `fallback`. `sections` (e.g.
    `data={...}`) are merged into each cell's config."""
    unknown = sorted(set(archs or ()) - set(VALID_CELLS))
    if unknown:
        raise ConfigError(f"bench --arch {unknown}: accepted: {', '.join(VALID_CELLS)}")
    for arch in archs or tuple(VALID_CELLS):
        objectives = (*VALID_CELLS[arch], *(EXTRA_CELLS.get(arch, ()) if extra else ()))
        if one_per_arch:
            objectives = (base.objective.name if base.objective.name in objectives else fallback,)
        for name in objectives:
            changes = {k: {**getattr(base, k).model_dump(), **v} for k, v in sections.items()}
            yield (
                arch,
                name,
                base.replace(
                    **changes,
                    model={**base.model.model_dump(), "arch": arch},
                    objective={**base.objective.model_dump(), "name": name},
                ),
            )


def best_time(fn: Callable, *args: object, repeats: int = 3) -> float:
    """The shortest of `repeats` timed calls `fn(*args)`: on a shared host the others also
    measure its load."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times)
