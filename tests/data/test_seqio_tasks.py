"""seqio Tasks/Mixtures: same objective as the NumPy path, batch contract, mixtures, resume."""

import json

import numpy as np
import pytest

seqio = pytest.importorskip("seqio")
tf = pytest.importorskip("tensorflow")

from scalestudy.config.errors import ConfigError  # noqa: E402
from scalestudy.config.experiment import VALID_CELLS, ExperimentConfig  # noqa: E402
from scalestudy.config.yamlio import validate  # noqa: E402
from scalestudy.data import DataError, numpy_pipeline  # noqa: E402
from scalestudy.data.batches import DECODER_FEATURES  # noqa: E402
from scalestudy.data.objectives import EOS_ID, Objective, feature_lengths  # noqa: E402
from scalestudy.data.pipeline import make_iterator  # noqa: E402
from scalestudy.data.seqio_pipeline import get_provider  # noqa: E402
from scalestudy.data.seqio_tasks import (  # noqa: E402
    apply_objective,
    example_index,
    register_mixture,
    register_tasks,
    register_text_task,
    task_name,
)

CELLS = [(a, o) for a, objs in VALID_CELLS.items() for o in objs]
SMALL = {"synthetic": {"n_train_documents": 200, "n_validation_documents": 20}}


def cfg_for(arch="causal_decoder", name="flm", *, task=None, obj=None, data=None, batch_size=8):
    return ExperimentConfig(
        model={"arch": arch},
        objective={"name": name, "inputs_length": 24, "targets_length": 8, **(obj or {})},
        data={
            "source": "seqio",
            "seqio_task": task or task_name("synthetic", name),
            **SMALL,
            **(data or {}),
        },
        train={"batch_size": batch_size},
    )


# ----------------------------------------------------------------------------- objective


@pytest.mark.parametrize(
    "name,split", [("flm", "uniform"), ("plm", "uniform"), ("plm", "fit"), ("mlm", "uniform")]
)
def test_objective_preprocessor_equals_numpy_objective(name, split):
    cfg = cfg_for(name=name, obj={"plm_split": split})
    objective = Objective(cfg.objective, 359, extra_ids=100, seed=7)
    rng = np.random.default_rng(0)
    for _ in range(20):
        piece = rng.integers(3, 250, size=int(rng.integers(2, objective.piece_length + 1)))
        seed = rng.integers(-(2**62), 2**62, size=2)
        got = apply_objective(
            {"targets": tf.constant(piece, tf.int32)},
            (tf.constant(seed[0]), tf.constant(seed[1])),
            objective=objective,
        )
        want_inputs, want_targets = objective.example(piece.astype(np.int32), example_index(seed))
        np.testing.assert_array_equal(got["inputs"].numpy(), want_inputs)
        np.testing.assert_array_equal(got["targets"].numpy(), want_targets)
    assert example_index([1, 2]) != example_index([2, 1])


@pytest.mark.parametrize("name", ["flm", "plm"])
def test_task_pieces_equal_numpy_pieces(name):
    """Tokenize + chunk (+ EOS) in the Task cut documents exactly as the NumPy path does."""
    cfg = cfg_for(name=name)
    register_tasks(cfg, objectives=[name])
    task = seqio.get_mixture_or_task(task_name("synthetic", name))
    L = cfg.objective.decoder_length
    ds = task.get_dataset({"inputs": L, "targets": L}, "validation", shuffle=False, seed=0)
    got = [np.concatenate([ex["inputs"], ex["targets"]]) for ex in ds.as_numpy_iterator()]
    ref = numpy_pipeline.NumpyBatchIterator(
        cfg.replace(data={**cfg.data.model_dump(), "source": "synthetic"})
    )
    data_json = cfg.data.replace(source="synthetic").model_dump_json()
    obj = ref._objective
    p = numpy_pipeline._pieces(
        data_json, "validation", obj.piece_length, obj.min_piece, obj.append_eos, obj.group
    )
    want = [p.tokens[s : s + n] for s, n in zip(p.starts, p.lengths)]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert sum(int((w == EOS_ID).sum()) for w in want) == 20  # one EOS per document


