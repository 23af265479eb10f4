"""Document sources: the built-in synthetic corpus, the order-sensitive corpus
(`data/order_task.py`), local text files, TFDS datasets by name, and Parquet, Hugging Face
datasets and ArrayRecord files through Grain (`data/grain_source.py`, imported only for it).

Every source answers `documents(data_cfg, split) -> list[str]` for split 'train' or
'validation'. Local text: each path is a file or a directory (walked recursively for `*.txt`);
a document is a whole file (`split_by='file'`), a non-empty line ('line'), or the text between
delimiters ('delimiter', default `<|endoftext|>`); in a `.jsonl` file, the `data.text_key`
field of each line. The validation split is
`data.validation_paths` when given, else a deterministic held-out `validation_fraction` of the
documents. TFDS datasets are read through `seqio.TfdsDataSource`; their presence under the
data directory is checked on the local filesystem first, so absent data is a clear error,
never a download attempt or a network retry loop. The Grain source splits as local text does
(a saved DatasetDict brings its own splits: `data.train_split` / `data.validation_split`).
"""

from __future__ import annotations

import fnmatch
import json
import os
import warnings
from pathlib import Path

import numpy as np

from scalestudy.config.errors import path_kind
from scalestudy.config.experiment import DataConfig
from scalestudy.data import DataError, order_task, require_seqio, synthetic
from scalestudy.data.objectives import uniforms

SPLITS = ("train", "validation")
_TEXT_SUFFIXES = (".txt", ".text")  # directories: plain text only; give .jsonl files by path
# Files the text source does not read but the Grain source does.
_GRAIN_SUFFIXES = (".parquet", ".arrow", ".array_record", ".arrayrecord")


def documents(cfg: DataConfig, split: str) -> list[str]:
    """The documents of `split` ('train' or 'validation') of the configured source."""
    if split not in SPLITS:
        raise DataError(f"split {split!r} is not known; accepted: {', '.join(SPLITS)}")
    if cfg.source == "synthetic":
        docs = synthetic.documents(cfg.synthetic, split)
    elif cfg.source == "order":
        docs = order_task.documents(cfg.synthetic, split)
    elif cfg.source == "text":
        docs = _text_documents(cfg, split)
    elif cfg.source == "grain":
        docs = _grain_documents(cfg, split)
    else:
        docs = _tfds_documents(cfg, split)
    if cfg.max_documents is not None:
        docs = docs[: cfg.max_documents]
    if not docs:
        raise DataError(
            f"the {split} split of data.source={cfg.source!r} has no documents"
            + (f" (paths: {', '.join(map(str, cfg.paths))})" if cfg.source == "text" else "")
        )
    return docs


def labelled_documents(cfg: DataConfig, split: str) -> list[list[tuple[str, str]]]:
    """The documents of `split` as (domain, text) pieces that single spaces join into each
    document: the synthetic corpus's episode kinds (`synthetic.labelled_documents`); for
    local text, the file each document came from (its path as given, or found under a given
    directory); for the order corpus, Grain and TFDS, the source ("order", "grain",
    `data.tfds_name`)."""
    if split not in SPLITS:
        raise DataError(f"split {split!r} is not known; accepted: {', '.join(SPLITS)}")
    if cfg.source == "seqio":
        raise DataError(
            "data.source='seqio' reads a seqio Task's examples, not documents of a source, so "
            "its text has no domains here; domains come from data.source synthetic, text, "
            "order or tfds"
        )
    if cfg.source == "synthetic":
        docs = synthetic.labelled_documents(cfg.synthetic, split)
    elif cfg.source == "text":
        docs = _labelled_text_documents(cfg, split)
    else:
        name = str(cfg.tfds_name) if cfg.source == "tfds" else cfg.source
        docs = [[(name, d)] for d in documents(cfg, split)]
    return docs[: cfg.max_documents] if cfg.max_documents is not None else docs


# ----------------------------------------------------------------------------- local text


