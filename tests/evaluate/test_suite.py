"""The rest of Wang et al.'s evaluation suite, read from tiny files in each release's format
(ANLI, StoryCloze, ARC-Challenge, OpenBookQA, SciQ, GLUE): harness prompts, gold labels, no
example cap."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from scalestudy.evaluate.formats import TaskDataError
from scalestudy.evaluate.prompts import BUILDERS
from scalestudy.evaluate.tasks import REGISTRY, load_task


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _table(path: Path, header: list[str], rows: list[list[str]], sep: str) -> None:
    """A header and rows, CSV-quoted as released (sep ",") or tab-separated unquoted (GLUE)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if sep != ",":
        path.write_text("".join(sep.join(r) + "\n" for r in [header, *rows]))
        return
    with path.open("w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows([header, *rows])


def _ai2(key: str) -> dict:
    texts = ["a rock", "a plant", "a cloud", "a river"]
    return {
        "id": "Mercury_1",
        "question": {
            "stem": "Which one grows?",
            "choices": [{"text": t, "label": "ABCD"[i]} for i, t in enumerate(texts)],
        },
        "answerKey": key,
    }


@pytest.fixture
def release(tmp_path: Path) -> Path:
    anli = {"uid": "u", "context": "A dog ran.", "hypothesis": "An animal moved", "label": "c"}
    for r in (1, 2):
        _jsonl(tmp_path / f"anli/R{r}/dev.jsonl", [anli, {**anli, "label": "e"}])
    _jsonl(tmp_path / "anli/R3/dev.jsonl", [{**anli, "label": "n"}] * 1200)
    _table(
        tmp_path / "story_cloze/cloze_test_val__spring2016 - cloze_test_ALL_val.csv",
        [
            "InputStoryid",
            *(f"InputSentence{i}" for i in range(1, 5)),
            *("RandomFifthSentenceQuiz1", "RandomFifthSentenceQuiz2", "AnswerRightEnding"),
        ],
        [["id1", "Ann woke.", "She ate.", '"Hi," she said.', "She left.", "Bye.", "No.", "2"]],
        ",",
    )
    _jsonl(tmp_path / "arc_challenge/ARC-Challenge-Test.jsonl", [_ai2("B")])
    _jsonl(tmp_path / "openbookqa/Main/test.jsonl", [_ai2("D")])
    sciq = {"question": "What falls?", "support": "Rain falls.", "correct_answer": "rain"}
    sciq |= {"distractor1": "sun", "distractor2": "moon", "distractor3": "star"}
    (tmp_path / "sciq").mkdir()
    (tmp_path / "sciq/test.json").write_text(json.dumps([sciq]))
    glue = tmp_path / "glue"
    head = ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"]
    _table(glue / "MRPC/dev.tsv", head, [["1", "1", "2", "He won.", "He was the winner."]], "\t")
    _table(
        glue / "QNLI/dev.tsv",
        ["index", "question", "sentence", "label"],
        [["0", "Who won?", "Ann won.", "entailment"], ["1", "Why?", "No.", "not_entailment"]],
        "\t",
    )
    _table(glue / "SST-2/dev.tsv", ["sentence", "label"], [['a "great" film ', "1"]], "\t")
    _table(
        glue / "WNLI/dev.tsv",
        ["index", "sentence1", "sentence2", "label"],
        [["0", "A.", "B.", "0"]],
        "\t",
    )
    head = ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"]
    _table(glue / "QQP/dev.tsv", head, [["0", "1", "2", "How?", "How so?", "1"]], "\t")
    pubmed = {"QUESTION": "Does it work?", "CONTEXTS": ["We tried.", "It did."]}
    (tmp_path / "pubmedqa").mkdir()
    (tmp_path / "pubmedqa/ori_pqal.json").write_text(
        json.dumps({"123": {**pubmed, "final_decision": "maybe", "LONG_ANSWER": "Maybe."}})
    )
    math = {"Problem": "what is 2 + 2 ?", "Rationale": "", "correct": "c"}
    math["options"] = "a ) 3 , b ) 5.5 , c ) 4 , d ) 1 , e ) none of these"
    (tmp_path / "mathqa").mkdir()
    (tmp_path / "mathqa/test.json").write_text(json.dumps([math]))
    (tmp_path / "logiqa").mkdir()
    record = "\nb\nAll cats purr.\nWhich is true?\nA.Dogs purr.\nB.Cats purr.\nC.No one.\nD.Fish.\n"
    (tmp_path / "logiqa/Test.txt").write_text(record * 2)
    return tmp_path


def test_pubmedqa_mathqa_logiqa(release: Path) -> None:
    pubmed = load_task("pubmedqa", release).examples[0]
    assert pubmed.contexts == ("Abstract: We tried.\nIt did.\nQuestion: Does it work?\nAnswer:",)
    assert pubmed.choices == ("yes", "no", "maybe") and pubmed.gold == 2
    math = load_task("mathqa", release).examples[0]
    assert math.choices == ("3", "5.5", "4", "1", "none of these") and math.gold == 2
    logiqa = load_task("logiqa", release).examples
    assert len(logiqa) == 2 and logiqa[0].gold == 1 and logiqa[0].choices[1] == "Cats purr."
    assert (
        logiqa[0]
        .contexts[0]
        .endswith("Choices:\nA. Dogs purr.\nB. Cats purr.\nC. No one.\nD. Fish.\nAnswer:")
    )


def test_every_registered_task_has_a_prompt() -> None:
    assert set(REGISTRY) <= set(BUILDERS)


def test_anli_rounds_and_no_example_cap(release: Path) -> None:
    r1 = load_task("anli_r1", release)
    first = r1.examples[0]
    assert first.contexts == (
        "A dog ran.\nQuestion: An animal moved True, False, or Neither?\nAnswer:",
    )
    assert first.choices == ("True", "Neither", "False") and first.gold == 2
    assert r1.examples[1].gold == 0 and load_task("anli_r2", release).examples[1].gold == 0
    r3 = load_task("anli_r3", release)
    assert len(r3.examples) == 1200 and {e.gold for e in r3.examples} == {1}  # not capped


def test_story_cloze_arc_challenge_openbookqa_sciq(release: Path) -> None:
    story = load_task("story_cloze", release).examples[0]
    assert story.contexts == ('Ann woke. She ate. "Hi," she said. She left.',)
    assert story.choices == ("Bye.", "No.") and story.gold == 1
    arc = load_task("arc_challenge", release)
    assert arc.metric == "acc_norm"
    assert arc.examples[0].contexts == ("Question: Which one grows?\nAnswer:",)
    assert arc.examples[0].choices[arc.examples[0].gold] == "a plant"
    obqa = load_task("openbookqa", release).examples[0]
    assert obqa.contexts == ("Which one grows?",) and obqa.gold == 3
    sciq = load_task("sciq", release).examples[0]
    assert sciq.contexts == ("Rain falls.\nQuestion: What falls?\nAnswer:",)
    assert sciq.choices == ("sun", "moon", "star", "rain") and sciq.gold == 3


def test_glue_tasks(release: Path) -> None:
    mrpc = load_task("mrpc", release).examples[0]
    assert mrpc.contexts[0].startswith("Sentence 1: He won.\nSentence 2: He was the winner.\n")
    assert mrpc.choices == ("no", "yes") and mrpc.gold == 1
    qnli = load_task("qnli", release).examples
    assert [e.gold for e in qnli] == [0, 1] and qnli[0].choices == ("yes", "no")
    sst2 = load_task("sst2", release).examples[0]
    assert sst2.contexts[0].startswith('a "great" film\nQuestion:') and sst2.gold == 1
    assert load_task("wnli", release).examples[0].choices[0] == "False"
    assert load_task("qqp", release).examples[0].gold == 1


def test_missing_release_names_the_layout(tmp_path: Path) -> None:
    with pytest.raises(TaskDataError, match=r"task 'anli_r1': none of anli/R1/dev.jsonl"):
        load_task("anli_r1", tmp_path)
    bad = tmp_path / "bad.tsv"
    bad.write_text("sentence\tlabel\nfine\t1\textra\n")
    with pytest.raises(TaskDataError, match=r"bad.tsv:2: 3 columns do not match the header's 2"):
        load_task(f"sst2:{bad}")


@pytest.mark.parametrize("name", ["anli_r1", "story_cloze", "arc_challenge", "openbookqa"])
def test_promptsource_templates_read_the_released_form(
    release: Path, shared_data: Path, name: str
) -> None:
    (release / "promptsource_templates").symlink_to(shared_data / "eval/promptsource_templates")
    harness = load_task(name, release)
    task = load_task(name, release, prompts="promptsource")
    groups = {e.group for e in task.examples}
    assert task.aggregate == "median" and len(groups) > 1
    for ex in task.examples[: len(groups)]:  # every template of the first row
        assert ex.gold == harness.examples[0].gold
        assert len(ex.choices) == len(harness.examples[0].choices)


def test_tfds_and_hf_field_names_give_the_same_examples(release: Path) -> None:
    """The same items under the field names of the TFDS/HF versions of each dataset."""
    hf = {
        "anli_r1": {"premise": "A dog ran.", "hypothesis": "An animal moved", "label": 2},
        "story_cloze": {
            **{f"input_sentence_{i}": s for i, s in enumerate(["Ann woke.", "She ate."], 1)},
            **{"input_sentence_3": '"Hi," she said.', "input_sentence_4": "She left."},
            **{"sentence_quiz1": "Bye.", "sentence_quiz2": "No.", "answer_right_ending": 2},
        },
        "arc_challenge": {
            "question": "Which one grows?",
            "choices": {"text": ["a rock", "a plant", "a cloud", "a river"], "label": list("ABCD")},
            "answerKey": "B",
        },
        "openbookqa": {
            "question_stem": "Which one grows?",
            "choices": {"text": ["a rock", "a plant", "a cloud", "a river"], "label": list("ABCD")},
            "answerKey": "D",
        },
        "mrpc": {"sentence1": "He won.", "sentence2": "He was the winner.", "label": 1},
        "qnli": {"question": "Who won?", "sentence": "Ann won.", "label": 0},
        "qqp": {"question1": "How?", "question2": "How so?", "label": 1},
    }
    for name, fields in hf.items():
        path = release / f"hf_{name}.jsonl"
        _jsonl(path, [fields])
        assert load_task(f"{name}:{path}").examples[0] == load_task(name, release).examples[0]
