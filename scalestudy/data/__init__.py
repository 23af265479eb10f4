"""Data room: sources, vocabularies, objectives and the packed, resumable batch pipeline."""

from scalestudy.errors import ScalestudyError


class DataError(ScalestudyError):
    """Data cannot be read or prepared as configured; the message says what to do."""
