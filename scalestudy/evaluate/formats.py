"""Readers for the released file formats of the evaluation sets.

Each reader turns one release (JSONL, the original COPA XML, PIQA's labels file, WiC's
tab-separated text) into `Row`s: a dict of fields plus where it came from, so that every later
error can name the file, the line and the field. No prompts here (tasks.py owns those).
"""

from __future__ import annotations

import csv
import json
import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scalestudy.config.errors import ScalestudyError, not_found


class TaskDataError(ScalestudyError):
    """An evaluation file is missing or malformed; the message names file, line and field."""


@dataclass(frozen=True)
class Row:
    """One record of a release file and its origin (`path:line`, or an item id for XML)."""

    fields: dict[str, Any]
    where: str

    def get(self, name: str, kind: type | tuple[type, ...] | None = None) -> Any:
        """The field `name`, checked to be of `kind`; a TaskDataError naming it otherwise."""
        if name not in self.fields:
            have = ", ".join(sorted(self.fields)) or "none"
            raise TaskDataError(f"{self.where}: missing field {name!r}; fields present: {have}")
        value = self.fields[name]
        if kind is not None and not isinstance(value, kind):
            names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise TaskDataError(
                f"{self.where}: field {name!r} should be {names}, got "
                f"{type(value).__name__} {_short(value)}"
            )
        return value

    def error(self, message: str) -> TaskDataError:
        return TaskDataError(f"{self.where}: {message}")


# A release's own id field, in the order looked for (BLiMP's pairID, SuperGLUE's idx, ...).
ID_FIELDS = ("id", "idx", "pairID", "ID", "qID", "ind", "uid", "example_id", "guid")


def source_id(row: Row) -> str:
    """The row's id in its release (its first id field), else where it was read (file:line),
    so a per-example result can be found in the source."""
    for name in ID_FIELDS:
        value = row.fields.get(name)
        if isinstance(value, str | int) and not isinstance(value, bool):
            return str(value)
    return row.where


