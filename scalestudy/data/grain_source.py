"""The Grain source (`data.source: grain`): documents from Parquet, Hugging Face datasets and
ArrayRecord files, read through Grain's random-access data sources and its index sampler, with
no TensorFlow imported.

Formats (`data.grain_format`, or `auto`: by each path's extension):
- `parquet` (`*.parquet`): read with pyarrow, one row group in memory at a time;
- `huggingface`: a directory written by `datasets`' `save_to_disk` (a Dataset, or a
  DatasetDict whose `data.train_split` / `data.validation_split` are the splits), or local
  `*.arrow`, `*.json`, `*.jsonl`, `*.csv` files loaded by `datasets`' own builders (offline:
  no hub lookup, no download);
- `array_record` (`*.array_record`, `*.arrayrecord`): grain's `ArrayRecordDataSource`; each
  record is UTF-8 text, or a JSON object holding the text under `data.text_key`.

A row's document is the string in its `data.text_key` column (default "text"), stripped;
empty ones and nulls are dropped, as in a `.jsonl` file of the text source, so the same
documents give the same batches through either source. The documents then go the NumPy
pipeline's way (`numpy_pipeline.py`): tokenised once, cut into pieces, objectives, greedy
packing, each process's rows of the global batch, and the one-integer iterator state in the
checkpoint. Every process reads the whole corpus, as for the text source, because packing a
global batch needs the size of every piece; a process materialises only its own rows.
"""

from __future__ import annotations

import bisect
import json
import os
import threading
from pathlib import Path
from typing import Any

from scalestudy.config.experiment import DataConfig
from scalestudy.data import DataError, require_grain

FORMATS = ("parquet", "huggingface", "array_record")
_SUFFIX_FORMAT = {
    ".parquet": "parquet",
    ".array_record": "array_record",
    ".arrayrecord": "array_record",
    ".arrow": "huggingface",
    ".json": "huggingface",
    ".jsonl": "huggingface",
    ".csv": "huggingface",
}
_HF_BUILDER = {
    ".arrow": "arrow",
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
}
_HF_SAVED = ("dataset_dict.json", "state.json")  # what save_to_disk leaves in its directory


def path_format(path: Path, given: str) -> str:
    """The format `path` is read as: `given` unless 'auto', else by extension or layout."""
    if given != "auto":
        return given
    if path.is_dir():
        if any((path / name).is_file() for name in _HF_SAVED):
            return "huggingface"
        # Other files (a README, lock files) do not count: a hub snapshot has them.
        suffixes = {f.suffix.lower() for f in _dir_files(path)}
        kinds = {_SUFFIX_FORMAT[x] for x in suffixes if x in _SUFFIX_FORMAT}
        if len(kinds) == 1:
            return kinds.pop()
        raise DataError(
            f"data.paths: cannot tell the format of directory {str(path)!r} (not a save_to_disk "
            f"directory; it holds {len(kinds)} kinds of data files); set data.grain_format to "
            f"one of {', '.join(FORMATS)}"
        )
    fmt = _SUFFIX_FORMAT.get(path.suffix.lower())
    if fmt is None:
        raise DataError(
            f"data.paths: {str(path)!r} has no extension data.source='grain' knows "
            f"({', '.join(sorted(_SUFFIX_FORMAT))}); set data.grain_format to one of "
            f"{', '.join(FORMATS)}, or read text files with data.source='text'"
        )
    return fmt


def _dir_files(path: Path) -> list[Path]:
    return sorted(f for f in path.rglob("*") if f.is_file() and not f.name.startswith("."))


def _files_of(path: Path, fmt: str, key: str) -> list[Path]:
    """The files of format `fmt` that `path` names: itself, or those under a directory."""
    if not path.is_dir():
        return [path]
    suffixes = _HF_BUILDER if fmt == "huggingface" else _SUFFIX_FORMAT
    files = [
        f
        for f in _dir_files(path)
        if f.suffix.lower() in suffixes
        and (fmt == "huggingface" or _SUFFIX_FORMAT[f.suffix.lower()] == fmt)
    ]
    if not files:
        raise DataError(f"{key}: directory {str(path)!r} holds no {fmt} files")
    return files


# ----------------------------------------------------------------------------- data sources


class ParquetSource:
    """Random access to one text column of a Parquet file, a row group in memory at a time."""

    def __init__(self, path: Path, column: str) -> None:
        import pyarrow.parquet as pq

        self._path, self._column = path, column
        self._file = pq.ParquetFile(path)
        names = self._file.schema_arrow.names
        if column not in names:
            raise DataError(
                f"{str(path)!r} has no column {column!r} (data.text_key); columns: "
                f"{', '.join(names)}"
            )
        meta = self._file.metadata
        sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        self._starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self._group, self._rows = -1, []
        # Grain's loader reads ahead on threads; a ParquetFile is not safe to share unlocked.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> Any:
        group = bisect.bisect_right(self._starts, index) - 1
        with self._lock:
            if group != self._group:  # the sampler reads in order: one decode per row group
                table = self._file.read_row_group(group, columns=[self._column])
                self._group, self._rows = group, table.column(0).to_pylist()
            return self._rows[index - self._starts[group]]

    def __repr__(self) -> str:  # Grain names a source by its repr in its own checkpoints
        return f"ParquetSource({str(self._path)!r}, {self._column!r})"


