"""Task loaders on the released files, the generic YAML task, and clear errors on bad input."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from scalestudy.config.errors import ConfigError
from scalestudy.config.eval_config import TaskConfig
from scalestudy.config.yamlio import read_yaml, validate
from scalestudy.evaluate.formats import TaskDataError
from scalestudy.evaluate.tasks import load_task

# Rows of each task's standard split, as the release READMEs state them (COPA: SuperGLUE
# validation = dev ids 401-500).
RELEASED_ROWS = {
    "copa": 100,
    "piqa": 1838,
    "hellaswag": 10042,
    "boolq": 3270,
    "arc_easy": 2376,
    "winogrande": 1267,
    "lambada": 5153,
    "rte": 277,
    "cb": 56,
    "wic": 638,
    "wsc": 104,
}


@pytest.fixture(scope="module")
def eval_dir(shared_data: Path) -> Path:
    return shared_data / "eval"


@pytest.mark.parametrize("name", sorted(RELEASED_ROWS))
def test_row_counts_and_well_formed_examples(eval_dir: Path, name: str) -> None:
    task = load_task(name, eval_dir)
    assert len(task.examples) == RELEASED_ROWS[name]
    for ex in task.examples:
        assert all(c.strip() for c in ex.choices)
        assert 0 <= ex.gold < len(ex.choices)
        assert len(ex.contexts) in (1, len(ex.choices))
    if task.kind == "choice":  # labels are not all the same class (a loader mix-up would be)
        assert len({ex.gold for ex in task.examples}) > 1


def test_copa_xml_and_jsonl_releases_agree(eval_dir: Path) -> None:
    xml = load_task(f"copa:{eval_dir}/copa/copa-dev.xml")
    jsonl = load_task(f"copa:{eval_dir}/copa/copa-dev.jsonl")
    assert len(xml.examples) == 500
    assert xml.examples == jsonl.examples
    # The harness prompt: premise without its full stop + connector; choice lower-cased.
    first_val = load_task("copa", eval_dir).examples[0]
    assert first_val.contexts == ("The man turned on the faucet therefore",)
    assert first_val.choices == ("the toilet filled with water.", "water flowed from the spout.")
    assert first_val.gold == 1


def test_other_release_formats_agree(eval_dir: Path) -> None:
    # PIQA: labels from the aligned .lst file == labels inline.
    lst = load_task(f"piqa:{eval_dir}/piqa/valid.jsonl")
    inline = load_task(f"piqa:{eval_dir}/piqa/valid_with_labels.jsonl")
    assert lst.examples == inline.examples
    # WiC: original tab-separated data + gold files == the JSONL release.
    assert (
        load_task(f"wic:{eval_dir}/wic/dev.data.txt").examples
        == load_task("wic", eval_dir).examples
    )


def test_partial_and_last_word_shapes(eval_dir: Path) -> None:
    wino = load_task("winogrande", eval_dir).examples[0]
    assert len(wino.contexts) == 2 and wino.choices[0] == wino.choices[1]
    assert wino.pairs()[1] == (wino.contexts[1], "always got the easier cases.")
    lam = load_task("lambada", eval_dir)
    assert lam.kind == "last_word" and lam.examples[0].choices == ("signs",)


def test_configs_tasks_files_validate_and_load(repo: Path, eval_dir: Path) -> None:
    files = sorted((repo / "configs" / "tasks").glob("*.yaml"))
    assert files
    for f in files:
        cfg = validate(TaskConfig, read_yaml(f), str(f))
        if Path(cfg.path).is_absolute():
            continue  # a template for the user's own file
        task = load_task(str(f), eval_dir)
        assert task.name == cfg.name and task.examples


def test_yaml_tasks_need_no_code(repo: Path, eval_dir: Path) -> None:
    tasks = repo / "configs" / "tasks"
    # The same examples as the built-in loaders, from configuration alone.
    assert load_task(str(tasks / "rte_template.yaml"), eval_dir).examples == (
        load_task("rte", eval_dir).examples
    )
    assert load_task(str(tasks / "piqa_fields.yaml"), eval_dir).examples == (
        load_task("piqa", eval_dir).examples
    )
    assert load_task(str(tasks / "winogrande_partial.yaml"), eval_dir).examples == (
        load_task("winogrande", eval_dir).examples
    )


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_generic_task_field_names_text_labels_and_templates(tmp_path: Path) -> None:
    data = _write(
        tmp_path / "qa.jsonl",
        [
            {"question": "2+2?", "options": ["3", "4", "5"], "answer": "4"},
            {"question": "Sky?", "options": ["green", "blue"], "answer": "blue"},
        ],
    )
    tc = TaskConfig(
        name="qa",
        path=str(data),
        template="Q: {{ question }}\nA:",
        choices_field="options",
        label_field="answer",
        choice_template="{{ choice }}!",
    )
    task = load_task(tc)
    assert [e.gold for e in task.examples] == [1, 1]
    assert task.examples[0].contexts == ("Q: 2+2?\nA:",)
    assert task.examples[1].choices == ("green!", "blue!")
    fixed = dict(name="x", path=str(data), context_field="question", label_field="answer")
    with pytest.raises(TaskDataError, match=r"qa.jsonl:1: field 'answer': gold label 4 out of"):
        load_task(TaskConfig(**fixed, choices=["a", "b"]))
    data.write_text(json.dumps({"question": "Sky?", "answer": "blue"}) + "\n")
    with pytest.raises(TaskDataError, match=r"qa.jsonl:1: field 'answer': label 'blue' is none of"):
        load_task(TaskConfig(**fixed, choices=["a", "b"]))
    data.write_text(json.dumps({"question": "Sky?", "a": "red", "b": "blue", "answer": 2}) + "\n")
    one_based = load_task(TaskConfig(**fixed, choice_fields=["a", "b"], label_offset=1))
    assert one_based.examples[0].gold == 1


BAD_ROWS = {
    "malformed line": (
        ['{"query": "a", "choices": ["x", "y"], "gold": 0}', "{not json"],
        r":2: not valid JSON",
    ),
    "wrong field name": (
        [{"qery": "a", "choices": ["x", "y"], "gold": 0}],
        r":1: missing field 'query'; fields present: choices, gold, qery",
    ),
    "gold out of range": (
        [{"query": "a", "choices": ["x", "y"], "gold": 2}],
        r":1: field 'gold': gold label 2 out of range for 2 choices \(accepted 0..1\)",
    ),
    "empty choice": (
        [{"query": "a", "choices": ["x", " "], "gold": 0}],
        r":1: field 'choices': choice 1 is empty",
    ),
    "one choice": (
        [{"query": "a", "choices": ["x"], "gold": 0}],
        r":1: field 'choices': need at least 2",
    ),
    "label type": (
        [{"query": "a", "choices": ["x", "y"], "gold": [0]}],
        r":1: field 'gold' should be int/str/bool, got list",
    ),
    "not an object": (["[1, 2]"], r":1: expected a JSON object, got list"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_rows_name_file_line_and_field(tmp_path: Path, case: str) -> None:
    rows, message = BAD_ROWS[case]
    path = _write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(TaskDataError, match=str(path).replace(".", r"\.") + message):
        load_task(TaskConfig(name="bad", path=str(path)))


def test_bad_names_paths_and_configs(tmp_path: Path, eval_dir: Path) -> None:
    with pytest.raises(TaskDataError, match=r"task file 'nope.jsonl' not found; looked at"):
        load_task(TaskConfig(name="t", path="nope.jsonl"), tmp_path)
    with pytest.raises(TaskDataError, match=r"task 'copa': none of copa/copa-dev.xml"):
        load_task("copa", tmp_path)
    with pytest.raises(TaskDataError, match=r"task file not found: .*missing.jsonl"):
        load_task(f"rte:{tmp_path}/missing.jsonl")
    with pytest.raises(TaskDataError, match=r"unknown task 'copaa'; accepted: synthetic_probes"):
        load_task("copaa", eval_dir)
    with pytest.raises(TaskDataError, match="no evaluation data directory"):
        load_task("copa", None)
    with pytest.raises(ConfigError, match="exactly one source of choices"):
        validate(TaskConfig, {"name": "t", "path": "x", "choice_fields": ["a"], "choices": ["c"]})
    bad_yaml = tmp_path / "t.yaml"
    bad_yaml.write_text("name: t\npath: x.jsonl\nchoice_field: c\n")
    with pytest.raises(ConfigError, match=r"unknown key 'choice_field' \(did you mean"):
        load_task(str(bad_yaml))
    labels = _write(tmp_path / "valid.jsonl", [{"goal": "g", "sol1": "a", "sol2": "b"}] * 2)
    (tmp_path / "valid-labels.lst").write_text("0\n")
    with pytest.raises(TaskDataError, match=r"valid-labels.lst: 1 labels for 2 data rows"):
        load_task(f"piqa:{labels}")


def test_synthetic_probes() -> None:
    task = load_task("synthetic_probes")
    groups = {e.group for e in task.examples}
    assert len(groups) > 1 and all(g for g in groups)
    assert all(0 <= e.gold < len(e.choices) for e in task.examples)


def test_tfds_source_absent_is_a_fast_clear_error(tmp_path: Path) -> None:
    start = time.perf_counter()
    with pytest.raises(TaskDataError, match=r"'super_glue/copa' is not prepared in .*tfds build"):
        load_task("super_glue/copa", tfds_data_dir=str(tmp_path))
    assert time.perf_counter() - start < 60  # no network wait
    with pytest.raises(TaskDataError, match="no prompt mapping for TFDS dataset 'glue/cola'"):
        load_task("tfds:glue/cola")


def test_promptsource_prompt_set(eval_dir: Path) -> None:
    harness = load_task("rte", eval_dir)
    task = load_task("rte", eval_dir, prompts="promptsource")
    groups = {e.group for e in task.examples}
    assert task.aggregate == "median" and len(groups) > 1
    assert len(task.examples) == len(groups) * len(harness.examples)
    # The gold label is the release's, whatever the template's wording of the choices.
    assert [e.gold for e in task.examples[: len(groups)]] == [harness.examples[0].gold] * len(
        groups
    )
    with pytest.raises(TaskDataError, match="no promptsource templates wired for task 'lambada'"):
        load_task("lambada", eval_dir, prompts="promptsource")


def test_task_file_edges_are_one_clear_error(tmp_path):
    """A file that is not UTF-8, label names beyond the choices, and digit-string labels
    that label_offset applies to, as it does to numbers."""
    import json as _json

    from scalestudy.config.eval_config import TaskConfig
    from scalestudy.evaluate.formats import TaskDataError
    from scalestudy.evaluate.generic import generic_task

    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes('{"query": "caf\xe9", "choices": ["a", "b"], "gold": 0}\n'.encode("latin-1"))
    with pytest.raises(TaskDataError, match=r"latin1.jsonl: not UTF-8 text \(byte 14"):
        generic_task(TaskConfig(name="t", path=str(bad)))
    rows = tmp_path / "rows.jsonl"
    rows.write_text(_json.dumps({"query": "q", "choices": ["a", "b"], "gold": "c"}) + "\n")
    names = TaskConfig(name="t", path=str(rows), label_names=["a", "b", "c"])
    with pytest.raises(TaskDataError, match="label 'c' is label_names entry 2, but the row has 2"):
        generic_task(names)
    one_based = tmp_path / "one.jsonl"
    one_based.write_text(
        "".join(
            _json.dumps({"query": "q", "choices": ["a", "b"], "gold": g}) + "\n"
            for g in (2, "2", "1")
        )
    )
    task = generic_task(TaskConfig(name="t", path=str(one_based), label_offset=1))
    assert [ex.gold for ex in task.examples] == [1, 1, 0]


def test_identical_choices_are_counted_and_said(tmp_path):
    import json as _json
    import warnings as _warnings

    import numpy as np

    from scalestudy.config.eval_config import TaskConfig
    from scalestudy.data.vocab import get_vocabulary
    from scalestudy.evaluate import rank
    from scalestudy.evaluate.generic import generic_task

    from .tiny_models import tiny

    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(
            _json.dumps({"query": "q", "choices": c, "gold": 1}) + "\n"
            for c in (["x", "x"], ["x", "y"], ["y", "z"])
        )
    )
    task = generic_task(TaskConfig(name="t", path=str(rows)))
    cfg = tiny("causal_decoder", "flm")

    def score(fitted):  # every choice the same score: ties everywhere
        n = np.array([len(t) for t in fitted.targets])
        return np.zeros(len(n)), n, np.zeros(len(n), bool)

    with _warnings.catch_warnings(record=True) as caught:
        _warnings.simplefilter("always")
        out = rank.evaluate_task(task, score, get_vocabulary(cfg.data), cfg)
    assert out["t/identical_choices"] == 1
    assert any("1 of 3 examples offer the same choice twice" in str(w.message) for w in caught)
