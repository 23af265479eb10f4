"""Published numbers a study's stages are printed beside (the spec's `stages.published`, e.g.
`configs/studies/published/wang2022.yaml`): read and checked when the spec is read
(`study/plan/spec_checks.py`), printed by `study/report/wang_report.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scalestudy.config.errors import ConfigError
from scalestudy.config.yamlio import read_yaml

_PUBLISHED_KEYS = {"source", "benchmarks", "cells", "adapted", "equal_tokens"}


def read_published(path: str | Path) -> dict[str, Any]:
    """A file of published numbers (`configs/studies/published/wang2022.yaml`): every score a
    mapping of benchmark -> number plus `from` (the table it was typed from); ConfigError
    naming the first entry that is not."""
    data = read_yaml(path)
    if not isinstance(data, dict) or not set(data) <= _PUBLISHED_KEYS:
        extra = sorted(set(data) - _PUBLISHED_KEYS) if isinstance(data, dict) else data
        raise ConfigError(f"{path}: unknown keys {extra}; accepted: {sorted(_PUBLISHED_KEYS)}")
    for section in ("cells", "adapted", "equal_tokens"):
        for row, stages_ in (data.get(section) or {}).items():
            for stage, score in (stages_ or {}).items():
                where = f"{path}: {section}.{row}.{stage}"
                if not isinstance(score, dict) or not isinstance(score.get("from"), str):
                    raise ConfigError(f"{where} needs `from`: the table it was typed from")
                bad = [k for k, v in score.items() if k != "from" and not _is_number(v)]
                if bad or len(score) < 2:
                    raise ConfigError(f"{where}: give benchmark: number pairs (e.g. eai: 44.2)")
    return data


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
