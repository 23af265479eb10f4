"""BLiMP: sentences scored whole with no context on every architecture, equal to an
independent log-probability sum; breakdowns; the paper's models beside ours."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from scalestudy.config.eval_config import TaskConfig
from scalestudy.config.experiment import ExperimentConfig
from scalestudy.data.objectives import EOS_ID
from scalestudy.data.vocab import get_vocabulary, sentinel_id
from scalestudy.evaluate import blimp, rank
from scalestudy.evaluate.generic import generic_task
from scalestudy.evaluate.tasks import load_task
from scalestudy.models.api import build_model

PAIRS = {
    ("island_a", "island_effects", "syntax"): [
        ("Who should Derek hug after shocking Richard?", "Who should Derek hug Richard after?"),
        ("What had Theresa walked through?", "What had Theresa walked through it?"),
        ("Who did Amy see?", "Who Amy did see?"),
    ],
    ("agree_b", "anaphor_agreement", "morphology"): [
        ("Katherine can't help herself.", "Katherine can't help himself."),
        ("Many teenagers were helping themselves.", "Many teenagers were helping herself."),
    ],
}


def write_release(root: Path) -> Path:
    for (uid, term, field), pairs in PAIRS.items():
        rows = [
            {"sentence_good": g, "sentence_bad": b, "UID": uid, "linguistics_term": term}
            | {"field": field, "pairID": str(i)}
            for i, (g, b) in enumerate(pairs)
        ]
        (root / f"{uid}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def tiny(arch: str, objective: str) -> ExperimentConfig:
    return ExperimentConfig.model_validate(
        {
            "model": {"arch": arch, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64}
            | {"dtype": "float32"},
            "objective": {"name": objective, "inputs_length": 24, "targets_length": 8},
            "eval": {"batch_size": 8},
        }
    )


def independent_logprobs(
    cfg, model, params, sentences: list[list[int]], prefix: list[int] = ()
) -> np.ndarray:
    """Sum of log p(token) over every token of each sentence, from the forward pass on
    right-padded rows that start at the decoder's start token (0), then read `prefix` (span
    corruption's sentinel) unscored; the encoder-decoder's encoder reads the form an empty
    span-corruption or prefix input takes: a lone EOS."""
    width = max(len(s) for s in sentences) + len(prefix)
    tgt = np.zeros((len(sentences), width), np.int32)
    for i, s in enumerate(sentences):
        tgt[i, : len(prefix) + len(s)] = [*prefix, *s]
    batch = {"decoder_target_tokens": tgt, "decoder_input_tokens": np.pad(tgt, ((0, 0), (1, 0)))}
    batch["decoder_input_tokens"] = batch["decoder_input_tokens"][:, :width]
    if cfg.model.is_encoder_decoder:
        batch["encoder_input_tokens"] = np.full((len(sentences), 1), EOS_ID, np.int32)
    else:
        batch["decoder_causal_attention"] = np.zeros_like(tgt)  # an empty prefix
    logp = np.asarray(jax.nn.log_softmax(model.apply(params, batch), axis=-1), np.float64)
    first = len(prefix)
    return np.array(
        [sum(logp[i, first + j, tok] for j, tok in enumerate(s)) for i, s in enumerate(sentences)]
    )


@pytest.mark.parametrize(
    "arch,objective",
    [("causal_decoder", "flm"), ("noncausal_decoder", "plm"), ("encoder_decoder", "mlm")],
)
def test_blimp_scores_equal_an_independent_computation(tmp_path, arch, objective) -> None:
    cfg = tiny(arch, objective)
    model = build_model(cfg.model)
    params = model.init(jax.random.key(3))
    task = load_task(f"blimp:{write_release(tmp_path)}")
    records: dict[str, list[dict]] = {}
    out = rank.evaluate_params(cfg, model, params, tasks=[task], records=records)
    vocab = get_vocabulary(cfg.data)
    sentences = [s for ex in task.examples for s in ex.choices]
    ours = [c["logprob"] for r in records["blimp"] for c in r["choices"]]
    # Span corruption's targets began with <extra_id_0>: it is read first, not scored.
    prefix = [sentinel_id(vocab, 0)] if objective == "mlm" else []
    expected = independent_logprobs(
        cfg, model, params, [vocab.encode(s) for s in sentences], prefix
    )
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-4)
    good_wins = expected[0::2] > expected[1::2]
    assert out["blimp/acc"] == np.mean(good_wins) and out["blimp/truncated"] == 0
    island = np.array([ex.group == "island_a" for ex in task.examples])
    assert out["blimp/island_a/acc"] == np.mean(good_wins[island])
    assert out["blimp/term/anaphor_agreement/acc"] == np.mean(good_wins[~island])
    assert out["blimp/field/syntax/acc"] == out["blimp/island_a/acc"]


def test_pair_task_by_configuration_equals_the_blimp_loader(tmp_path) -> None:
    write_release(tmp_path)
    tc = TaskConfig(
        name="blimp",
        path=str(tmp_path / "agree_b.jsonl"),
        kind="pair",
        choice_fields=("sentence_good", "sentence_bad"),
        group_field="UID",
    )
    assert generic_task(tc).examples == load_task(f"blimp:{tmp_path / 'agree_b.jsonl'}").examples
    # Each example carries the release's own id (BLiMP's pairID), to be found in the source.
    assert [e.source for e in generic_task(tc).examples] == ["0", "1"]
    without = tmp_path / "no_ids.jsonl"
    rows = [json.loads(x) for x in (tmp_path / "agree_b.jsonl").read_text().splitlines()]
    without.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "pairID"}) + "\n"
                               for r in rows))  # fmt: skip
    assert [e.source for e in load_task(f"blimp:{without}").examples] == [
        f"{without}:1",
        f"{without}:2",
    ]
    with pytest.raises(ValueError, match="kind 'pair' needs choice_fields"):
        TaskConfig(name="p", path="x.jsonl", kind="pair", choice_fields=("a",))


def test_full_release_and_the_papers_numbers(shared_data: Path, tmp_path: Path) -> None:
    root = shared_data / "eval" / "blimp"
    task = load_task("blimp", shared_data / "eval")
    assert len(task.examples) == 67_000 and len({ex.group for ex in task.examples}) == 67
    ref = blimp.read_reference(root)
    # Ours set to GPT-2's per-paradigm numbers: every mean must reproduce the paper's rows.
    results = {f"eval/blimp/{uid}/acc": r["gpt2"] for uid, r in ref["paradigm"].items()}
    rows = blimp.compare_with_reference(results, root)
    overall = rows[-1]
    assert overall["name"] == "overall" and overall["ours"] == pytest.approx(overall["gpt2"])
    for model, acc in ref["overall"]["overall"].items():
        assert overall[model] == pytest.approx(acc, abs=1e-6)
    for row in (r for r in rows if r["level"] == "term"):
        for model, acc in ref["term"][row["name"]].items():
            assert row[model] == pytest.approx(acc, abs=1e-6), (row["name"], model)
    assert "| overall | overall |" in blimp.format_table(rows)
    table = blimp.write_reference_table(results, root, tmp_path / "blimp.md")
    assert json.loads(table.with_suffix(".json").read_text()) == rows


def test_field_names_are_one_spelling_and_key_safe(shared_data: Path) -> None:
    """The release spells syntax_semantics two ways; both are one field, and no tag value holds
    a "/" (it would split `blimp/field/<field>/acc` into a deeper key)."""
    task = load_task("blimp", shared_data / "eval")
    fields = set(task.info["group_tags"]["field"].values())
    assert fields == {"morphology", "semantics", "syntax", "syntax_semantics"}
    terms = set(task.info["group_tags"]["term"].values())
    assert not any("/" in t for t in terms)
