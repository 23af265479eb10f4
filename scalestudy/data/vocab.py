"""Vocabularies: seqio's ByteVocabulary (default) and SentencePiece models by path.

Both reserve 0 = padding, 1 = EOS, 2 = UNK and put `extra_ids` sentinels at the top of the
id range, counting down (`sentinel_id(vocab, 0) == vocab.vocab_size - 1`), as T5 does.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from scalestudy.config import DataConfig
from scalestudy.data import DataError

if TYPE_CHECKING:
    import seqio

_BYTE_OFFSET = 3  # ByteVocabulary ids are UTF-8 byte values + 3 (pad, eos, unk come first)


def get_vocabulary(data_cfg: DataConfig) -> seqio.Vocabulary:
    """The configured seqio vocabulary with `data_cfg.extra_ids` sentinels."""
    import seqio

    if data_cfg.vocab == "byte":
        return seqio.ByteVocabulary(extra_ids=data_cfg.extra_ids)
    path = Path(str(data_cfg.spm_path))
    if not path.is_file():
        raise DataError(
            f"data.spm_path={str(path)!r}: SentencePiece model not found; train one with "
            "`scalestudy vocab train FILES --out PATH.model` or give an existing .model file "
            "(e.g. the T5 vocabulary's spiece.model)"
        )
    vocab = seqio.SentencePieceVocabulary(str(path), extra_ids=data_cfg.extra_ids)
    try:
        vocab.load_model()
    except Exception as e:  # sentencepiece raises bare RuntimeError/OSError on bad files
        raise DataError(f"data.spm_path={str(path)!r} is not a SentencePiece model: {e}") from None
    if vocab.eos_id != 1 or vocab.pad_id != 0:
        raise DataError(
            f"data.spm_path={str(path)!r}: the model must reserve id 0 for padding and 1 for "
            f"EOS (got eos_id={vocab.eos_id}); train it with `scalestudy vocab train`"
        )
    return vocab


def check_fits(vocab: seqio.Vocabulary, model_vocab_size: int) -> None:
    """Raise DataError when the vocabulary's ids (sentinels included) exceed the model's
    embedding rows: out-of-range ids would silently read garbage and the loss diverge."""
    if vocab.vocab_size > model_vocab_size:
        kind = "byte" if type(vocab).__name__ == "ByteVocabulary" else "SentencePiece"
        raise DataError(
            f"model.vocab_size={model_vocab_size} is smaller than the {kind} vocabulary "
            f"({vocab.vocab_size} ids, data.extra_ids sentinels included); set "
            f"model.vocab_size >= {vocab.vocab_size} (a multiple of 128 suits the mesh)"
        )


def sentinel_id(vocab: seqio.Vocabulary, i: int) -> int:
    """The id of sentinel `i` (<extra_id_i>): the top of the vocabulary, counting down."""
    return vocab.vocab_size - 1 - i


def encode_documents(
    vocab: seqio.Vocabulary, documents: list[str]
) -> tuple[np.ndarray, np.ndarray]:
    """Tokenise documents into one flat int32 array plus `offsets` (len(documents) + 1)."""
    import seqio

    if isinstance(vocab, seqio.ByteVocabulary):
        # One UTF-8 encode of the whole corpus instead of a Python list per document.
        sep = "\x00"
        if any(sep in d for d in documents):
            documents = [d.replace(sep, "") for d in documents]
        blob = np.frombuffer(sep.join(documents).encode("utf-8"), dtype=np.uint8)
        is_sep = blob == 0
        ids = blob[~is_sep].astype(np.int32) + _BYTE_OFFSET
        # document k ends where the k-th separator was, minus the k separators before it
        ends = np.flatnonzero(is_sep) - np.arange(int(is_sep.sum()))
        offsets = np.concatenate([[0], ends, [ids.size]]).astype(np.int64)
        return ids, offsets
    pieces = vocab.tokenizer.encode(documents) if documents else []
    lengths = np.array([len(p) for p in pieces], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat = np.fromiter((t for p in pieces for t in p), dtype=np.int32, count=int(offsets[-1]))
    return flat, offsets


def train_sentencepiece(
    inputs: list[Path], out: Path, vocab_size: int, *, character_coverage: float = 1.0
) -> Path:
    """Train a SentencePiece unigram model on text files (seqio id layout); returns the .model.

    A model already trained from the same files (same sizes and modification times) and
    vocabulary size is reused: the fingerprint is stored beside it as `<out>.sha`.
    """
    import sentencepiece as spm

    missing = [str(p) for p in inputs if not Path(p).exists()]
    if missing:
        raise DataError(f"vocab train: input files not found: {', '.join(missing)}")
    files = sorted(
        str(f) for p in inputs for f in ([p] if Path(p).is_file() else Path(p).rglob("*.txt"))
    )
    if not files:
        raise DataError(f"vocab train: no .txt files in {', '.join(map(str, inputs))}")
    if vocab_size < 8:
        raise DataError(f"vocab train: --vocab-size must be >= 8, got {vocab_size}")
    out = Path(out)
    if out.is_dir():
        raise DataError(
            f"vocab train: --out {out} is a directory; give the model's file name, e.g. "
            f"{out / 'spm.model'}"
        )
    if out.suffix != ".model":
        out = out.with_suffix(".model")
    stamp = hashlib.sha256(
        repr((vocab_size, [(f, os.path.getsize(f), os.path.getmtime(f)) for f in files])).encode()
    ).hexdigest()
    stamp_file = out.with_suffix(".model.sha")
    if out.is_file() and stamp_file.is_file() and stamp_file.read_text() == stamp:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        spm.SentencePieceTrainer.train(
            input=files,
            model_prefix=str(out.with_suffix("")),
            vocab_size=vocab_size,
            model_type="unigram",
            character_coverage=character_coverage,
            pad_id=0,
            eos_id=1,
            unk_id=2,
            bos_id=-1,
            input_sentence_size=2_000_000,
            shuffle_input_sentence=True,
            train_extremely_large_corpus=False,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise DataError(f"vocab train: SentencePiece training failed: {e}") from None
    stamp_file.write_text(stamp)
    return out
