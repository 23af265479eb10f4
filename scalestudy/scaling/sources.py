"""Where runs come from: a study registry (file or study directory), CSV/TSV or JSONL."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from scalestudy.scaling.io import REGISTRY_SUFFIXES, ScalingDataError


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise ScalingDataError(f"{path}: not a text file (CSV/TSV/JSONL expected)") from None
    except OSError as e:
        raise ScalingDataError(f"{path}: cannot read ({e.strerror})") from None


def find_registry(path: Path) -> Path | None:
    """The registry file for `path` (itself, or the single one inside a study directory)."""
    if path.is_file() and path.suffix in REGISTRY_SUFFIXES:
        return path
    if path.is_dir():
        found = sorted(p for s in REGISTRY_SUFFIXES for p in path.glob(f"*{s}"))
        if len(found) > 1:
            raise ScalingDataError(
                f"{path} holds several registries ({', '.join(p.name for p in found)}); "
                "pass one file"
            )
        if found:
            return found[0]
        raise ScalingDataError(f"no study registry (*.sqlite, *.db) in directory {path}")
    return None


def read_rows(source: str | Path) -> tuple[list[dict], list[dict] | None, str]:
    """Rows of runs, rows of curves (registry only, else None) and the kind of source."""
    path = Path(source)
    if not path.exists():
        raise ScalingDataError(f"runs source not found: {path}")
    registry = find_registry(path)
    if registry is not None:
        try:
            from scalestudy.study import registry as reg

            return reg.load_runs(registry), reg.load_curves(registry), "registry"
        except (ImportError, AttributeError) as e:
            raise ScalingDataError(f"cannot read study registry {registry}: {e}") from None
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        return _read_jsonl(path), None, "jsonl"
    if suffix in (".csv", ".tsv", ".txt"):
        return _read_csv(path), None, "csv"
    raise ScalingDataError(
        f"{path}: unknown kind of runs source; accepted: a registry (.sqlite, .db or a study "
        "directory), .csv/.tsv, .jsonl"
    )


def _read_csv(path: Path) -> list[dict]:
    lines = [ln for ln in _text(path).splitlines() if ln.strip() and not ln.startswith("#")]
    if not lines:
        raise ScalingDataError(f"{path}: no rows")
    try:
        dialect = csv.Sniffer().sniff(lines[0], delimiters=",\t;")
    except csv.Error:
        dialect = csv.excel
    reader = csv.DictReader(lines, dialect=dialect)
    rows = [{(k or "").strip(): v for k, v in row.items()} for row in reader]
    if not rows:
        raise ScalingDataError(f"{path}: a header but no rows")
    return rows


def _read_jsonl(path: Path) -> list[dict]:
    text = _text(path)
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ScalingDataError(f"{path}: not valid JSON: {e}") from None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ScalingDataError(f"{path}: a JSON array of objects (one per run) is needed")
        return rows
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ScalingDataError(f"{path}:{i}: not valid JSON: {e}") from None
            if not isinstance(row, dict):
                raise ScalingDataError(f"{path}:{i}: each line must be a JSON object (one run)")
            rows.append(row)
    if not rows:
        raise ScalingDataError(f"{path}: no rows")
    return rows
