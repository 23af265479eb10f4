"""The promptsource (T0) prompt set: every original-task template of a dataset, reported as
the median accuracy over templates, as T0 reports it.

Templates are Jinja in `promptsource_templates/<dataset>/templates.yaml` under the data
directory: `prompt ||| target`, with `answer_choices` giving the choice texts.
"""

from __future__ import annotations

from pathlib import Path

import jinja2
import yaml

from scalestudy.config.errors import not_found
from scalestudy.evaluate import prompts
from scalestudy.evaluate.examples import Example, Task
from scalestudy.evaluate.formats import Row, TaskDataError, resolve_data_dir, source_id

_JINJA = jinja2.Environment()
_JINJA.globals["zip"] = zip  # promptsource templates use it


class _TemplateLoader(yaml.SafeLoader):
    """Reads promptsource's `!Template` / `!TemplateMetadata` tags as plain mappings."""


for _tag in ("!Template", "!TemplateMetadata"):
    _TemplateLoader.add_constructor(_tag, lambda loader, node: loader.construct_mapping(node, True))


def load_templates(path: Path) -> list[dict]:
    """Templates of one dataset that score the original task with answer choices."""
    if not path.is_file():
        raise TaskDataError(not_found(path, "promptsource templates"))
    raw = yaml.load(path.read_text(), Loader=_TemplateLoader)
    kept = []
    for t in (raw or {}).get("templates", {}).values():
        meta = t.get("metadata") or {}
        if meta.get("original_task") and t.get("answer_choices"):
            kept.append(t)
    if not kept:
        raise TaskDataError(f"{path}: no original-task templates with answer choices")
    return kept


def _source_fields(name: str, row: Row, gold: int) -> dict:
    """The row's fields under the HF dataset names the templates use."""
    f = dict(row.fields)
    if name == "wsc" and isinstance(f.get("target"), dict):
        f.update(f.pop("target"))
    if name == "boolq" and "query" in f and "passage" not in f:
        passage, _, question = f["query"].removeprefix("Passage: ").rpartition("\nQuestion: ")
        f.update(passage=passage, question=question.rstrip("?"))
    if name == "arc_easy" and "query" in f:
        letters = [chr(ord("A") + i) for i in range(len(f["choices"]))]
        f.update(
            question=f["query"].removeprefix("Question: "),
            choices={"text": f["choices"], "label": letters},
            answerKey=letters[gold],
        )
    if name in ("arc_challenge", "openbookqa") and isinstance(f.get("question"), dict):
        q = f.pop("question")  # the AI2 release form
        stem = q.get("stem", "")
        choices = {
            "text": [c.get("text") for c in q.get("choices", ())],
            "label": [str(c.get("label")) for c in q.get("choices", ())],
        }
        f.update(question=stem, question_stem=stem, choices=choices)
    if name.startswith("anli") and "premise" not in f:
        f["premise"] = f.get("context")
    if name == "story_cloze" and "InputSentence1" in f:
        for i in range(1, 5):
            f[f"input_sentence_{i}"] = f[f"InputSentence{i}"]
        f["sentence_quiz1"] = f["RandomFifthSentenceQuiz1"]
        f["sentence_quiz2"] = f["RandomFifthSentenceQuiz2"]
    f["answer_right_ending"] = gold + 1
    f["label"] = gold
    return f


SUPPORTED = (
    "copa",
    "piqa",
    "rte",
    "cb",
    "wic",
    "wsc",
    "boolq",
    "arc_easy",
    "arc_challenge",
    "openbookqa",
    "anli_r1",
    "anli_r2",
    "anli_r3",
    "story_cloze",
)


def promptsource_task(
    name: str, templates_dir: str | None, rows: list[Row], source: str, data_dir
) -> Task:
    """The task's examples under every template of `promptsource_templates/<templates_dir>`
    (group = template name; median aggregate)."""
    if name not in SUPPORTED or templates_dir is None:
        raise TaskDataError(
            f"no promptsource templates wired for task {name!r}; accepted with "
            f"eval.prompts=promptsource: {', '.join(SUPPORTED)}"
        )
    root = resolve_data_dir(data_dir)
    templates = load_templates(root / "promptsource_templates" / templates_dir / "templates.yaml")
    build = prompts.BUILDERS[name]
    examples = []
    for row in rows:
        harness = build(row)  # the gold label, read and checked once
        fields = _source_fields(name, row, harness.gold)
        for t in templates:
            try:
                choices = _JINJA.from_string(t["answer_choices"]).render(**fields).split("|||")
                choices = tuple(c.strip() for c in choices)
                text = _JINJA.from_string(t["jinja"]).render(**fields, answer_choices=choices)
            except jinja2.TemplateError as e:
                raise row.error(f"promptsource template {t['name']!r}: {e}") from None
            prompt = text.split("|||")[0].strip()
            # Templates that do not apply to this row render empty (e.g. COPA 'effect' only).
            if prompt and len(choices) == len(harness.choices) and all(choices):
                examples.append(
                    Example((prompt,), choices, harness.gold, t["name"], source_id(row))
                )
    return Task(name, "choice", tuple(examples), source, "acc", aggregate="median")