def _short(value: Any, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def require_file(path: str | Path, what: str = "task file") -> Path:
    """`path` as a Path if it is an existing file; a TaskDataError naming it otherwise."""
    path = Path(path)
    if not path.is_file():
        parent = path.parent
        near = sorted(p.name for p in parent.iterdir())[:12] if parent.is_dir() else []
        hint = f"; {parent} holds: {', '.join(near)}" if near else f"; {parent} does not exist"
        if path.exists() or path.is_symlink():
            raise TaskDataError(not_found(path, what))
        raise TaskDataError(f"{what} not found: {path}{hint}")
    return path


def resolve_data_dir(data_dir: str | Path | None) -> Path:
    """The evaluation data directory: `data_dir`, else $SCALESTUDY_EVAL_DIR; an error if neither
    names an existing directory."""
    if data_dir is None:
        data_dir = os.environ.get("SCALESTUDY_EVAL_DIR")
    if data_dir is None:
        raise TaskDataError(
            "no evaluation data directory: pass --data-dir DIR or set eval.data_dir (a "
            "directory laid out like copa/copa-dev.xml, piqa/valid.jsonl, ...; see README `eval`)"
        )
    path = Path(data_dir)
    if not path.is_dir():
        raise TaskDataError(not_found(path, "evaluation data directory", "a directory"))
    return path


def read_jsonl(path: str | Path) -> list[Row]:
    """Rows of a JSON-lines file (blank lines skipped); each line must be a JSON object."""
    path = require_file(path)
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskDataError(
                    f"{where}: not valid JSON ({e.msg} at column {e.colno})"
                ) from None
            if not isinstance(obj, dict):
                raise TaskDataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            rows.append(Row(obj, where))
    if not rows:
        raise TaskDataError(f"{path}: no rows")
    return rows


def read_labels(path: str | Path, n_rows: int) -> list[int]:
    """One integer label per line (PIQA's `*-labels.lst`), aligned with `n_rows` data rows."""
    path = require_file(path, "labels file")
    labels = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            labels.append(int(line))
        except ValueError:
            raise TaskDataError(f"{path}:{n}: label {line!r} is not an integer") from None
    if len(labels) != n_rows:
        raise TaskDataError(f"{path}: {len(labels)} labels for {n_rows} data rows; they must align")
    return labels


def read_copa_xml(path: str | Path) -> list[Row]:
    """The original COPA release: `<item id asks-for most-plausible-alternative>` p/a1/a2.

    Fields as in the JSONL conversion and SuperGLUE: premise, choice1, choice2, question
    ("cause"/"effect"), label (0-based), id.
    """
    path = require_file(path)
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        raise TaskDataError(f"{path}: not valid XML ({e})") from None
    rows = []
    for i, item in enumerate(root.iter("item"), start=1):
        where = f"{path}: item {item.get('id', f'#{i}')}"
        texts = {}
        for tag in ("p", "a1", "a2"):
            node = item.find(tag)
            if node is None or not (node.text or "").strip():
                raise TaskDataError(f"{where}: missing or empty <{tag}>")
            texts[tag] = node.text.strip()
        alt = item.get("most-plausible-alternative")
        if alt not in ("1", "2"):
            raise TaskDataError(f"{where}: most-plausible-alternative={alt!r}; accepted: 1, 2")
        fields = {
            "id": int(item.get("id", i)),
            "premise": texts["p"],
            "choice1": texts["a1"],
            "choice2": texts["a2"],
            "question": item.get("asks-for"),
            "label": int(alt) - 1,
        }
        rows.append(Row(fields, where))
    if not rows:
        raise TaskDataError(f"{path}: no <item> elements")
    return rows


def read_piqa(path: str | Path) -> list[Row]:
    """PIQA: goal/sol1/sol2 JSONL with labels inline or in the aligned `<stem>-labels.lst`."""
    path = Path(path)
    rows = read_jsonl(path)
    if "label" in rows[0].fields:
        return rows
    labels = read_labels(path.with_name(f"{path.stem}-labels.lst"), len(rows))
    return [Row({**r.fields, "label": y}, r.where) for r, y in zip(rows, labels, strict=True)]


def read_wic_txt(path: str | Path) -> list[Row]:
    """WiC's original release: `dev.data.txt` (word, pos, i-j, s1, s2) + `dev.gold.txt` (T/F)."""
    path = require_file(path)
    gold_path = require_file(path.with_name(path.name.replace(".data.", ".gold.")), "gold file")
    lines = path.read_text(encoding="utf-8").splitlines()
    gold = gold_path.read_text().split()
    if len(gold) != len(lines):
        raise TaskDataError(f"{gold_path}: {len(gold)} labels for {len(lines)} rows in {path}")
    rows = []
    for n, (line, g) in enumerate(zip(lines, gold, strict=True), start=1):
        parts = line.split("\t")
        if len(parts) != 5 or g not in ("T", "F"):
            raise TaskDataError(
                f"{path}:{n}: expected 5 tab-separated fields and a T/F gold label, got "
                f"{len(parts)} fields and {g!r}"
            )
        word, pos, idx, s1, s2 = parts
        i1, _, i2 = idx.partition("-")
        fields = {
            "word": word,
            "pos": pos,
            "word_index1": int(i1),
            "word_index2": int(i2),
            "sentence1": s1,
            "sentence2": s2,
            "label": g == "T",
        }
        rows.append(Row(fields, f"{path}:{n}"))
    return rows


def read_table(path: str | Path) -> list[Row]:
    """Rows of a CSV (StoryCloze) or tab-separated (GLUE) file with a header line; every
    value a string, as released."""
    path = require_file(path)
    tab = path.suffix == ".tsv"
    with path.open(encoding="utf-8", newline="") as f:
        kw = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if tab else {}
        reader = csv.DictReader(f, **kw)
        rows = []
        for n, fields in enumerate(reader, start=2):
            if None in fields or None in fields.values():
                raise TaskDataError(
                    f"{path}:{n}: {len(fields)} columns do not match the header's "
                    f"{len(reader.fieldnames or ())}"
                )
            rows.append(Row(dict(fields), f"{path}:{n}"))
    if not rows:
        raise TaskDataError(f"{path}: no rows after the header")
    return rows


def read_json_array(path: str | Path) -> list[Row]:
    """Rows of a JSON file holding a list of objects (SciQ, MathQA) or an object of objects
    keyed by id (PubMedQA; the key becomes field `id`)."""
    path = require_file(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TaskDataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(data, dict):
        data = [{"id": k, **v} if isinstance(v, dict) else v for k, v in data.items()]
    if not isinstance(data, list) or not data or not all(isinstance(x, dict) for x in data):
        raise TaskDataError(f"{path}: expected a non-empty JSON list (or object) of objects")
    return [Row(x, f"{path}: item {x.get('id', i)}") for i, x in enumerate(data)]


def read_logiqa_txt(path: str | Path) -> list[Row]:
    """LogiQA's release: records separated by a blank line, each the answer letter, the
    passage, the question and four options ("A.text")."""
    path = require_file(path)
    blocks = [b for b in path.read_text(encoding="utf-8").strip().split("\n\n") if b.strip()]
    rows = []
    for i, block in enumerate(blocks, start=1):
        lines = [line.strip() for line in block.strip().splitlines()]
        where = f"{path}: record {i}"
        if len(lines) != 7 or lines[0].lower() not in ("a", "b", "c", "d"):
            raise TaskDataError(
                f"{where}: expected 7 lines (answer letter a-d, passage, question, 4 options), "
                f"got {len(lines)} starting {lines[0][:20]!r}"
            )
        options = [o[2:].strip() if o[1:2] == "." else o for o in lines[3:]]
        fields = {"label": lines[0].lower(), "context": lines[1], "question": lines[2]}
        rows.append(Row({**fields, "options": options}, where))
    if not rows:
        raise TaskDataError(f"{path}: no records")
    return rows


def read_rows(path: str | Path) -> list[Row]:
    """Rows of any supported release file, chosen by its name.

    `.xml`: original COPA; `*.data.txt`: original WiC (with `*.gold.txt`); other `.txt`:
    LogiQA's records; `.csv`/`.tsv`: a table with a header (StoryCloze, GLUE); `.json`: a list
    or an id-keyed object of objects (SciQ, MathQA, PubMedQA); `.jsonl`:
    one object per line, with labels from an aligned `<stem>-labels.lst` when there is one
    (PIQA).
    """
    path = Path(path)
    try:
        return _read_rows(path)
    except UnicodeDecodeError as e:
        raise TaskDataError(
            f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); task files are read as UTF-8"
        ) from None


def _read_rows(path: Path) -> list[Row]:
    if path.suffix == ".xml":
        return read_copa_xml(path)
    if path.name.endswith(".data.txt"):
        return read_wic_txt(path)
    if path.suffix in (".csv", ".tsv"):
        return read_table(path)
    if path.suffix == ".json":
        return read_json_array(path)
    if path.suffix == ".txt":
        return read_logiqa_txt(path)
    if path.with_name(f"{path.stem}-labels.lst").is_file():
        return read_piqa(path)
    return read_jsonl(path)
