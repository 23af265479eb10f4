"""YAML config files: `include:` lists, dotted `key=value` overrides, readable validation errors.

A file may start with `include: [other.yaml, ...]` (paths relative to the including file);
included files are deep-merged first, then the file's own keys, then overrides of the form
`model.d_model=512` (values parsed as YAML; a list-typed key also takes `a,b,c`). `validate`
turns pydantic's errors into lines that name the key, the value and what would be accepted.
"""

from __future__ import annotations

import difflib
import re
import reprlib
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from scalestudy.config.errors import ConfigError, PathError, checked_path, not_found


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader that reads `1e-3` as a float (YAML 1.1 wants `1.0e-3`) and refuses a key
    given twice in one mapping (plain YAML keeps the last, silently dropping the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            # `<<: *anchor` merges are not keys: the mapping's own keys may override them.
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise DuplicateKeyError(
                    f"key {key!r} is given twice in one mapping (lines {first_line[key]} and "
                    f"{line}); keep one, merging their contents"
                )
            first_line[key] = line
        return super().construct_mapping(node, deep=deep)


class DuplicateKeyError(yaml.YAMLError):
    """A mapping names the same key twice."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


# Values a YAML document may expand to: anchors and aliases share one object per alias, so a
# few hundred bytes of nested aliases can stand for billions of values once walked.
MAX_VALUES = 1_000_000
# Lists and mappings inside one another: a config nests a few levels; the YAML parser and
# the code reading a config recurse once (or more) per level, into Python's recursion limit.
MAX_DEPTH = 64
# Bytes a config or study spec file may hold: the largest in configs/ is a few kilobytes; a
# file of tens of megabytes (a list of millions of sizes or seeds) would take the parser
# minutes before any check could speak.
MAX_FILE_BYTES = 1 << 20


class NestingError(yaml.YAMLError):
    """A document nests lists or mappings deeper than MAX_DEPTH."""


_TOO_DEEP = (
    f"it nests lists or mappings more than {MAX_DEPTH} levels deep; a config nests a few "
    "levels (check for unclosed or repeated [ and {)"
)


def parse_yaml(text: str) -> Any:
    """Parse YAML text (safe; scientific notation without a dot is a float); refused when
    aliases expand it past MAX_VALUES values or it nests deeper than MAX_DEPTH."""
    try:
        data = yaml.load(text, Loader=_YamlLoader)
    except RecursionError:  # the parser recurses per level: thousands of `[` end here
        raise NestingError(_TOO_DEEP) from None
    _check_expansion(data)
    return data


def _check_expansion(data: Any) -> None:
    """Count the values `data` holds as if every alias were copied; stop past MAX_VALUES, or
    at a list or mapping nested deeper than MAX_DEPTH."""
    stack, seen = [(data, 0)], 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise yaml.YAMLError(
                f"it expands to more than {MAX_VALUES:,} values through anchors and aliases; "
                "a config is far smaller: write the values out, or alias less"
            )
        if isinstance(node, dict | list) and depth >= MAX_DEPTH:
            raise NestingError(_TOO_DEEP)
        if isinstance(node, dict):
            stack.extend((child, depth + 1) for child in (*node.keys(), *node.values()))
        elif isinstance(node, list):
            stack.extend((child, depth + 1) for child in node)


def shown(value: Any, limit: int = 200) -> str:
    """`repr(value)` for an error line, cut to `limit` characters (never a value whole)."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = limit
    short.maxlist = short.maxdict = short.maxtuple = 10
    text = short.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of a nested dict (a config dumped to plain values)."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out |= flatten(v, f"{prefix}{k}.")
        return out
    return {prefix[:-1]: tree}


def deep_merge(base: dict, update: dict) -> dict:
    """Merge `update` into a copy of `base`: mappings merge recursively, the rest replaces."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_text(path: Path) -> str:
    """The file's text, refused past MAX_FILE_BYTES before any of it is parsed."""
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ConfigError(
            f"{path}: {size:,} bytes; a config or study spec is at most {MAX_FILE_BYTES:,} "
            "bytes (a list of sizes or seeds that long would expand into more runs than a "
            "study can plan)"
        )
    return path.read_text(encoding="utf-8")


def syntax_error(path: str | Path, e: yaml.MarkedYAMLError) -> str:
    """A YAML syntax error as one line: file, line, column and what the parser expected."""
    mark = e.problem_mark or e.context_mark
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
    what = " ".join(str(e.problem or "").split())
    context = " ".join(str(e.context or "").split())
    if context:
        what = f"{what} ({context})" if what else context
    return f"{where}: not valid YAML: {what}"


def read_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict:
    """Read a YAML mapping, resolving `include:` lists relative to the file."""
    path = Path(path)
    try:  # a name too long, a link to nothing, a folder under a file: said as such
        checked_path(path, "config file", "a YAML file")
    except PathError as e:
        raise ConfigError(str(e)) from None
    if not path.is_file():
        raise ConfigError(not_found(path, "config file", "a YAML file"))
    resolved = path.resolve()
    if resolved in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, resolved))
        raise ConfigError(f"include cycle: {chain}")
    try:
        raw = parse_yaml(_read_text(path))
    except (DuplicateKeyError, NestingError) as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.MarkedYAMLError as e:
        raise ConfigError(syntax_error(path, e)) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
            "save the file as UTF-8"
        ) from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    if raw is None:  # a zero-byte or comment-only file would train with every default
        raise ConfigError(
            f"{path}: the file holds no keys (empty, or only comments); give a mapping such "
            "as `include: [models/tiny.yaml]` or `model: {d_model: 64}`"
        )
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of keys, got {type(raw).__name__}")
    includes = raw.pop("include", [])
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) and i for i in includes):
        raise ConfigError(
            f"{path}: include: {includes!r} is not accepted; give a file name or a list of file "
            "names relative to this file, e.g. include: [../models/tiny.yaml]"
        )
    merged: dict = {}
    for inc in includes:
        merged = deep_merge(merged, read_yaml(path.parent / inc, (*_seen, resolved)))
    return deep_merge(merged, raw)