class ColumnSource:
    """One column of a random-access source of row dicts (a Hugging Face Dataset)."""

    def __init__(self, rows: Any, column: str, where: str) -> None:
        names = list(rows.column_names)
        if column not in names:
            raise DataError(
                f"{where} has no column {column!r} (data.text_key); columns: {', '.join(names)}"
            )
        self._rows, self._column, self._where = rows.select_columns([column]), column, where

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> Any:
        return self._rows[index][self._column]

    def __repr__(self) -> str:
        return f"ColumnSource({self._where!r}, {self._column!r})"


class JsonRecordSource:
    """ArrayRecord records as text: UTF-8 text, or a JSON object with the text under a key."""

    def __init__(self, paths: list[Path], key: str) -> None:
        import grain

        self._records = grain.sources.ArrayRecordDataSource([str(p) for p in paths])
        self._key, self._paths = key, paths

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index: int) -> Any:
        raw = self._records[index]
        text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
        if text.lstrip().startswith("{"):
            try:
                row = json.loads(text)
            except json.JSONDecodeError:
                return text  # text that happens to start with a brace
            if not isinstance(row, dict) or self._key not in row:
                raise DataError(
                    f"ArrayRecord record {index} of {', '.join(map(str, self._paths))} is a JSON "
                    f"object without the key {self._key!r} (data.text_key)"
                )
            return row[self._key]
        return text

    def __repr__(self) -> str:
        return f"JsonRecordSource({[str(p) for p in self._paths]!r}, {self._key!r})"


# ----------------------------------------------------------------------------- reading


def read(paths: tuple, cfg: DataConfig, split_name: str, key: str) -> tuple[list[str], bool]:
    """The documents of `paths` in order, and whether every path brought its own splits (a
    saved DatasetDict, read at its split `split_name`) so that nothing is to be held out."""
    require_grain(f"data.source='grain' ({key})", ("grain",))
    docs: list[str] = []
    own = bool(paths)
    for p in map(Path, paths):
        if not p.exists():
            raise DataError(f"{key}: {str(p)!r} does not exist (give files or directories)")
        fmt = path_format(p, cfg.grain_format)
        if fmt == "huggingface":
            source, split_given = _huggingface(p, cfg.text_key, split_name, key)
            sources = [source]
        elif fmt == "parquet":
            require_grain(f"data.source='grain' ({key}: Parquet)", ("pyarrow",))
            sources = [ParquetSource(f, cfg.text_key) for f in _files_of(p, fmt, key)]
            split_given = False
        else:
            sources = [JsonRecordSource(_files_of(p, fmt, key), cfg.text_key)]
            split_given = False
        own = own and split_given
        for source in sources:
            docs.extend(_read_texts(source))
    return docs, own


def _huggingface(path: Path, column: str, split_name: str, key: str) -> tuple[ColumnSource, bool]:
    """A save_to_disk directory (a DatasetDict at `split_name`), or local files by `datasets`'
    builders; (the text column as a random-access source, whether it came with splits)."""
    require_grain(f"data.source='grain' ({str(path)!r}: Hugging Face)", ("datasets",))
    # Local files only: never look anything up on the hub (a host may have no network).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    if path.is_dir() and any((path / name).is_file() for name in _HF_SAVED):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split_name not in loaded:
                raise DataError(
                    f"{str(path)!r} has no split {split_name!r}; it has {', '.join(loaded)} "
                    "(set data.train_split / data.validation_split)"
                )
            return ColumnSource(loaded[split_name], column, f"{path}[{split_name}]"), True
        return ColumnSource(loaded, column, str(path)), False
    files = _files_of(path, "huggingface", key)
    builders = {_HF_BUILDER.get(f.suffix.lower(), f.suffix.lower().lstrip(".")) for f in files}
    if len(builders) != 1:
        raise DataError(
            f"{str(path)!r}: files of {len(builders)} kinds ({', '.join(sorted(builders))}); "
            "give one kind of file per path"
        )
    rows = datasets.load_dataset(builders.pop(), data_files=[str(f) for f in files], split="train")
    return ColumnSource(rows, column, str(path)), False


def _read_texts(source: Any) -> list[str]:
    """Every row of `source` in order through Grain's sampler and loader; the non-empty
    documents, stripped."""
    import grain

    if not len(source):
        return []
    sampler = grain.samplers.IndexSampler(num_records=len(source), shuffle=False, num_epochs=1)
    # Read in this thread: these sources decode under the GIL (a Parquet row group behind a
    # lock), so read-ahead threads only add switching
    # (docs/data.md#grain-parquet-hugging-face-datasets-arrayrecord).
    loader = grain.DataLoader(
        data_source=source,
        sampler=sampler,
        worker_count=0,
        read_options=grain.ReadOptions(num_threads=0),
    )
    docs = []
    for i, value in enumerate(loader):
        if value is None:  # a null cell (Parquet, Arrow): an empty document, dropped alike
            continue
        if not isinstance(value, str):
            raise DataError(
                f"row {i} of {source!r} is {type(value).__name__}, not text; data.text_key "
                "names a column of strings"
            )
        if value.strip():
            docs.append(value.strip())
    return docs
