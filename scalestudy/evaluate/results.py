"""Where a run directory keeps its zero-shot results: summary.json["eval"], metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path


def write_results(workdir: Path, step: int, results: dict[str, float]) -> None:
    """Merge into summary.json["eval"] and append one line to metrics.jsonl."""
    summary_path = workdir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    summary["eval"] = {**summary.get("eval", {}), **results, "step": step}
    tmp = summary_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(summary_path)  # atomic: a crash never leaves half a summary
    with (workdir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": step, **{f"eval/{k}": v for k, v in results.items()}}) + "\n")