# ----------------------------------------------------------------------------- contract


def check_contract(b: dict, cfg: ExperimentConfig) -> None:
    arch, name = cfg.model.arch, cfg.objective.name
    B = cfg.train.batch_size
    S, L = feature_lengths(cfg.objective, arch == "encoder_decoder")
    for k in DECODER_FEATURES:
        assert b[k].shape == (B, L) and b[k].dtype == np.int32, k
    if S:
        assert b["encoder_input_tokens"].shape == (B, S)
    seg, pos, w = b["decoder_segment_ids"], b["decoder_positions"], b["decoder_loss_weights"]
    tgt, inp, ca = (
        b["decoder_target_tokens"],
        b["decoder_input_tokens"],
        b["decoder_causal_attention"],
    )
    assert ((seg == 0) == (tgt == 0)).all()  # padding exactly where there is no token
    assert (w[seg == 0] == 0).all()
    if arch != "noncausal_decoder":
        assert not ca.any()
    n_segments = 0
    for r in range(B):
        for s in set(seg[r].tolist()) - {0}:
            n_segments += 1
            idx = np.flatnonzero(seg[r] == s)
            assert (np.diff(idx) == 1).all()  # contiguous
            np.testing.assert_array_equal(pos[r, idx], np.arange(idx.size))
            # Teacher forcing inside the segment only: never a token of another segment.
            assert inp[r, idx[0]] == 0
            np.testing.assert_array_equal(inp[r, idx[1:]], tgt[r, idx[:-1]])
            weights = w[r, idx]
            if name == "flm" or arch == "encoder_decoder":
                assert (weights == 1).all()
            else:  # loss on the targets only: a non-empty prefix without, a suffix with loss
                a = int((weights == 0).sum())
                assert 0 < a < idx.size and (weights[a:] == 1).all()
                if arch == "noncausal_decoder":  # the prefix plus the last input's position
                    np.testing.assert_array_equal(ca[r, idx], (np.arange(idx.size) <= a) * 1)
            if name == "mlm":
                targets = tgt[r, idx][a:] if arch != "encoder_decoder" else tgt[r, idx]
                assert targets[0] >= 359 - 100 and targets[-1] == EOS_ID  # sentinel ... EOS
        if arch == "encoder_decoder":
            eseg = b["encoder_segment_ids"][r]
            assert set(eseg.tolist()) - {0} == set(seg[r].tolist()) - {0}
            for s in set(eseg.tolist()) - {0}:
                idx = np.flatnonzero(eseg == s)
                np.testing.assert_array_equal(b["encoder_positions"][r, idx], np.arange(idx.size))
    assert n_segments >= B


@pytest.mark.parametrize("arch,name", CELLS, ids=[f"{a}-{o}" for a, o in CELLS])
def test_every_cell_meets_batch_contract(arch, name):
    cfg = cfg_for(arch, name)
    it = make_iterator(cfg)
    for _ in range(2):
        check_contract(next(it), cfg)
    it.close()


def test_unpacked_rows_meet_contract():
    cfg = cfg_for("noncausal_decoder", "plm", obj={"pack": False})
    it = make_iterator(cfg)
    b = next(it)
    check_contract(b, cfg)
    assert b["decoder_segment_ids"].max() == 1
    it.close()


# ----------------------------------------------------------------------------- mixtures, resume


