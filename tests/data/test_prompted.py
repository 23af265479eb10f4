"""Prompted tasks: templates over rows, the held-out check, and each architecture's features."""

import json
from pathlib import Path

import numpy as np
import pytest

from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import ExperimentConfig
from scalestudy.data import DataError
from scalestudy.data import prompted as P
from scalestudy.data.prompted_seqio import register_mixture

NLI_TEMPLATES = """\
dataset: toy
templates:
  a1: !Template
    answer_choices: Yes ||| No
    id: a1
    jinja: '{{premise}} Does it follow that "{{hypothesis}}"? ||| {{ answer_choices[label] }}'
    metadata: !TemplateMetadata
      original_task: true
    name: follow
  a2: !Template
    answer_choices: True ||| False
    id: a2
    jinja: '{{premise}} Question: {{hypothesis}}? ||| {{ answer_choices[label] }}'
    metadata: !TemplateMetadata
      original_task: true
    name: question
  a3: !Template
    answer_choices: null
    id: a3
    jinja: 'Write a sentence: ||| {{premise}}'
    metadata: !TemplateMetadata
      original_task: false
    name: generate
"""

QA_TEMPLATES = """\
templates:
  q1: !Template
    answer_choices: '{{ choices.text | join(" ||| ") }}'
    id: q1
    jinja: '{{question}} {% if kind == "only" %}(only){% endif %} ||| {{ answer_choices[label] }}'
    metadata: !TemplateMetadata
      original_task: true
    name: plain
  q2: !Template
    answer_choices: A ||| B
    id: q2
    jinja: '{% if kind == "never" %}{{question}} ||| {{ answer_choices[label] }}{% endif %}'
    metadata: !TemplateMetadata
      original_task: true
    name: conditional
"""


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def toy(tmp_path: Path) -> Path:
    """A mixture file: a QA task (trained) and an NLI task (held out), with their templates."""
    (tmp_path / "tpl").mkdir()
    (tmp_path / "tpl" / "nli.yaml").write_text(NLI_TEMPLATES)
    (tmp_path / "tpl" / "qa.yaml").write_text(QA_TEMPLATES)
    labels = ["entailment", "not_entailment"]
    _write_jsonl(
        tmp_path / "nli.jsonl",
        [
            {"premise": f"HELDOUT premise {i}.", "hypothesis": f"claim {i}", "label": labels[i % 2]}
            for i in range(20)
        ],
    )
    _write_jsonl(
        tmp_path / "qa.jsonl",
        [
            {
                "query": f"Question: what is {i} plus one",
                "options": [str(i + 1), str(i + 2)],
                "gold": i % 2,
                "meta": {"kind": "only" if i % 3 == 0 else "plain"},
            }
            for i in range(30)
        ],
    )
    (tmp_path / "mix.yaml").write_text(
        """\
name: toy
templates_dir: tpl
tasks:
  - name: qa
    cluster: closed_book_qa
    path: qa.jsonl
    templates: qa.yaml
    template_names: [plain]
    derive:
      question: "query[10:]"
      choices: "{'text': options}"
      label: "gold"
  - name: nli
    cluster: nli
    path: nli.jsonl
    templates: nli.yaml
    label_names: [entailment, not_entailment]
    eval_task: rte
"""
    )
    return tmp_path / "mix.yaml"


def test_examples_are_the_templates_rendered_over_every_row(toy: Path):
    m = P.load_mixture(toy)
    train, val = P.examples(m, "qa", "train"), P.examples(m, "qa", "validation")
    expected = {"train": [], "validation": []}
    for i in range(30):
        extra = " (only)" if i % 3 == 0 else " "
        prompt = f"what is {i} plus one{extra}".strip()
        expected["validation" if i % 10 == 0 else "train"].append(
            (prompt, " " + str(i + 1 + i % 2))
        )
    assert list(train) == expected["train"]
    assert list(val) == expected["validation"]


def test_string_labels_map_through_label_names_and_originals_only(toy: Path):
    m = P.load_mixture(toy, ["train=[nli]", "held_out_clusters=[coreference]"])
    pairs = P.examples(m, "nli", "train")
    # Two original-task templates per row (the generative one is left out by default).
    assert len(pairs) == 2 * 18
    first = [p for p in pairs if p[0].startswith("HELDOUT premise 1.")]
    assert first == [
        ('HELDOUT premise 1. Does it follow that "claim 1"?', " No"),
        ("HELDOUT premise 1. Question: claim 1?", " False"),
    ]


def test_a_held_out_task_never_enters_the_training_mixture(toy: Path):
    with pytest.raises(ConfigError, match="'nli' is in held-out cluster 'nli'"):
        P.check_mixture(P.load_mixture(toy, ["train=[qa, nli]"]))
    # The same file under another name and a training cluster is refused too.
    text = toy.read_text().replace(
        "  - name: nli\n",
        "  - name: alias\n    cluster: qa\n    path: nli.jsonl\n"
        "    templates: nli.yaml\n  - name: nli\n",
    )
    toy.write_text(text)
    with pytest.raises(ConfigError, match="'alias' reads the same data as held-out task 'nli'"):
        P.check_mixture(P.load_mixture(toy))


