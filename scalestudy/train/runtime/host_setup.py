"""Process-wide set-up before a program is compiled: the persistent compilation cache and,
on a CPU host, glibc's allocator thresholds."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import jax


def enable_compilation_cache() -> None:
    """Persist compiled programs across processes (a run re-launched after preemption, the
    next study), in $SCALESTUDY_JAX_CACHE or ~/.cache/scalestudy/jax, unless the user
    configured a JAX cache already."""
    if jax.config.jax_compilation_cache_dir:
        return
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "scalestudy/jax"
    path = Path(os.environ.get("SCALESTUDY_JAX_CACHE", default))
    with contextlib.suppress(OSError):
        path.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.3)


# glibc malloc settings for a CPU host (mallopt parameter numbers): keep freed memory instead of
# handing it back to the kernel after every step, which then faults it in again page by page
# (fewer page faults and less system time per run: docs/performance.md, "Allocator").
_MALLOPT = {
    "MALLOC_TRIM_THRESHOLD_": (-1, 1 << 30),
    "MALLOC_TOP_PAD_": (-2, 1 << 28),
    "MALLOC_MMAP_THRESHOLD_": (-3, 1 << 25),  # 32 MiB, glibc's largest
}


def tune_host_allocator() -> dict[str, int]:
    """On a CPU backend with glibc, raise malloc's trim, top-pad and mmap thresholds (each
    unless its MALLOC_*_ variable is set); returns the settings applied (none elsewhere)."""
    if jax.default_backend() != "cpu":
        return {}
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return {}
    applied = {}
    for name, (param, value) in _MALLOPT.items():
        if name not in os.environ and mallopt(param, value) == 1:
            applied[name] = value
    return applied
