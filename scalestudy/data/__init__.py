"""Data room: sources, vocabularies, objectives and the packed, resumable batch pipeline."""

import importlib.util

from scalestudy.config.errors import ScalestudyError

# seqio, TensorFlow and TFDS are an extra: the byte and SentencePiece vocabularies and the
# built-in and text-file corpora need none of them (a CUDA host can train without them).
SEQIO_MODULES = ("seqio", "tensorflow", "tensorflow_datasets")
SEQIO_EXTRA = "pip install 'scalestudy[seqio]'"
# Grain, pyarrow, datasets and array_record: the `grain` extra (data.source: grain).
GRAIN_EXTRA = "pip install 'scalestudy[grain]'"


class DataError(ScalestudyError):
    """Data cannot be read or prepared as configured; the message says what to do."""


TRAIN_WITHOUT_SEQIO = (
    "train from data.source 'synthetic', 'order', 'text' or 'grain' (byte or SentencePiece "
    "vocabulary), which need none of them"
)


def require_seqio(what: str, instead: str = TRAIN_WITHOUT_SEQIO) -> None:
    """Raise DataError naming `what` when seqio, TensorFlow or TFDS is not installed;
    `instead`: what the user can do without them (training from other sources by default)."""
    missing = [m for m in SEQIO_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise DataError(
            f"{what} needs {', '.join(missing)}, which this environment does not have; "
            f"install them with `{SEQIO_EXTRA}`, or {instead}"
        )


def require_grain(what: str, modules: tuple[str, ...]) -> None:
    """Raise DataError naming `what` when one of `modules` (of the grain extra) is missing."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise DataError(
            f"{what} needs {', '.join(missing)}, which this environment does not have; "
            f"install them with `{GRAIN_EXTRA}`"
        )
