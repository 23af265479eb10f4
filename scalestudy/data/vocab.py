"""Vocabularies: bytes (default) and SentencePiece models by path, without TensorFlow.

Both reserve 0 = padding, 1 = EOS, 2 = UNK and put `extra_ids` sentinels at the top of the
id range, counting down (`sentinel_id(vocab, 0) == vocab.vocab_size - 1`), as T5 does. The
ids are seqio's (`seqio.ByteVocabulary`, `seqio.SentencePieceVocabulary`; tested equal), but
the classes here import neither seqio nor TensorFlow, so training, evaluation and benchmarks
on these vocabularies run on a host without them (a CUDA host, say). `seqio_vocabulary`
gives seqio's own object, for seqio tasks, which need TensorFlow anyway.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from scalestudy.config.errors import not_found, path_kind
from scalestudy.config.experiment import DataConfig
from scalestudy.data import DataError

if TYPE_CHECKING:
    import seqio

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
_BYTE_OFFSET = 3  # byte ids are UTF-8 byte values + 3 (pad, eos, unk come first)


class _Vocabulary:
    """What the package uses of a vocabulary: ids of text and text of ids (seqio's rules)."""

    pad_id, eos_id, unk_id = PAD_ID, EOS_ID, UNK_ID
    bos_id = None
    vocab_size: int  # every id, sentinels included
    extra_ids: int
    _decodable: int  # ids at or above decode as UNK

    def encode(self, s: str) -> list[int]:
        raise NotImplementedError

    def _decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        """Text up to the first EOS; ids past the decodable range read as UNK (as seqio)."""
        clean = [self.unk_id if int(i) >= self._decodable else int(i) for i in ids]
        if self.eos_id in clean:
            clean = clean[: clean.index(self.eos_id) + 1]
        return self._decode(clean)


class ByteVocabulary(_Vocabulary):
    """UTF-8 bytes as ids 3..258 (ByT5's vocabulary); `extra_ids` sentinels above them, which
    decode to nothing."""

    def __init__(self, extra_ids: int = 0):
        self.extra_ids = int(extra_ids)
        self._decodable = 256 + _BYTE_OFFSET
        self.vocab_size = self._decodable + self.extra_ids

    def encode(self, s: str | bytes) -> list[int]:
        data = s if isinstance(s, bytes) else s.encode("utf-8")
        return [b + _BYTE_OFFSET for b in data]

    def _decode(self, ids: list[int]) -> str:
        data = bytes(i - _BYTE_OFFSET for i in ids if _BYTE_OFFSET <= i < self._decodable)
        return data.decode("utf-8", errors="ignore")


class SentencePieceVocabulary(_Vocabulary):
    """A SentencePiece model (ids 0/1/2 = pad/eos/unk) with `extra_ids` sentinels appended as
    user-defined pieces "<extra_id_i>", i counting down, so text and sentinels encode and
    decode as in seqio (the model proto is edited in memory; the file is only read)."""

    def __init__(self, path: str | Path, extra_ids: int = 0):
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2 as pb

        self.path, self.extra_ids = str(path), int(extra_ids)
        proto = pb.ModelProto.FromString(Path(path).read_bytes())
        for i in range(self.extra_ids - 1, -1, -1):  # <extra_id_0> ends up at the top
            proto.pieces.add(
                piece=f"\u2581<extra_id_{i}>",
                score=0.0,
                type=pb.ModelProto.SentencePiece.USER_DEFINED,
            )
        self.tokenizer = spm.SentencePieceProcessor()
        self.tokenizer.LoadFromSerializedProto(proto.SerializeToString())
        self.vocab_size = self._decodable = int(self.tokenizer.GetPieceSize())
        self.eos_id, self.unk_id = int(self.tokenizer.eos_id()), int(self.tokenizer.unk_id())
        self.pad_id = int(self.tokenizer.pad_id())

    def encode(self, s: str) -> list[int]:
        return list(self.tokenizer.EncodeAsIds(s))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.DecodeIds(ids)


Vocabulary = ByteVocabulary | SentencePieceVocabulary


def _spm_path(data_cfg: DataConfig) -> Path:
    path = Path(str(data_cfg.spm_path))
    if path.exists() and not path.is_file():  # a folder is not "not found": say what it is
        raise DataError(
            f"data.spm_path={str(path)!r} is {path_kind(path)}; expected a SentencePiece "
            ".model file (e.g. the T5 vocabulary's spiece.model)"
        )
    if not path.is_file():
        raise DataError(
            f"data.spm_path={str(path)!r}: SentencePiece model not found; train one with "
            "`scalestudy vocab train FILES --out PATH.model` or give an existing .model file "
            "(e.g. the T5 vocabulary's spiece.model)"
        )
    return path


def get_vocabulary(data_cfg: DataConfig) -> Vocabulary:
    """The configured vocabulary with `data_cfg.extra_ids` sentinels (no TensorFlow)."""
    if data_cfg.vocab == "byte":
        return ByteVocabulary(extra_ids=data_cfg.extra_ids)
    path = _spm_path(data_cfg)
    try:
        vocab = SentencePieceVocabulary(path, extra_ids=data_cfg.extra_ids)
    except Exception as e:  # sentencepiece raises bare RuntimeError/OSError on bad files
        raise DataError(f"data.spm_path={str(path)!r} is not a SentencePiece model: {e}") from None
    if vocab.eos_id != EOS_ID or vocab.pad_id != PAD_ID:
        raise DataError(
            f"data.spm_path={str(path)!r}: the model must reserve id 0 for padding and 1 for "
            f"EOS (got eos_id={vocab.eos_id}); train it with `scalestudy vocab train`"
        )
    return vocab


def seqio_vocabulary(data_cfg: DataConfig) -> seqio.Vocabulary:
    """seqio's own vocabulary with the same ids, for seqio tasks (imports TensorFlow)."""
    import seqio

    get_vocabulary(data_cfg)  # the same checks, with the same messages
    if data_cfg.vocab == "byte":
        return seqio.ByteVocabulary(extra_ids=data_cfg.extra_ids)
    return seqio.SentencePieceVocabulary(str(_spm_path(data_cfg)), extra_ids=data_cfg.extra_ids)


def check_fits(vocab: Vocabulary | Any, model_vocab_size: int) -> None:
    """Raise DataError when the vocabulary's ids (sentinels included) exceed the model's
    embedding rows: out-of-range ids would silently read garbage and the loss diverge."""
    if vocab.vocab_size > model_vocab_size:
        kind = "byte" if type(vocab).__name__ == "ByteVocabulary" else "SentencePiece"
        raise DataError(
            f"model.vocab_size={model_vocab_size} is smaller than the {kind} vocabulary "
            f"({vocab.vocab_size} ids, data.extra_ids sentinels included); set "
            f"model.vocab_size >= {vocab.vocab_size} (a multiple of 128 suits the mesh)"
        )


def sentinel_id(vocab: Vocabulary | Any, i: int) -> int:
    """The id of sentinel `i` (<extra_id_i>): the top of the vocabulary, counting down."""
    return vocab.vocab_size - 1 - i


def encode_pair(
    vocab: Vocabulary | Any, context: str, continuation: str, *, joint: bool
) -> tuple[list[int], list[int]]:
    """(context, continuation) tokens as lm-evaluation-harness tokenises a scored pair.

    Whitespace ending the context moves to the front of the continuation: a word boundary
    belongs to the word after it, as a tokeniser that marks it (SentencePiece's "▁") reads
    it. `joint` (a model that reads both in one stream): the continuation is what encoding the
    whole text adds past the context's own tokens, so that it is tokenised as the model saw
    such text in training; else each part is encoded on its own. On the byte vocabulary both
    ways give the bytes of each part.
    """
    stripped = context.rstrip()
    moved = context[len(stripped) :]
    context, continuation = stripped, moved + continuation
    context_ids = list(vocab.encode(context)) if context else []
    if not joint or not context:
        return context_ids, list(vocab.encode(continuation))
    whole = list(vocab.encode(context + continuation))
    return context_ids, whole[len(context_ids) :]


def encode_documents(vocab: Vocabulary, documents: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Tokenise documents into one flat int32 array plus `offsets` (len(documents) + 1)."""
    if isinstance(vocab, ByteVocabulary):
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

    for p in inputs:
        if not (Path(p).is_file() or Path(p).is_dir()):
            raise DataError(not_found(p, "vocab train: input", "a text file or a directory"))
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
    made = [p for p in reversed(out.parents) if not p.exists()]  # removed again on failure
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
        for p in reversed(made):  # a refused command leaves the disk as it found it
            with contextlib.suppress(OSError):
                p.rmdir()
        raise DataError(f"vocab train: SentencePiece training failed: {e}") from None
    stamp_file.write_text(stamp)
    return out
