"""promptsource templates: reading `templates.yaml` files and rendering one row through one.

A template is Jinja text `prompt ||| target`, with `answer_choices` (Jinja too, choices joined
by `|||`) rendered first and passed to it; the format of promptsource's
`promptsource_templates/<dataset>/templates.yaml`. Templates see a row's fields as variables;
undefined fields are errors, not empty strings.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path

import jinja2
import yaml

from scalestudy.config.errors import not_found
from scalestudy.data import DataError

_JINJA = jinja2.Environment(undefined=jinja2.StrictUndefined)
_JINJA.globals["zip"] = zip  # promptsource templates use it


class _TemplateLoader(yaml.SafeLoader):
    """Reads promptsource's `!Template` / `!TemplateMetadata` tags as plain mappings."""


for _tag in ("!Template", "!TemplateMetadata"):
    _TemplateLoader.add_constructor(_tag, lambda loader, node: loader.construct_mapping(node, True))


def read_templates(
    path: Path, task: str, original_task_only: bool, names: tuple[str, ...] = ()
) -> list[dict]:
    """The templates (name, jinja, answer_choices, ...) of the file `path` that task `task`
    uses: only those marked `original_task` with answer choices when `original_task_only`,
    only those named in `names` when given."""
    if not path.is_file():
        raise DataError(not_found(path, f"prompted task {task!r}: templates file"))
    raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_TemplateLoader) or {}
    kept = []
    for t in (raw.get("templates") or {}).values():
        meta = t.get("metadata") or {}
        if original_task_only and not (meta.get("original_task") and t.get("answer_choices")):
            continue
        if names and t.get("name") not in names:
            continue
        kept.append(t)
    if not kept:
        raise DataError(
            f"prompted task {task!r}: no templates selected from {path} (original_task_only="
            f"{original_task_only}, template_names={list(names)})"
        )
    return kept


@functools.lru_cache(maxsize=1024)
def _compile(text: str) -> jinja2.Template:
    return _JINJA.from_string(text)


@functools.lru_cache(maxsize=256)
def compile_expression(text: str) -> Callable[..., object]:
    """A Jinja expression over a row's fields, as a function of them (compiled once)."""
    return _JINJA.compile_expression(text, undefined_to_none=False)


def render(template: dict, fields: Mapping, task: str = "?") -> tuple[str, str] | None:
    """(prompt, target) of one row under one template, or None when it does not apply."""
    try:
        choices = None
        if template.get("answer_choices"):
            text = _compile(template["answer_choices"]).render(**fields)
            choices = [c.strip() for c in text.split("|||")]
        out = _compile(template["jinja"]).render(**fields, answer_choices=choices)
    except jinja2.TemplateError as e:
        raise DataError(
            f"prompted task {task!r}, template {template.get('name')!r}: {e} (the row's fields "
            f"are {', '.join(sorted(fields))})"
        ) from None
    prompt, sep, target = out.partition("|||")
    prompt, target = prompt.strip(), target.strip()
    if not sep or not prompt or not target:
        return None
    return prompt, target
