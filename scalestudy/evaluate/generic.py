"""Tasks defined entirely by a TaskConfig (YAML) over a JSONL file: no code per dataset."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jinja2

from scalestudy.config.eval_config import TaskConfig
from scalestudy.evaluate import prompts
from scalestudy.evaluate.blimp import pair_example
from scalestudy.evaluate.examples import Example, Task
from scalestudy.evaluate.formats import Row, TaskDataError, read_rows, source_id

_JINJA = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


def _template(text: str | None, task: str, key: str) -> jinja2.Template | None:
    if text is None:
        return None
    try:
        return _JINJA.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise TaskDataError(f"task {task!r}: {key} is not valid Jinja: {e}") from None


def _render(template: jinja2.Template, row: Row, key: str, **extra) -> str:
    try:
        return template.render(**row.fields, **extra)
    except jinja2.UndefinedError as e:
        have = ", ".join(sorted(row.fields))
        raise row.error(f"{key}: {e.message}; fields present: {have}") from None
    except Exception as e:  # a template error on this row's values, e.g. indexing a number
        raise row.error(f"{key}: {type(e).__name__}: {e}") from None


def resolve_path(path: str, data_dir: str | Path | None, base_dir: Path | None) -> Path:
    """The task file: absolute, or relative to the YAML's folder, then data_dir, then cwd."""
    p = Path(path)
    if p.is_absolute():
        return p
    candidates = [d / p for d in (base_dir, Path(data_dir) if data_dir else None) if d] + [p]
    for c in candidates:
        if c.is_file():
            return c
    tried = ", ".join(str(c) for c in candidates)
    raise TaskDataError(f"task file {path!r} not found; looked at: {tried}")


def _choices(tc: TaskConfig, row: Row) -> tuple[str, ...]:
    if tc.choice_source == "choices":
        return tuple(str(c) for c in tc.choices)
    if tc.choice_source == "choice_fields":
        return tuple(row.get(f, str) for f in tc.choice_fields)
    return tuple(row.get(tc.choices_field, list))


def _label(tc: TaskConfig, row: Row, choices: tuple[str, ...]) -> int:
    value = row.get(tc.label_field, (int, str, bool))
    if isinstance(value, str) and value.strip().lstrip("-").isdigit() and value not in choices:
        value = int(value.strip())  # a digit-string label is a number, offset like one
    if tc.label_offset and isinstance(value, int) and not isinstance(value, bool):
        row = Row({**row.fields, tc.label_field: value - tc.label_offset}, row.where)
    return prompts.gold_index(row, tc.label_field, choices, tc.label_names)


def generic_task(
    tc: TaskConfig, data_dir: str | Path | None = None, base_dir: Path | None = None
) -> Task:
    """The Task a TaskConfig describes (examples built row by row, errors naming file:line);
    its few-shot demonstrations read the same way from `fewshot_path` when given."""
    path = resolve_path(tc.path, data_dir, base_dir)
    kind = "last_word" if tc.kind == "last_word" else "choice"
    demos, demos_source = None, ""
    if tc.fewshot_path is not None:
        try:
            demo_path = resolve_path(tc.fewshot_path, data_dir, base_dir)
        except TaskDataError as e:
            where = str(e).partition("; ")[2]
            raise TaskDataError(
                f"task {tc.name!r}: fewshot_path {tc.fewshot_path!r} not found (the file its "
                f"demonstrations come from); {where}"
            ) from None
        demos, demos_source = tuple(_examples(tc, read_rows(demo_path))), str(demo_path)
    return Task(
        tc.name,
        "choice" if tc.kind == "pair" else kind,
        tuple(_examples(tc, read_rows(path))),
        str(path),
        "acc" if tc.kind == "pair" else tc.metric,
        "" if tc.kind == "pair" else tc.delimiter,
        description=tc.description,
        fewshot_delimiter=tc.fewshot_delimiter,
        demos=demos,
        demos_source=demos_source,
    )


def _examples(tc: TaskConfig, rows: list[Row]) -> list[Example]:
    """The examples of `rows` as `tc` describes them."""
    if tc.kind == "pair":
        return _pair_examples(tc, rows)
    context_t = _template(tc.template, tc.name, "template")
    choice_t = _template(tc.choice_template, tc.name, "choice_template")
    examples: list[Example] = []

    def add(example: Example) -> None:
        examples.append(dataclasses.replace(example, source=source_id(row)))

    for row in rows:
        context = ""  # partial tasks take their contexts from the choices field
        if context_t is not None:
            context = _render(context_t, row, "template")
        elif tc.kind != "partial":
            context = row.get(tc.context_field, str)
        if tc.kind == "last_word":
            word = row.get(tc.continuation_field, str)
            if not word.strip():
                raise row.error(f"field {tc.continuation_field!r} is empty")
            add(Example((context,), (word,)))
            continue
        field = tc.choices_field if tc.choice_source == "choices_field" else tc.choice_source
        choices = prompts.check_choices(row, _choices(tc, row), field)
        gold = _label(tc, row, choices)
        if choice_t is not None:
            choices = tuple(_render(choice_t, row, "choice_template", choice=c) for c in choices)
            prompts.check_choices(row, choices, "choice_template")
        if tc.kind == "partial":  # the choices are the option-filled contexts
            continuation = row.get(tc.continuation_field, str)
            if not continuation.strip():
                raise row.error(f"field {tc.continuation_field!r} is empty")
            add(Example(choices, (continuation,) * len(choices), gold))
        else:
            group = "" if tc.group_field is None else str(row.get(tc.group_field))
            add(Example((context,), choices, gold, group))
    return examples


def _pair_examples(tc: TaskConfig, rows: list[Row]) -> list[Example]:
    """Minimal pairs: the first of `choice_fields` is the acceptable sentence; both are scored
    whole with no context and no delimiter."""
    examples = []
    for row in rows:
        good, bad = prompts.check_choices(row, _choices(tc, row), "choice_fields")
        group = "" if tc.group_field is None else str(row.get(tc.group_field))
        examples.append(dataclasses.replace(pair_example(good, bad, group), source=source_id(row)))
    return examples
