"""`scalestudy experts`: the numbers behind the pictures equal a direct count of the router's
choices, distributions sum to 1, the top tokens are right on a constructed case, and bad
input (a step never saved, an output path that is a file) is one error line (a dense run:
tests/test_bad_input.py)."""

import json
from collections import Counter

import jax
import numpy as np
import pytest

from scalestudy.analysis import experts
from scalestudy.cli import main as cli
from scalestudy.config.experiment import load_config
from scalestudy.data import pipeline
from scalestudy.data.vocab import get_vocabulary
from scalestudy.models import moe
from scalestudy.models.api import build_model
from scalestudy.train import loop
from scalestudy.train.rundir import saved_run

E, K = 4, 2
TINY = [
    "model.d_model=32",
    "model.d_ff=64",
    "model.n_heads=2",
    "model.n_layers=2",
    "model.dtype=float32",
    "model.dropout=0",
    "model.scan_layers=false",
    "objective.inputs_length=24",
    "objective.targets_length=8",
    "data.synthetic.n_train_documents=100",
    "data.synthetic.n_validation_documents=12",
    "train.batch_size=8",
    "train.steps=4",
    "train.log_every=1",
    "train.checkpoint_every=2",
    "train.eval_batches=1",
    "train.progress=false",
    "optim.learning_rate=0.01",
]
MOE = [
    "model.moe.enabled=true",
    f"model.moe.routed_experts={E}",
    f"model.moe.top_k={K}",
    "model.moe.bias_rate=0.01",
]
ROWS = 12
STRINGS = (".", " the", "zz")


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("moe_run")
    loop.train(load_config(None, [*TINY, *MOE]), workdir)
    return workdir


