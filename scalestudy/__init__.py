"""Architecture x objective scaling studies of language models in JAX/Flax NNX."""

import glob as _glob
import os as _os

# libtpu takes a host-wide lock file when any process loads it, so a CPU-only process (a
# study, a test) would make every other process that compiles for a TPU topology fail. On a
# host without TPU devices there is no chip to protect: let every process load the compiler.
if not _glob.glob("/dev/accel*") and not _glob.glob("/dev/vfio/[0-9]*"):
    _os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
