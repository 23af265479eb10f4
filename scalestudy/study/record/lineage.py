"""A stage run's record (`stage.json` in its run directory): its lineage (parent run and
step) and settings, written by `study/run/stages.py` and read back by the report."""

from __future__ import annotations

import json
from pathlib import Path

STAGE_FILE = "stage.json"


def read_lineage(run: Path) -> dict | None:
    """The stage record of a run directory (None for a pretraining run)."""
    path = Path(run) / STAGE_FILE
    return json.loads(path.read_text()) if path.is_file() else None