def _files(paths: tuple, key: str) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            found = sorted(
                f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in _TEXT_SUFFIXES
            )
            if not found:
                raise DataError(f"{key}: directory {str(p)!r} holds no *.txt files")
            files.extend(found)
        else:
            found = "does not exist" if path_kind(p) == "nothing" else f"is {path_kind(p)}"
            raise DataError(f"{key}: {str(p)!r} {found} (give text files or directories)")
    return files


def split_text(text: str, cfg: DataConfig) -> list[str]:
    """One file's text cut into documents as `data.split_by` says; empty documents dropped."""
    if cfg.split_by == "file":
        parts = [text]
    elif cfg.split_by == "line":
        parts = text.splitlines()
    else:
        parts = text.split(cfg.delimiter)
    return [p.strip() for p in parts if p.strip()]


# A file where more than this share of the bytes are not UTF-8 is not text (a binary file).
_MAX_UNDECODED = 0.01


def read_text(f: Path) -> str:
    """A text file (training or evaluation text) as UTF-8: a binary file (NUL bytes, or more
    than 1% of it not UTF-8) is refused; a few bytes that are not UTF-8 are read as U+FFFD,
    with a warning."""
    raw = f.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - raw.count("\ufffd".encode())
    nul = b"\0" in raw
    if nul or bad > _MAX_UNDECODED * len(raw):
        held = ", and it holds NUL bytes" if nul else ""
        raise DataError(
            f"{str(f)!r} is not UTF-8 text ({bad} of {len(raw)} bytes are not UTF-8{held}): "
            "a binary file, or text in another encoding? Give UTF-8 text files"
        )
    if bad:
        warnings.warn(
            f"{str(f)!r}: {bad} byte(s) are not UTF-8; read as U+FFFD replacement characters",
            stacklevel=2,
        )
    return text


def _read_all(files: list[Path], cfg: DataConfig) -> list[str]:
    docs: list[str] = []
    for f in files:
        if f.suffix.lower() in _GRAIN_SUFFIXES:
            raise DataError(
                f"{str(f)!r} is a {f.suffix} file, which data.source='text' does not read; "
                "read it with data.source=grain (docs/data.md)"
            )
        try:
            text = read_text(f)
        except OSError as e:
            raise DataError(f"cannot read {str(f)!r}: {e}") from None
        docs.extend(
            _jsonl(text, f, cfg.text_key) if f.suffix == ".jsonl" else split_text(text, cfg)
        )
    return docs


def _jsonl(text: str, f: Path, key: str) -> list[str]:
    docs = []
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{f}:{i}: not a JSON object: {e}") from None
        if not isinstance(row, dict) or not isinstance(row.get(key), str):
            raise DataError(f"{f}:{i}: no string field {key!r} (data.text_key)")
        if row[key].strip():
            docs.append(row[key].strip())
    return docs


def _text_documents(cfg: DataConfig, split: str) -> list[str]:
    docs = _read_all(_files(cfg.paths, "data.paths"), cfg)
    if cfg.validation_paths:
        if split == "validation":
            return _read_all(_files(cfg.validation_paths, "data.validation_paths"), cfg)
        return docs
    return _split_off(docs, cfg, split)


def _grain_documents(cfg: DataConfig, split: str) -> list[str]:
    from scalestudy.data import grain_source

    if cfg.validation_paths and split == "validation":
        given, key = cfg.validation_paths, "data.validation_paths"
    else:
        given, key = cfg.paths, "data.paths"
    name = cfg.validation_split if split == "validation" else cfg.train_split
    docs, own_splits = grain_source.read(given, cfg, name, key)
    return docs if cfg.validation_paths or own_splits else _split_off(docs, cfg, split)


def _split_off(docs: list[str], cfg: DataConfig, split: str) -> list[str]:
    """`split`'s share of documents that came without a validation split: the held-out
    `data.validation_fraction` of them for 'validation', the rest for 'train'."""
    if not docs:
        return docs
    held = held_out(len(docs), cfg.validation_fraction)
    if split == "validation" and not held.any():
        raise DataError(
            f"data.paths give only {len(docs)} document(s), too few to hold out a validation "
            "split; give data.validation_paths, or split_by='line'/'delimiter'"
        )
    keep = held if split == "validation" else ~held
    return [d for d, k in zip(docs, keep) if k]