def test_an_empty_training_mixture_is_refused(toy: Path):
    with pytest.raises(ConfigError, match="has no training tasks"):
        P.check_mixture(P.load_mixture(toy, ["held_out_clusters=[nli, closed_book_qa]"]))
    with pytest.raises(ConfigError, match="unknown tasks"):
        P.load_mixture(toy, ["train=[nope]"])


def test_a_template_that_renders_empty_for_every_row_is_named(toy: Path):
    text = toy.read_text().replace("template_names: [plain]", "template_names: [conditional]")
    toy.write_text(text)
    with pytest.raises(DataError, match=r"\['conditional'\] render an empty prompt"):
        P.examples(P.load_mixture(toy), "qa", "train")


def test_a_template_naming_a_missing_field_is_one_clear_error(toy: Path):
    text = toy.read_text().replace('question: "query[10:]"', 'questio: "query[10:]"')
    toy.write_text(text)
    with pytest.raises(DataError, match="'question' is undefined"):
        P.examples(P.load_mixture(toy), "qa", "train")


def _cfg(arch: str) -> ExperimentConfig:
    return ExperimentConfig(
        model={"arch": arch},
        objective={"name": "plm", "plm_split": "fit", "inputs_length": 24, "targets_length": 8},
        data={"source": "seqio", "seqio_task": "prompted.toy"},
        train={"batch_size": 8},
    )


def _text(ids: np.ndarray) -> str:
    return bytes(int(i) - 3 for i in ids if i >= 3).decode("utf-8", "replace")


@pytest.mark.parametrize("arch", ["causal_decoder", "noncausal_decoder", "encoder_decoder"])
def test_each_architecture_reads_prompt_and_target_its_own_way(toy: Path, arch: str):
    from scalestudy.data.pipeline import make_iterator

    m = P.load_mixture(toy)
    cfg = _cfg(arch)
    assert register_mixture(m, cfg) == "prompted.toy"
    it = make_iterator(cfg)
    pairs = set(P.examples(m, "qa", "train"))
    seen_heldout = False
    for _ in range(4):
        b = next(it)
        for r in range(b["decoder_target_tokens"].shape[0]):
            tokens = b["decoder_target_tokens"][r]
            w = b["decoder_loss_weights"][r]
            seg = b["decoder_segment_ids"][r]
            for s in set(seg[seg > 0].tolist()):
                here = seg == s
                target = _text(tokens[here & (w > 0)])
                if arch == "encoder_decoder":
                    # The whole decoder segment is the target; the prompt is in the encoder.
                    assert (w[here] > 0).all()
                    eseg = b["encoder_segment_ids"][r]
                    prompt = _text(b["encoder_input_tokens"][r][eseg == s])
                else:
                    prompt = _text(tokens[here & (w == 0)])
                    # Loss only on the target, after the whole prompt.
                    assert (np.diff(w[here]) >= 0).all()
                    prefix = b["decoder_causal_attention"][r][here]
                    if arch == "causal_decoder":
                        assert not prefix.any()
                    else:  # bidirectional over the prompt (and the position feeding the target)
                        assert prefix.sum() == (w[here] == 0).sum() + 1
                # Prompts longer than the row keep their end (left truncation).
                assert any(t == target and p.endswith(prompt) for p, t in pairs)
                assert prompt
                seen_heldout |= "HELDOUT" in prompt + target
    it.close()
    assert not seen_heldout


def test_the_mixture_stream_resumes_exactly(toy: Path):
    from scalestudy.data.pipeline import make_iterator

    m = P.load_mixture(toy)
    cfg = _cfg("noncausal_decoder")
    register_mixture(m, cfg)
    it = make_iterator(cfg)
    next(it)
    state = it.state()
    after = [next(it) for _ in range(2)]
    it.close()
    again = make_iterator(cfg)
    again.restore(state)
    for want in after:
        got = next(again)
        assert all(np.array_equal(got[k], want[k]) for k in want)
    again.close()


def test_the_cpu_mixture_over_the_shared_sets(shared_data: Path, repo: Path):
    m = P.load_mixture(repo / "configs" / "prompted" / "t0_cpu.yaml")
    P.check_mixture(m)
    assert {t.cluster for t in m.held_out_tasks} == set(P.T0_HELD_OUT)
    assert all(t.cluster not in P.T0_HELD_OUT for t in m.train_tasks)
    rows = P.describe(m)
    assert all(r["train"] > 0 and r["validation"] > 0 for r in rows if r["role"] == "train")
