"""Architecture x objective scaling studies of language models in JAX/Flax NNX.

The names docs/python.md uses are importable from here (`from scalestudy import train_group`);
each is imported on first use, so `import scalestudy` stays cheap for the command line.
"""

import glob as _glob
import os as _os
import sys as _sys


def _gpu_plugin_installed() -> bool:
    """Whether a JAX GPU plugin (jax-cuda*, jax-rocm*) is installed: its metadata directory
    is looked for by name (reading every distribution's metadata takes a good part of a
    second, before the command can answer a Ctrl-C)."""
    for entry in _sys.path:
        for kind in ("cuda", "rocm"):
            if _glob.glob(_os.path.join(entry or ".", f"jax_{kind}*.dist-info")):
                return True
    return False


def tpu_chip_present() -> bool:
    """Whether this host has a TPU chip (its device files: /dev/accel* or /dev/vfio/N)."""
    return bool(_glob.glob("/dev/accel*") or _glob.glob("/dev/vfio/[0-9]*"))


if not tpu_chip_present():
    # No TPU chip on this host. libtpu takes a host-wide lock file when any process loads it, so
    # a CPU-only process (a study, a test) would make every other process that compiles for a
    # TPU topology fail: let every process load the compiler.
    _os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # With libtpu installed (the `tpu` extra), JAX would otherwise initialise it as a backend
    # and libtpu would print its failed search for a chip on every process's terminal. Without
    # a GPU plugin either, the CPU is the only backend there is. (Compiling for a TPU topology
    # needs no TPU backend: `compile --topology` runs on the CPU platform.)
    if "JAX_PLATFORMS" not in _os.environ and not _gpu_plugin_installed():
        _os.environ["JAX_PLATFORMS"] = "cpu"


# name -> module that defines it (docs/python.md shows each in use).
_EXPORTS = {
    "ExperimentConfig": "scalestudy.config.experiment",
    "load_config": "scalestudy.config.experiment",
    "build_model": "scalestudy.models.api",
    "get_vocabulary": "scalestudy.data.vocab",
    "train_group": "scalestudy.train.loop",
    "Scorer": "scalestudy.evaluate.scorer",
    "load_run": "scalestudy.evaluate.rank",
    "evaluate_run": "scalestudy.evaluate.rank",
    "DataSettings": "scalestudy.scaling.table",
    "FitSettings": "scalestudy.scaling.laws",
    "build_table": "scalestudy.scaling.table_input",
    "load_table": "scalestudy.scaling.table_input",
    "fit_cells": "scalestudy.scaling.laws",
    "make_all_plots": "scalestudy.scaling.fit_plots",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'scalestudy' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # imported once
    return value