def test_mixture_of_two_text_tasks_draws_from_both(tmp_path):
    a, z = tmp_path / "a.txt", tmp_path / "z.txt"
    a.write_text("\n".join("aaaa " * (i % 5 + 3) for i in range(60)))
    z.write_text("\n".join("zzzz " * (i % 5 + 3) for i in range(60)))
    # Each line its own document, so that short examples get packed.
    per_doc = {"pieces": "per_document"}
    base = cfg_for(data={"split_by": "line"}, obj=per_doc, batch_size=4)
    register_text_task(base, "test_seqio.a", [a])
    register_text_task(base, "test_seqio.z", [z])
    register_mixture("test_seqio.az", {"test_seqio.a": 1.0, "test_seqio.z": 1.0})
    cfg = cfg_for(task="test_seqio.az", data={"split_by": "line"}, obj=per_doc, batch_size=4)
    it = make_iterator(cfg)
    batches = [next(it) for _ in range(4)]
    for b in batches:
        check_contract(b, cfg)
    assert max(b["decoder_segment_ids"].max() for b in batches) > 1  # short lines get packed
    seen = np.concatenate([b["decoder_target_tokens"].ravel() for b in batches])
    assert (seen == ord("a") + 3).sum() > 20 and (seen == ord("z") + 3).sum() > 20
    it.close()
    with pytest.raises(DataError, match="rate"):
        register_mixture("test_seqio.bad", {"test_seqio.a": 0.0})


def test_resume_gives_the_same_next_batch():
    cfg = cfg_for("encoder_decoder", "mlm", batch_size=4)
    it = make_iterator(cfg)
    batches = [next(it) for _ in range(2)]
    state = json.loads(json.dumps(it.state()))
    third = next(it)
    again = make_iterator(cfg)
    first = next(again)
    for k in first:  # a fixed seed: the same stream from the start
        np.testing.assert_array_equal(first[k], batches[0][k])
    again.restore(state)
    resumed = next(again)
    assert set(resumed) == set(third)
    for k in third:
        np.testing.assert_array_equal(resumed[k], third[k])
    other = make_iterator(cfg.replace(train={"batch_size": 2}))
    with pytest.raises(DataError, match="different"):
        other.restore(state)
    for x in (it, again, other):
        x.close()


# ----------------------------------------------------------------------------- errors


def test_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(DataError, match=r"close matches: scalestudy\.synthetic\.mlm"):
        get_provider(cfg_for(name="mlm", task="scalestudy.synthetc.mlm"))
    with pytest.raises(DataError, match="cannot be imported"):
        get_provider(cfg_for(data={"seqio_module": "no_such_module_here"}))
    with pytest.raises(DataError, match="applies objective 'plm'"):
        get_provider(cfg_for(name="mlm", task="scalestudy.synthetic.plm"))
    with pytest.raises(DataError, match="not prepared"):
        get_provider(
            cfg_for(
                task="scalestudy.tfds.flm",
                data={"tfds_name": "c4/en:3.*", "tfds_data_dir": str(tmp_path)},
            )
        )
    with pytest.raises(ConfigError, match=r"data\.seqio_task is required"):
        validate(ExperimentConfig, {"data": {"source": "seqio"}})


def test_user_module_registrations_run(tmp_path, monkeypatch):
    (tmp_path / "my_seqio_tasks_mod.py").write_text(
        "import seqio\n"
        "seqio.MixtureRegistry.remove('mine.stories')\n"
        "seqio.MixtureRegistry.add('mine.stories', [('scalestudy.synthetic.flm', 1.0)])\n"
    )
    monkeypatch.chdir(tmp_path)
    cfg = cfg_for(task="mine.stories", data={"seqio_module": "my_seqio_tasks_mod"}, batch_size=2)
    it = make_iterator(cfg)
    check_contract(next(it), cfg)
    it.close()


@pytest.mark.parametrize("name", ["plm", "mlm"])
def test_objective_placeholder_names_each_cells_task(name):
    # One study spec, many objectives: "{objective}" resolves to the cell's own task.
    provider = get_provider(
        cfg_for("noncausal_decoder", name, task="scalestudy.synthetic.{objective}")
    )
    assert provider.name == f"scalestudy.synthetic.{name}"