# The words YAML reads as null in an override's value (`key=null` clears a setting).
_NULLS = ("~", "null", "Null", "NULL")


def apply_overrides(
    data: dict, overrides: list[str] | tuple[str, ...], model: type[BaseModel] | None = None
) -> dict:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested dict. Given the
    `model` the dict validates as, a key whose type is a list also takes `a,b,c` and a lone
    `a` (as `--members seed=0,1,2` does), besides YAML's `[a, b, c]`."""
    out = dict(data)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(
                f"override {item!r} is not of the form key.sub=value (e.g. model.d_model=128)"
            )
        try:
            value = parse_yaml(text) if text else ""
        except NestingError as e:
            raise ConfigError(f"override {key}: {e}") from None
        except yaml.YAMLError:
            value = text
        if value is None and text.strip() not in _NULLS:  # `---`, `#x`: YAML syntax, not null
            value = text
        if model is not None and _is_list(_annotation_at(model, key)):
            value = _as_list(key, text, value)
        *parents, leaf = key.split(".")
        node: dict[str, Any] = {leaf: value}
        for parent in reversed(parents):
            node = {parent: node}
        out = deep_merge(out, node)
    return out


def _as_list(key: str, text: str, value: Any) -> Any:
    """An override's value for a list-typed key: `a,b` split at its commas (each part read as
    YAML), a lone scalar as a list of one; a YAML list, a mapping or null as given."""
    if isinstance(value, list | dict) or value is None or not text.strip():
        return value
    if not isinstance(value, str) or "," not in text or text.lstrip()[:1] in ("'", '"'):
        return [value]  # a quoted 'a,b' stays one item
    parts = [part.strip() for part in text.split(",")]
    if "" in parts:
        raise ConfigError(
            f"override {key}={text}: an empty item between commas; give values as "
            f"{key}=a,b,c or {key}=[a, b, c]"
        )
    return [_scalar(part) for part in parts]


def _scalar(text: str) -> Any:
    """One item of a comma list, read as YAML (`1e-3` a float, `0` an int), else the text."""
    try:
        value = parse_yaml(text)
    except yaml.YAMLError:
        return text
    return text if value is None and text not in _NULLS else value


def _annotation_at(model: type[BaseModel], key: str) -> Any:
    """The type annotation of dotted `key` in `model` (mappings' values included), or None."""
    annotation: Any = model
    for part in key.split("."):
        cls = _model_of(annotation)
        if cls is not None and part in cls.model_fields:
            annotation = cls.model_fields[part].annotation
            continue
        values = [a for a in _members(annotation) if typing.get_origin(a) is dict]
        if not values:
            return None
        annotation = typing.get_args(values[0])[1]
    return annotation


def _members(annotation: Any) -> list[Any]:
    """The types an annotation allows: `Annotated[X, ...]` -> X, `X | None` -> X, ..."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return [m for arg in typing.get_args(annotation) for m in _members(arg)]
    return [annotation]


def _is_list(annotation: Any) -> bool:
    """Whether a key of this type takes a list (and never text, where a comma is text)."""
    kinds = [typing.get_origin(a) or a for a in _members(annotation) if a is not type(None)]
    return bool(kinds) and any(k in (tuple, list) for k in kinds) and str not in kinds


def _accepted_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """The field names accepted at `loc` (a pydantic error location) within `model`."""
    cls: Any = model
    for part in loc[:-1]:
        field = getattr(cls, "model_fields", {}).get(part)
        if field is None:
            return []
        cls = _model_of(field.annotation)
    return sorted(getattr(cls, "model_fields", {}))


def _model_of(annotation: Any) -> Any:
    """The config model inside an annotation (`X | None` -> X; tuples of X -> X)."""
    if hasattr(annotation, "model_fields"):
        return annotation
    for arg in typing.get_args(annotation):
        if (found := _model_of(arg)) is not None:
            return found
    return None


def format_validation_error(err: ValidationError, model: type[BaseModel], source: str) -> str:
    """Turn a pydantic error into lines that name key, value and what is accepted."""
    lines = []
    errors = err.errors()
    # A list whose item is refused is then too short as well: the item's error says it.
    item_errors = {
        tuple(e["loc"][:-1]) for e in errors if e["loc"] and isinstance(e["loc"][-1], int)
    }
    for e in errors:
        loc = tuple(e["loc"])
        if e["type"] == "too_short" and loc in item_errors:
            continue
        key = ".".join(str(p) for p in loc)
        if e["type"] == "extra_forbidden":
            accepted = _accepted_keys(model, loc)
            close = difflib.get_close_matches(str(loc[-1]), accepted, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            where = f"accepted keys here: {', '.join(accepted)}" if accepted else "no keys here"
            lines.append(f"unknown key {key!r}{hint}; {where}")
        elif e["type"] == "value_error" and isinstance(e.get("ctx", {}).get("error"), ConfigError):
            lines.append(str(e["ctx"]["error"]))
        else:
            msg = e["msg"].replace("Value error, ", "")
            lines.append(f"{key}: {msg}; got {shown(e.get('input'))}")
    if len(lines) == 1:  # one problem: one line
        return f"{source}: invalid config: {lines[0]}"
    return f"{source}: invalid config:\n  " + "\n  ".join(lines)


def validate(model: type[BaseModel], data: dict, source: str = "config") -> Any:
    """Validate `data` as `model`, raising ConfigError with readable messages."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, model, source)) from None
