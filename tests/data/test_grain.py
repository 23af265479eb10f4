"""The Grain source: Parquet, saved Hugging Face datasets and ArrayRecord give the batches the
same documents give as a .jsonl file; exact resume; per-process shards; no TensorFlow."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("grain")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

from scalestudy.config.errors import ConfigError  # noqa: E402
from scalestudy.config.experiment import ExperimentConfig, load_config  # noqa: E402
from scalestudy.config.yamlio import validate  # noqa: E402
from scalestudy.data import DataError, grain_source, numpy_pipeline, sources, synthetic  # noqa: E402
from scalestudy.data.pipeline import make_iterator  # noqa: E402
from scalestudy.train import loop  # noqa: E402
from scalestudy.train.rundir import layout as rundir  # noqa: E402

# Stories of varied lengths, an empty and a blank row (dropped by every source alike).
DOCS = [synthetic.story(0, "train", i) for i in range(120)] + ["", "   "]


def write_corpus(tmp_path) -> dict:
    """The same documents as .jsonl, Parquet (several row groups, an extra column), a saved
    Hugging Face Dataset and ArrayRecord (JSON records); {kind: path}."""
    from array_record.python.array_record_module import ArrayRecordWriter

    paths = {k: tmp_path / name for k, name in [
        ("jsonl", "docs.jsonl"), ("parquet", "docs.parquet"), ("hf", "hf_saved"),
        ("array_record", "docs.array_record"),
    ]}  # fmt: skip
    paths["jsonl"].write_text(
        "\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS))
    )
    table = pa.table({"id": list(range(len(DOCS))), "text": DOCS})
    pq.write_table(table, paths["parquet"], row_group_size=16)
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(paths["hf"]))
    writer = ArrayRecordWriter(str(paths["array_record"]), "group_size:1")
    for d in DOCS:
        writer.write(json.dumps({"text": d}).encode())
    writer.close()
    return paths


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("grain_corpus"))


def cfg_for(data: dict, arch="causal_decoder", name="flm", batch_size=8) -> ExperimentConfig:
    return ExperimentConfig(
        model={"arch": arch},
        objective={"name": name, "inputs_length": 24, "targets_length": 8},
        data=data,
        train={"batch_size": batch_size},
    )


def assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("kind", ["parquet", "hf", "array_record"])
@pytest.mark.parametrize(("arch", "name"), [("causal_decoder", "flm"), ("encoder_decoder", "mlm")])
def test_the_same_documents_give_the_batches_of_a_jsonl_file(corpus, kind, arch, name):
    text = make_iterator(cfg_for({"source": "text", "paths": [str(corpus["jsonl"])]}, arch, name))
    grain = make_iterator(cfg_for({"source": "grain", "paths": [str(corpus[kind])]}, arch, name))
    for _ in range(3):
        a, b = next(text), next(grain)
        assert (a["decoder_loss_weights"].sum(axis=1) > 0).all()  # real rows, not padding
        assert_same(a, b)
    for split in ("train", "validation"):  # the same held-out documents
        assert sources.documents(text.cfg.data, split) == sources.documents(grain.cfg.data, split)


def test_loose_json_lines_by_datasets_builder_and_null_cells(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    text = cfg_for({"source": "text", "paths": [str(corpus["jsonl"])]}).data
    loose = cfg_for({"source": "grain", "paths": [str(corpus["jsonl"])]}).data
    assert sources.documents(loose, "train") == sources.documents(text, "train")
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": ["a story", None, "another"]}), nulls)
    got = sources.documents(cfg_for({"source": "grain", "paths": [str(nulls)]}).data, "train")
    assert sorted(got + sources.documents(
        cfg_for({"source": "grain", "paths": [str(nulls)]}).data, "validation"
    )) == ["a story", "another"]  # fmt: skip


def test_a_directory_of_parquet_shards_beside_other_files(tmp_path):
    shards = tmp_path / "snapshot" / "data"
    shards.mkdir(parents=True)
    (tmp_path / "snapshot" / "README.md").write_text("# a dataset card")  # not data: ignored
    pq.write_table(pa.table({"text": DOCS[:60]}), shards / "train-00000-of-00002.parquet")
    pq.write_table(pa.table({"text": DOCS[60:]}), shards / "train-00001-of-00002.parquet")
    data = {"paths": [str(tmp_path / "snapshot")], "validation_fraction": 0.1}
    one = cfg_for({"source": "grain", **data}).data
    whole = tmp_path / "whole.parquet"
    pq.write_table(pa.table({"text": DOCS}), whole)
    ref = cfg_for({"source": "grain", "paths": [str(whole)], "validation_fraction": 0.1}).data
    for split in ("train", "validation"):
        assert sources.documents(one, split) == sources.documents(ref, split)
    (tmp_path / "snapshot" / "extra.array_record").write_bytes(b"")
    with pytest.raises(DataError, match="2 kinds of data files"):
        sources.documents(one, "train")


def test_exact_resume_and_two_process_shards(corpus):
    cfg = cfg_for({"source": "grain", "paths": [str(corpus["parquet"])]})
    straight = make_iterator(cfg)
    batches = [next(straight) for _ in range(6)]
    assert not np.array_equal(
        batches[0]["decoder_target_tokens"], batches[1]["decoder_target_tokens"]
    )
    first = make_iterator(cfg)
    for _ in range(3):
        next(first)
    state = json.loads(json.dumps(first.state()))  # as the checkpoint keeps it
    halves = [make_iterator(cfg, process_index=i, process_count=2) for i in range(2)]
    for h in halves:
        h.restore(state)
    for b in batches[3:]:
        parts = [next(h) for h in halves]
        for k in b:
            np.testing.assert_array_equal(b[k], np.concatenate([p[k] for p in parts]), err_msg=k)


def test_a_state_restores_only_into_the_same_files(tmp_path):
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": DOCS}), path)
    cfg = cfg_for({"source": "grain", "paths": [str(path)]})
    it = make_iterator(cfg)
    next(it)
    state = it.state()
    pq.write_table(pa.table({"text": DOCS + DOCS[:30]}), path)  # rewritten: more rows
    # A resume is a new process: forget this one's cached corpus as a fresh process would.
    numpy_pipeline._pieces.cache_clear()
    numpy_pipeline._encoded.cache_clear()
    with pytest.raises(DataError, match=r"different data.*the same files"):
        make_iterator(cfg).restore(state)


TINY = [
    "model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.n_layers=1",
    "model.dropout=0.1", "objective.inputs_length=24", "objective.targets_length=8",
    "train.batch_size=8", "train.steps=6", "train.log_every=1", "train.checkpoint_every=3",
    "train.eval_batches=1", "train.progress=false", "optim.learning_rate=0.01",
]  # fmt: skip


def test_a_resumed_run_reads_what_the_straight_run_read(corpus, tmp_path):
    """6 steps straight == 3 steps, a new process's resume, 3 more (losses bit for bit)."""
    data = ["data.source=grain", f"data.paths=[{corpus['parquet']}]"]
    cfg = lambda stop: load_config(None, [*TINY, *data, f"train.stop_after_steps={stop}"])

    def losses(workdir):
        return [r["train/loss"] for r in rundir.read_metrics(workdir) if "train/loss" in r]

    ref = loop.train(cfg(6), tmp_path / "straight")
    loop.train(cfg(3), tmp_path / "resumed")
    resumed = loop.train(cfg(6), tmp_path / "resumed")
    assert len(losses(tmp_path / "straight")) == 6
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    for key in ("tokens", "document_tokens", "final_val_loss", "steps"):
        assert resumed[key] == ref[key], key


