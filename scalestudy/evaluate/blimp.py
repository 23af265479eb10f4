"""BLiMP (Warstadt et al. 2020): 67 paradigms of 1,000 minimal pairs, the acceptable sentence
against the unacceptable one, each sentence scored whole with no context.

The release is one JSONL file per paradigm (`sentence_good`, `sentence_bad`, `UID`,
`linguistics_term`, `field`, ...) and, under `reference/models_summary.jsonl`, the paper's
per-paradigm accuracies of a 5-gram model, an LSTM, Transformer-XL and GPT-2 (plus rows with
`UID: overall` for each linguistics term and for everything).

Accuracy is reported per paradigm (`blimp/<UID>/acc`), per linguistics term
(`blimp/term/<term>/acc`), per field (`blimp/field/<field>/acc`) and overall (`blimp/acc`);
`compare_with_reference` puts the paper's models beside ours for the report.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from scalestudy.evaluate.examples import Example, Task
from scalestudy.evaluate.formats import TaskDataError, read_jsonl, source_id

REFERENCE_MODELS = ("ngram", "lstm", "txl", "gpt2")
REFERENCE_FILE = "reference/models_summary.jsonl"


def pair_example(good: str, bad: str, group: str) -> Example:
    """A minimal pair as a two-choice example with an empty context; the acceptable sentence
    (choice 0) is gold, and each sentence is scored whole (no delimiter before it)."""
    return Example(("",), (good, bad), 0, group)


def load_blimp(path: str | Path, name: str = "blimp") -> Task:
    """BLiMP from a directory of paradigm files (or one paradigm's file)."""
    path = Path(path)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files or not files[0].is_file():
        raise TaskDataError(f"BLiMP: no paradigm files (*.jsonl) at {path}")
    examples, terms, fields = [], {}, {}
    for file in files:
        for row in read_jsonl(file):
            uid = row.get("UID", str)
            good, bad = row.get("sentence_good", str), row.get("sentence_bad", str)
            if not good.strip() or not bad.strip():
                raise row.error("empty sentence in a minimal pair")
            terms[uid] = row.get("linguistics_term", str)
            # The release spells one field two ways ("syntax_semantics" in most files,
            # "syntax/semantics" in principle_A_case_2); a "/" would also split the metric key.
            fields[uid] = row.get("field", str).replace("/", "_")
            example = pair_example(good, bad, uid)
            examples.append(dataclasses.replace(example, source=source_id(row)))
    info = {"group_tags": {"term": terms, "field": fields}}
    return Task(name, "choice", tuple(examples), str(path), "acc", delimiter="", info=info)


def read_reference(path: str | Path) -> dict[str, dict[str, dict[str, float]]]:
    """The paper's accuracies: {"paradigm": {UID: {model: acc}}, "term": {...},
    "overall": {"overall": {...}}} from models_summary.jsonl (or the BLiMP directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / REFERENCE_FILE
    out: dict[str, dict[str, dict[str, float]]] = {"paradigm": {}, "term": {}, "overall": {}}
    for row in read_jsonl(path):
        accs = {m: float(row.get(m, (int, float))) for m in REFERENCE_MODELS}
        uid, term = row.get("UID", str), row.get("linguistics_term", str)
        if uid != "overall":
            out["paradigm"][uid] = {"term": term, **accs}
        elif term == "overall":
            out["overall"]["overall"] = accs
        else:
            out["term"][term] = accs
    return out


def compare_with_reference(
    results: dict[str, float], reference: str | Path, task: str = "blimp"
) -> list[dict]:
    """Rows (level, name, ours, ngram, lstm, txl, gpt2) comparing our BLiMP accuracies
    (flat results, "eval/" prefix optional) with the paper's: per paradigm, per linguistics
    term as the paper groups them (mean over its paradigms), and overall. Paradigms we did not
    score are left out of every mean, ours and theirs alike, so each row compares like with
    like."""
    ref = read_reference(reference)
    flat = {k.removeprefix("eval/"): v for k, v in results.items()}
    ours = {
        uid: flat[f"{task}/{uid}/acc"] for uid in ref["paradigm"] if f"{task}/{uid}/acc" in flat
    }
    if not ours:
        raise TaskDataError(f"no per-paradigm BLiMP results under '{task}/<UID>/acc' to compare")
    rows = []
    for uid in sorted(ours):
        r = ref["paradigm"][uid]
        rows.append({"level": "paradigm", "name": uid, "ours": ours[uid], **_models(r)})
    by_term: dict[str, list[str]] = {}
    for uid in ours:
        by_term.setdefault(ref["paradigm"][uid]["term"], []).append(uid)
    for term, uids in sorted(by_term.items()):
        rows.append(_mean_row("term", term, uids, ours, ref))
    rows.append(_mean_row("overall", "overall", list(ours), ours, ref))
    return rows


def _models(row: dict) -> dict[str, float]:
    return {m: row[m] for m in REFERENCE_MODELS}


def _mean_row(level: str, name: str, uids: list[str], ours: dict, ref: dict) -> dict:
    means = {m: float(np.mean([ref["paradigm"][u][m] for u in uids])) for m in REFERENCE_MODELS}
    return {"level": level, "name": name, "ours": float(np.mean([ours[u] for u in uids])), **means}


def format_table(rows: list[dict]) -> str:
    """A Markdown table of `compare_with_reference` rows."""
    head = "| level | name | ours | " + " | ".join(REFERENCE_MODELS) + " |"
    lines = [head, "|" + "---|" * (3 + len(REFERENCE_MODELS))]
    for r in rows:
        accs = " | ".join(f"{r[m]:.3f}" for m in ("ours", *REFERENCE_MODELS))
        lines.append(f"| {r['level']} | {r['name']} | {accs} |")
    return "\n".join(lines)


def write_reference_table(results: dict[str, float], reference: str | Path, out: Path) -> Path:
    """`format_table` of the comparison written to `out` (and the rows as JSON beside it)."""
    rows = compare_with_reference(results, reference)
    out.write_text(format_table(rows) + "\n")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=2))
    return out
