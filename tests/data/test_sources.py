"""Sources and vocabularies: synthetic corpus, local text, real corpora, SentencePiece."""

import numpy as np
import pytest

from scalestudy.config.experiment import DataConfig, ExperimentConfig
from scalestudy.data import DataError, sources, synthetic
from scalestudy.data.pipeline import make_iterator
from scalestudy.data.vocab import encode_documents, get_vocabulary, sentinel_id, train_sentencepiece

# ----------------------------------------------------------------------------- local text


def test_text_split_modes_and_held_out_fraction(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text("one<|endoftext|>two\n<|endoftext|>\n three ")
    (d / "b.txt").write_text("line 1\n\nline 2\n")
    (d / "skip.json").write_text("{}")
    cfg = DataConfig(source="text", paths=[str(d)], validation_fraction=0.3)
    train = sources.documents(cfg, "train")
    val = sources.documents(cfg, "validation")
    assert sorted(train + val) == sorted(["one", "two", "three", "line 1\n\nline 2"])
    assert len(val) >= 1 and not set(train) & set(val)
    by_line = cfg.replace(split_by="line", validation_paths=[str(d / "b.txt")])
    assert sources.documents(by_line, "validation") == ["line 1", "line 2"]
    by_file = cfg.replace(split_by="file", validation_paths=[str(d / "b.txt")])
    assert len(sources.documents(by_file, "train")) == 2
    (tmp_path / "rows.jsonl").write_text('{"text": "first"}\n\n{"text": "second", "id": 2}\n')
    jsonl = DataConfig(source="text", paths=[str(tmp_path / "rows.jsonl")], validation_fraction=0.5)
    assert sorted(sources.documents(jsonl, "train") + sources.documents(jsonl, "validation")) == [
        "first",
        "second",
    ]
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:1: no string field 'text'"):
        sources.documents(jsonl.replace(paths=[str(tmp_path / "bad.jsonl")]), "train")
    single = DataConfig(source="text", paths=[str(d / "b.txt")], split_by="file")
    with pytest.raises(DataError, match="too few to hold out"):
        sources.documents(single, "validation")


def test_a_binary_file_is_refused_and_a_few_bytes_not_utf8_are_said(tmp_path):
    """A file that is not text is one error naming it; a text file with a stray byte trains
    on U+FFFD with one warning naming the file and the count (never silently)."""
    binary = tmp_path / "random.txt"
    binary.write_bytes(np.random.default_rng(0).bytes(4000))
    cfg = DataConfig(source="text", paths=[str(binary)], split_by="line")
    with pytest.raises(DataError, match=r"'.*random.txt' is not UTF-8 text \(\d+ of 4000 bytes"):
        sources.documents(cfg, "train")
    stray = tmp_path / "stray.txt"
    stray.write_bytes(b"".join(b"line %d of text\n" % i for i in range(200)) + b"caf\xe9\n")
    with pytest.warns(UserWarning, match=r"'.*stray.txt': 1 byte\(s\) are not UTF-8"):
        docs = sources.documents(cfg.replace(paths=[str(stray)]), "train") + sources.documents(
            cfg.replace(paths=[str(stray)]), "validation"
        )
    assert "caf\ufffd" in docs and len(docs) == 201


def test_labelled_documents_join_into_the_documents_with_their_domains(tmp_path):
    (tmp_path / "a.txt").write_text("one<|endoftext|>two<|endoftext|>three")
    (tmp_path / "b.txt").write_text("four<|endoftext|>five")
    text = DataConfig(source="text", paths=[str(tmp_path)], validation_fraction=0.4)
    synth = DataConfig(synthetic={"incontext_share": 0.3, "n_validation_documents": 40})
    for cfg in (text, synth):
        for split in sources.SPLITS:
            labelled = sources.labelled_documents(cfg, split)
            joined = [" ".join(t for _, t in doc) for doc in labelled]
            assert joined == sources.documents(cfg, split)
    held = sources.labelled_documents(text, "validation") + sources.labelled_documents(
        text, "train"
    )
    origin = {t: d for doc in held for d, t in doc}
    assert origin == {
        **{w: str(tmp_path / "a.txt") for w in ("one", "two", "three")},
        **{w: str(tmp_path / "b.txt") for w in ("four", "five")},
    }
    kinds = {d for doc in sources.labelled_documents(synth, "validation") for d, _ in doc}
    assert kinds == set(synthetic.EPISODE_KINDS)  # every episode kind, incontext too
    with pytest.raises(DataError, match="seqio"):
        sources.labelled_documents(DataConfig(source="seqio", seqio_task="x"), "validation")


def test_byte_vocabulary_equals_seqios():
    seqio = pytest.importorskip("seqio")
    vocab = get_vocabulary(DataConfig())
    theirs = seqio.ByteVocabulary(extra_ids=DataConfig().extra_ids)
    docs = ["héllo", "", "wörld\x00!", "日本語 \t\n", "\u00ff\u0100"]
    ids, offsets = encode_documents(vocab, docs)
    for k, d in enumerate(docs):
        assert list(vocab.encode(d)) == list(theirs.encode(d))
        got = ids[offsets[k] : offsets[k + 1]].tolist()
        assert got == list(theirs.encode(d.replace("\x00", "")))
    assert vocab.vocab_size == theirs.vocab_size
    assert sentinel_id(vocab, 0) == vocab.vocab_size - 1 == 358
    rng = np.random.default_rng(0)
    for _ in range(50):  # every id, EOS and sentinels included, decodes as seqio's does
        row = rng.integers(0, vocab.vocab_size, size=int(rng.integers(0, 12))).tolist()
        assert vocab.decode(row) == theirs.decode(row)


CORPORA = {
    "tinystories": ("tinystories/tinystories_train_first2316stories.txt", "delimiter", 2000),
    "gutenberg": ("gutenberg_children", "file", 60),
    "wikitext2": ("wikitext2/valid.txt", "line", 2000),
    "tinyshakespeare": ("tinyshakespeare/input.txt", "line", 20000),
}


@pytest.mark.parametrize("name", list(CORPORA))
def test_real_corpora_load_as_local_text(shared_data, name):
    rel, split_by, at_least = CORPORA[name]
    path = shared_data / "corpora" / rel
    if not path.exists():
        pytest.skip(f"{path} is absent")
    cfg = ExperimentConfig(
        data={"source": "text", "paths": [str(path)], "split_by": split_by},
        objective={"name": "plm"},
        model={"arch": "noncausal_decoder"},
    )
    docs = sources.documents(cfg.data, "train") + sources.documents(cfg.data, "validation")
    assert len(docs) >= at_least
    if name == "tinystories":
        assert not any("<|endoftext|>" in d for d in docs)
    batch = next(make_iterator(cfg, "validation"))
    assert batch["decoder_loss_weights"].sum() > 0
    assert (batch["decoder_segment_ids"] > 0).mean() > 0.5


# ----------------------------------------------------------------------------- SentencePiece


def test_sentencepiece_train_cache_and_span_corruption(tmp_path):
    text = tmp_path / "train.txt"
    text.write_text("\n".join(synthetic.story(0, "train", i) for i in range(300)))
    model = train_sentencepiece([text], tmp_path / "spm" / "tiny", vocab_size=200)
    assert model.suffix == ".model" and model.is_file()
    mtime = model.stat().st_mtime_ns
    assert train_sentencepiece([text], tmp_path / "spm" / "tiny.model", 200) == model
    assert model.stat().st_mtime_ns == mtime  # cached: not retrained
    cfg = ExperimentConfig(
        data={
            "vocab": "sentencepiece",
            "spm_path": str(model),
            "extra_ids": 20,
            "synthetic": {"n_train_documents": 100, "n_validation_documents": 10},
        },
        objective={"name": "mlm"},
        model={"arch": "encoder_decoder"},
        train={"batch_size": 4},
    )
    vocab = get_vocabulary(cfg.data)
    assert vocab.vocab_size == 220 and vocab.eos_id == 1
    b = next(make_iterator(cfg))
    tgt = b["decoder_target_tokens"][0][b["decoder_segment_ids"][0] == 1]
    assert tgt[0] == sentinel_id(vocab, 0) == 219
    sentinels = tgt[tgt >= 200]
    assert np.array_equal(sentinels, 219 - np.arange(sentinels.size))
    seqio = pytest.importorskip("seqio")
    theirs = seqio.SentencePieceVocabulary(str(model), extra_ids=20)
    assert vocab.vocab_size == theirs.vocab_size
    for doc in ["Once upon a time", "", "a dog ran. ünïcode 42", "x <extra_id_3> y"]:
        assert list(vocab.encode(doc)) == list(theirs.encode(doc))
    rng = np.random.default_rng(0)
    for _ in range(50):  # sentinels decode as UNK there and here
        row = rng.integers(0, vocab.vocab_size, size=int(rng.integers(0, 12))).tolist()
        assert vocab.decode(row) == theirs.decode(row)
    with pytest.raises(DataError, match="not found"):
        get_vocabulary(cfg.data.replace(spm_path=str(tmp_path / "none.model")))
    with pytest.raises(DataError, match="not found"):
        train_sentencepiece([tmp_path / "absent.txt"], tmp_path / "x.model", 100)