@pytest.fixture(scope="module")
def pictures(moe_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("pictures")
    argv = ["experts", "--workdir", str(moe_run), "--out", str(out), "--rows", str(ROWS)]
    assert cli.main([*argv, "--tokens", *STRINGS]) == 0
    return json.loads((out / "experts.json").read_text()), out


def _direct_choices(cfg, params, batch, monkeypatch):
    """Each MoE layer's choices [B, L, K], recorded from the router itself in an eager
    (unjitted) forward pass, in layer order."""
    seen = []
    route = moe.route_deepseek

    def recording(*args):
        out = route(*args)
        seen.append(np.asarray(out.expert_TK))
        return out

    monkeypatch.setattr(moe, "route_deepseek", recording)
    with jax.disable_jit():
        build_model(cfg.model).apply(params, batch)
    b, length = batch["decoder_input_tokens"].shape
    return [s.reshape(b, length, K) for s in seen]


@pytest.mark.slow  # trains a tiny run (about a minute on 2 cores)
def test_the_numbers_equal_a_direct_count_of_router_choices(moe_run, pictures, monkeypatch):
    results, out = pictures
    cfg, params, step = saved_run.restore_params(moe_run)
    assert results["step"] == step == 4
    vocab = get_vocabulary(cfg.data)
    tokens, labels, domains = experts.text_rows(cfg, vocab, ROWS)
    assert results["domains"] == domains and "incontext" not in domains
    assert {"opening", "own"} <= set(domains)  # a story read from its start
    batch = pipeline.reading_batch(cfg, tokens)
    choices = _direct_choices(cfg, params, batch, monkeypatch)
    assert len(choices) == 2
    for i, chosen_BLK in enumerate(choices):
        layer = results["layers"][f"decoder_{i}"]
        by_domain = {d: Counter() for d in domains}
        by_expert = {e: Counter() for e in range(E)}
        given = {s: Counter() for s in STRINGS}
        for r, (row, row_labels) in enumerate(zip(tokens, labels)):
            # A decoder-only row reads token j of its text at position j + 1.
            for j in range(len(row) - 1):
                token, domain = int(row[j]), domains[row_labels[j] - 1]
                picked = [int(e) for e in chosen_BLK[r, j + 1]]
                by_domain[domain].update(picked)
                for e in picked:
                    by_expert[e][token] += 1
                text = vocab.decode(row[: j + 1].tolist())
                for s in STRINGS:
                    if text.endswith(s):
                        given[s].update(picked)
        for d in domains:
            want = [by_domain[d][e] for e in range(E)]
            assert layer["domains"][d]["counts"] == want
            np.testing.assert_allclose(sum(layer["domains"][d]["share"]), 1.0, rtol=1e-12)
        assert layer["load"] == [sum(by_expert[e].values()) for e in range(E)]
        assert layer["assignments"] == K * layer["positions"] == sum(layer["load"])
        for e, entry in enumerate(layer["experts"]):
            top = by_expert[e].most_common()
            best = top[0][1]
            assert entry["top_tokens"][0]["count"] == best
            assert {t["id"] for t in entry["top_tokens"] if t["count"] == best} <= {
                t for t, c in top if c == best
            }
            for t in entry["top_tokens"]:
                assert t["count"] == by_expert[e][t["id"]]
                assert t["share"] == pytest.approx(t["count"] / entry["assignments"])
        for s in STRINGS:
            assert layer["tokens"][s]["counts"] == [given[s][e] for e in range(E)]
        assert layer["tokens"]["zz"]["positions"] == 0 and layer["tokens"]["zz"]["share"] is None
        assert layer["tokens"]["."]["positions"] > 0
        np.testing.assert_allclose(sum(layer["tokens"]["."]["share"]), 1.0)
        # Load over training, read from metrics.jsonl: one point per logged step.
        assert layer["training"]["load_max"]["steps"] == [1, 2, 3, 4]
        assert {"bias_min", "bias_max", "dropped"} <= set(layer["training"]["logged"])
    for name in ("experts_decoder_0", "experts_decoder_1"):
        assert (out / f"{name}.png").stat().st_size > 0
        assert "<svg" in (out / f"{name}.svg").read_text()[:500]


def test_top_tokens_and_strings_on_a_constructed_case():
    # One row: tokens 5 6 5 7 5 read at positions 1..5 (position 0 reads none), one expert
    # each (K = 1): 5 -> expert 0 twice and expert 1 once, 6 -> 1, 7 -> 1.
    tokens = np.array([[0, 5, 6, 5, 7, 5]])
    labels = np.array([[0, 1, 1, 2, 2, 2]])
    chosen = np.array([[[3], [0], [1], [0], [1], [1]]])
    layer = experts.count_layer(
        tokens, labels, chosen, 3, ["a", "b"], {"x": [5], "yx": [7, 5], "q": [9]},
        lambda ids: f"t{ids[0]}", top=2,
    )  # fmt: skip
    assert layer["load"] == [2, 3, 0]  # position 0 reads no token: its choice is not counted
    assert layer["domains"]["a"]["counts"] == [1, 1, 0]
    assert layer["domains"]["b"]["share"] == pytest.approx([1 / 3, 2 / 3, 0.0])
    e0, e1, e2 = layer["experts"]
    assert [t["text"] for t in e0["top_tokens"]] == ["t5"]
    assert e0["top_tokens"][0]["share"] == 1.0
    assert e0["top_tokens"][0]["lift"] == pytest.approx(1.0 / (3 / 5))
    # Expert 1: tokens 5, 6, 7 once each; ties go to the smaller id, and top=2 keeps two.
    assert [t["id"] for t in e1["top_tokens"]] == [5, 6]
    assert e2["top_tokens"] == [] and e2["share"] == 0.0
    assert layer["tokens"]["x"]["counts"] == [2, 1, 0]
    assert layer["tokens"]["yx"]["counts"] == [0, 1, 0]  # only the 5 right after a 7
    assert layer["tokens"]["q"]["share"] is None
    assert layer["mi_token_bits"] > 0


def test_reading_rows_put_each_label_where_its_token_is_read():
    cfg = load_config(None, [*TINY, "model.arch=encoder_decoder", "objective.name=plm"])
    text = np.arange(10, 40, dtype=np.int32)  # 30 ids: encoder 22, decoder 8
    labels = np.arange(1, 31, dtype=np.int32)
    f = pipeline.reading_batch(cfg, [text])
    g = pipeline.reading_batch(cfg, [labels])
    for stack in ("encoder", "decoder"):
        read, label = f[f"{stack}_input_tokens"][0], g[f"{stack}_input_tokens"][0]
        assert ((read > 0) == (label > 0)).all()
        np.testing.assert_array_equal(read[read > 0], text[label[label > 0] - 1])
    assert (f["encoder_input_tokens"][0] > 0).sum() == 22
    with pytest.raises(Exception, match="row 0 holds 1 ids"):
        pipeline.reading_batch(cfg, [text[:1]])


@pytest.mark.slow  # trains a tiny run (about a minute on 2 cores)
def test_bad_step_and_out_are_refused_before_any_work(moe_run, tmp_path, capsys):
    assert cli.main(["experts", "--workdir", str(moe_run), "--step", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--step 3" in err and "steps saved: 2, 4" in err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli.main(["experts", "--workdir", str(moe_run), "--out", str(blocker)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "expected a directory" in err
    assert cli.main(["experts", "--workdir", str(moe_run), "--tokens", ""]) == 2
    assert "--tokens" in capsys.readouterr().err


def test_a_study_report_shows_each_moe_cells_routing(moe_run, tmp_path):
    """The report's experts section measures each MoE cell's largest rung (first seed) as
    `scalestudy experts` does, shows the numbers of its experts.json, links its pictures
    relative to the report, and leaves dense runs out."""
    from scalestudy.study.record.rows import RunRow
    from scalestudy.study.report import expert_report

    def row(name, experts, active, seed, workdir):
        return RunRow.from_row({
            "name": name, "arch": "causal_decoder", "objective": "flm", "size": name[-5:-3],
            "seed": seed, "status": "done", "experts": experts, "params_active": active,
            "workdir": str(workdir),
        })  # fmt: skip

    missing = tmp_path / "nothing"
    runs = [
        row("t.causal_decoder.flm.e4.r0.s0", E, 100, 0, missing),  # a smaller rung
        row("t.causal_decoder.flm.e4.r1.s1", E, 200, 1, missing),  # a later seed
        row("t.causal_decoder.flm.e4.r1.s0", E, 200, 0, moe_run),
        row("t.causal_decoder.flm.dense.r1.s0", 1, 200, 0, missing),
    ]
    assert expert_report.measured(runs) == [runs[2]]
    lines = expert_report.section(runs, moe_run.parent)
    got = json.loads((moe_run / "experts" / experts.EXPERTS_JSON).read_text())
    table = [line for line in lines if line.startswith("| causal_decoder/flm/e4 |")]
    assert len(table) == len(got["layers"]) >= 1
    for line, (name, layer) in zip(table, sorted(got["layers"].items()), strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[2] == name and float(cells[3]) == pytest.approx(layer["load_max"], abs=5e-3)
        assert float(cells[5]) == pytest.approx(layer["mi_domain_bits"], abs=5e-4)
        dropped = layer["training"]["dropped"]["values"][-1]
        assert float(cells[4]) == pytest.approx(dropped, abs=5e-4)
    links = [line for line in lines if line.startswith("![")]
    assert links == [
        f"![causal_decoder/flm/e4: {n}]({moe_run.name}/experts/experts_{n}.png)"
        for n in sorted(got["layers"])
    ]
    # A run that cannot be measured is named with the reason; the section is still written.
    runs[2] = runs[2].replace(workdir=str(missing))
    lines = expert_report.section(runs, tmp_path)
    assert any("not measured:" in line and "e4" in line for line in lines)
    assert expert_report.section([runs[3]], tmp_path) == []