def _labelled_text_documents(cfg: DataConfig, split: str) -> list[list[tuple[str, str]]]:
    """`_text_documents`, each document labelled with the file it came from."""
    given = cfg.validation_paths if cfg.validation_paths and split == "validation" else cfg.paths
    labelled = [[(str(f), d)] for f in _files(given, "data.paths") for d in _read_all([f], cfg)]
    if cfg.validation_paths or not labelled:
        return labelled
    held = held_out(len(labelled), cfg.validation_fraction)
    keep = held if split == "validation" else ~held
    return [d for d, k in zip(labelled, keep) if k]


def held_out(n: int, fraction: float) -> np.ndarray:
    """Boolean mask of the n documents held out for validation (fixed; at least 1 if n >= 2)."""
    u = uniforms(0x5EED, 0, n)
    held = u < fraction
    if n >= 2 and not held.any():
        held[int(np.argmin(u))] = True
    return held


# ----------------------------------------------------------------------------- TFDS


def tfds_data_dir(cfg: DataConfig) -> str:
    """data.tfds_data_dir, else $TFDS_DATA_DIR, else ~/tensorflow_datasets (TFDS's default)."""
    return (
        cfg.tfds_data_dir
        or os.environ.get("TFDS_DATA_DIR")
        or str(Path("~/tensorflow_datasets").expanduser())
    )


def find_prepared(name: str, data_dir: str) -> Path | None:
    """The prepared version directory of TFDS `name` ('c4/en:3.*') under a local data_dir."""
    base, _, version = name.partition(":")
    root = Path(data_dir) / base
    if not root.is_dir():
        return None
    candidates = []
    for info in list(root.glob("*/dataset_info.json")) + list(root.glob("*/*/dataset_info.json")):
        vdir = info.parent
        # With a config in the name the version is the next level; without one, a dataset
        # with a default config keeps it one level deeper (name/default_config/version).
        if version and not fnmatch.fnmatch(vdir.name, version):
            continue
        candidates.append(vdir)

    def key(p: Path) -> tuple:
        return tuple(int(x) if x.isdigit() else 0 for x in p.name.split("."))

    return max(candidates, key=key) if candidates else None


def _tfds_documents(cfg: DataConfig, split: str) -> list[str]:
    name = str(cfg.tfds_name)
    data_dir = tfds_data_dir(cfg)
    remote = "://" in data_dir
    # Without TensorFlow nothing can prepare or read the data: say so before "not prepared".
    require_seqio(f"data.source='tfds' ({name})")
    if not remote and find_prepared(name, data_dir) is None:
        base = name.partition(":")[0]
        raise DataError(
            f"TFDS dataset {name!r} is not prepared under {data_dir!r}. Prepare it once on a "
            f"machine with network access: `tfds build {base} --data_dir {data_dir}` (or "
            "`python -m tensorflow_datasets.scripts.download_and_prepare --datasets "
            f"{base} --data_dir {data_dir}`), copy the directory here if needed, and set "
            "data.tfds_data_dir; or use data.source='text' or the built-in 'synthetic' corpus"
        )
    import seqio

    tfds_split = cfg.train_split if split == "train" else cfg.validation_split
    source = seqio.TfdsDataSource(tfds_name=name, tfds_data_dir=data_dir)
    if tfds_split not in source.splits:
        raise DataError(
            f"TFDS dataset {name!r} has no split {tfds_split!r}; it has "
            f"{', '.join(sorted(source.splits))} (set data.train_split / data.validation_split)"
        )
    ds = source.get_dataset(split=tfds_split, shuffle=False)
    if cfg.max_documents is not None:
        ds = ds.take(cfg.max_documents)
    docs = []
    for row in ds.as_numpy_iterator():
        if cfg.text_key not in row:
            raise DataError(
                f"TFDS dataset {name!r} has no feature {cfg.text_key!r} (data.text_key); "
                f"features: {', '.join(sorted(row))}"
            )
        docs.append(row[cfg.text_key].decode("utf-8", errors="replace"))
    return docs