def test_array_record_text_records_and_a_format_by_key(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    path = tmp_path / "records.bin"  # no extension: the format comes from data.grain_format
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for record in [b"plain text one", b'{"body": "json body"}', "caf\u00e9 two".encode()]:
        writer.write(record)
    writer.close()
    cfg = cfg_for(
        {
            "source": "grain",
            "paths": [str(path)],
            "grain_format": "array_record",
            "text_key": "body",
        }
    ).data
    got, own_splits = grain_source.read(cfg.paths, cfg, "train", "data.paths")
    assert got == ["plain text one", "json body", "caf\u00e9 two"] and not own_splits
    with pytest.raises(DataError, match=r"no extension data.source='grain' knows"):
        sources.documents(cfg.model_copy(update={"grain_format": "auto"}), "train")


def test_a_saved_dataset_dict_brings_its_splits(tmp_path):
    saved = tmp_path / "dict"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": DOCS[:50]}),
         "dev": datasets.Dataset.from_dict({"text": DOCS[50:60]})}
    ).save_to_disk(str(saved))  # fmt: skip
    data = cfg_for({"source": "grain", "paths": [str(saved)], "validation_split": "dev"}).data
    assert sources.documents(data, "train") == DOCS[:50]
    assert sources.documents(data, "validation") == DOCS[50:60]
    with pytest.raises(DataError, match="no split 'validation'; it has train, dev"):
        sources.documents(data.model_copy(update={"validation_split": "validation"}), "validation")


def test_bad_input_says_what_is_wrong(corpus, tmp_path):
    with pytest.raises(DataError, match=r"no column 'body' \(data.text_key\); columns: id, text"):
        sources.documents(cfg_for({"source": "grain", "paths": [str(corpus["parquet"])],
                                   "text_key": "body"}).data, "train")  # fmt: skip
    with pytest.raises(DataError, match=r"data.source='text' does not read; read it with data.sou"):
        sources.documents(
            cfg_for({"source": "text", "paths": [str(corpus["parquet"])]}).data, "train"
        )
    with pytest.raises(ConfigError, match=r"data.source='synthetic' reads a built-in corpus"):
        validate(ExperimentConfig, {"data": {"paths": [str(corpus["parquet"])]}})
    with pytest.raises(ConfigError, match=r"data.paths is empty but data.source='grain'"):
        validate(ExperimentConfig, {"data": {"source": "grain"}})
    with pytest.raises(DataError, match="does not exist"):
        sources.documents(
            cfg_for({"source": "grain", "paths": [str(tmp_path / "no.parquet")]}).data, "train"
        )
    numbers = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), numbers)
    with pytest.raises(DataError, match="is int, not text"):
        sources.documents(cfg_for({"source": "grain", "paths": [str(numbers)]}).data, "train")


BLOCKED = ("tensorflow", "seqio", "tensorflow_datasets")

CHILD = textwrap.dedent(
    """
    import json, sys
    for name in {blocked!r}:
        sys.modules[name] = None
    from scalestudy.cli.main import main

    small = {small!r}
    codes = {{}}
    for kind, path in {paths!r}.items():
        codes[kind] = main(["train", "--config", "configs/experiments/synthetic_tiny.yaml",
                            "--workdir", f"{tmp}/{{kind}}", "data.source=grain",
                            f"data.paths=[{{path}}]", "train.steps=2", *small])
    codes["tfds"] = main(["train", "--config", "configs/experiments/synthetic_tiny.yaml",
                          "--workdir", "{tmp}/tfds", "data.source=tfds", "data.tfds_name=lm1b",
                          "data.tfds_data_dir={tmp}", "train.steps=2", *small])
    loaded = [m for m in {blocked!r} if sys.modules.get(m) is not None]
    print("RESULT", json.dumps({{"codes": codes, "loaded": loaded}}))
    """
)


@pytest.mark.xdist_group("no_tensorflow")
def test_parquet_and_a_saved_dataset_train_without_tensorflow(corpus, tmp_path):
    small = [t for t in TINY if not t.startswith("train.steps")]
    paths = {"parquet": str(corpus["parquet"]), "hf": str(corpus["hf"])}
    code = CHILD.format(blocked=BLOCKED, small=small, paths=paths, tmp=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["codes"] == {"parquet": 0, "hf": 0, "tfds": 2}, proc.stderr[-3000:]
    assert result["loaded"] == []
    # Without TensorFlow, tfds says what is missing, not "not prepared".
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert any("needs seqio, tensorflow, tensorflow_datasets" in e for e in errors), errors
    assert not any("not prepared" in e for e in errors), errors
    for kind in paths:
        summary = json.loads((tmp_path / kind / "summary.json").read_text())
        assert summary["steps"] == 2 and summary["final_val_loss"] > 0


def test_the_data_bench_measures_the_grain_corpus_against_the_step(corpus):
    from scalestudy.bench.data import bench

    cfg = load_config(None, [*TINY, "data.source=grain", f"data.paths=[{corpus['parquet']}]"])
    out = bench(cfg, steps=2)
    n_train = len(sources.documents(cfg.data, "train"))
    assert out["documents"] == n_train and n_train < len([d for d in DOCS if d.strip()])
    assert out["cell"] == "flm/causal_decoder" and out["corpus_tokens"] > 0
    assert out["batches_per_s"] > 0 and out["train_step_ms"] > 0
    # data_share is a batch's time over a step's: both rates say the same ratio.
    share = out["train_steps_per_s"] / out["batches_per_s"]
    assert out["data_share"] == pytest.approx(share, rel=0.1)
