"""Prompted tasks for multitask finetuning: promptsource templates over datasets, as seqio Tasks.

A prompted task is a dataset (a JSONL file of rows in the dataset's released field names, or a
TFDS dataset prepared on this machine) rendered through promptsource templates
(`prompt_templates.py`: Jinja text `prompt ||| target`). Every (row, template) pair is one example
{'inputs': prompt, 'targets': delimiter + target}; a template that does not apply to a row
renders an empty prompt or target and the pair is skipped, as T0 does.

A mixture file (`PromptedMixture`) names the tasks, their clusters, the clusters held out for
zero-shot evaluation (T0: natural language inference, coreference, sentence completion, word
sense) and the tasks mixed for training. A task of a held-out cluster can never enter the
training mixture: `check_mixture` refuses it (and any training task that reads a held-out
task's file), and `prompted_seqio.register_mixture` always calls it.

Examples are (inputs, targets) pairs, exactly what the prefix-LM objective produces, so each
architecture consumes them through the existing seqio feature converters
(`seqio_pipeline._converter` with `objective.name: plm`, `plm_split: fit`): the encoder reads
the prompt, the non-causal decoder takes it as its bidirectional prefix, the causal decoder
reads the concatenation, and the loss falls on the target tokens only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import jinja2
from pydantic import Field, model_validator

from scalestudy.config.base import Frozen, Tuple
from scalestudy.config.errors import ConfigError, not_found
from scalestudy.config.experiment import SyntheticConfig
from scalestudy.config.yamlio import apply_overrides, read_yaml, validate
from scalestudy.data import DataError, require_seqio
from scalestudy.data.prompt_templates import compile_expression, read_templates, render
from scalestudy.data.synthetic import probe_tasks

PREFIX = "prompted"
SPLITS = ("train", "validation")
# T0's held-out clusters (Sanh et al. 2021, section 4): never trained on, evaluated zero-shot.
T0_HELD_OUT = ("nli", "coreference", "sentence_completion", "word_sense")


class PromptedTask(Frozen):
    """One dataset rendered through promptsource templates."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_]+$")
    cluster: str = Field(min_length=1)
    path: str | None = None  # JSONL; relative: to the mixture file's folder, then data_dir
    tfds_name: str | None = None  # or a TFDS dataset prepared locally (e.g. super_glue/rte)
    tfds_split: str = "validation"
    # or a probe task of the built-in synthetic corpus (rows: context, choices, gold)
    synthetic: str | None = None
    synthetic_seed: int = 0
    synthetic_rows: int = Field(200, ge=1)
    templates: str  # templates.yaml; relative: to the mixture's templates_dir
    template_names: Tuple = ()  # subset by name; empty: every selected template
    original_task_only: bool = True  # only templates marked `original_task` (with choices)
    label_field: str = "label"
    label_names: Tuple = ()  # string labels in index order, e.g. [entailment, not_entailment]
    # Fields the templates need that the file lacks: name -> Jinja expression over the row,
    # e.g. {question: "query[10:]"} (for files in another release format than the templates').
    derive: Annotated[dict[str, str], Field(default_factory=dict, strict=False)]
    eval_task: str | None = None  # the evaluation registry's name for this task (held out)

    @model_validator(mode="after")
    def _check(self) -> PromptedTask:
        if [self.path, self.tfds_name, self.synthetic].count(None) != 2:
            raise ConfigError(
                f"prompted task {self.name!r}: give exactly one of path (a JSONL file), "
                "tfds_name (a TFDS dataset prepared on this machine) or synthetic (a probe "
                "task of the built-in corpus)"
            )
        return self


class PromptedMixture(Frozen):
    """Prompted tasks, their clusters, the held-out clusters and the training mixture."""

    name: str = Field("t0_train", min_length=1, pattern=r"^[A-Za-z0-9_]+$")
    data_dir: str | None = None  # where the tasks' relative paths live (else the file's folder)
    templates_dir: str | None = None  # where `templates` paths live
    tfds_data_dir: str | None = None
    held_out_clusters: Tuple = T0_HELD_OUT
    tasks: Annotated[tuple[PromptedTask, ...], Field(strict=False)] = ()
    train: Tuple = ()  # task names mixed for training; empty: every task not held out
    # T0 mixes datasets in proportion to their examples, each capped at 500,000 (Sanh et al.).
    rate_cap: int = Field(500_000, ge=1)
    validation_every: int = Field(10, ge=2)  # every k-th row (by index) forms `validation`
    delimiter: str = " "  # between prompt and target, as rank classification scores them
    base_dir: str | None = Field(None, exclude=True)  # the mixture file's folder (set on load)

    @model_validator(mode="after")
    def _check(self) -> PromptedMixture:
        names = [t.name for t in self.tasks]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"prompted mixture {self.name!r}: task names repeated: {dup}")
        unknown = [n for n in self.train if n not in names]
        if unknown:
            raise ConfigError(
                f"prompted mixture {self.name!r}: train names unknown tasks {unknown}; "
                f"accepted: {', '.join(names) or 'none (add tasks)'}"
            )
        return self

    @property
    def train_tasks(self) -> tuple[PromptedTask, ...]:
        """The tasks mixed for training (explicit `train`, else all not held out)."""
        if self.train:
            return tuple(t for t in self.tasks if t.name in self.train)
        return tuple(t for t in self.tasks if t.cluster not in self.held_out_clusters)

    @property
    def held_out_tasks(self) -> tuple[PromptedTask, ...]:
        return tuple(t for t in self.tasks if t.cluster in self.held_out_clusters)


def load_mixture(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> PromptedMixture:
    """Read a mixture YAML file (relative paths in it resolve against its folder)."""
    data = apply_overrides(read_yaml(path), overrides, PromptedMixture)
    data["base_dir"] = str(Path(path).resolve().parent)
    return validate(PromptedMixture, data, str(path))


# ----------------------------------------------------------------------------- checks


def check_mixture(mixture: PromptedMixture) -> None:
    """Raise ConfigError when the training mixture is empty or holds a held-out task.

    Held out means: in a held-out cluster, or reading the same file (or TFDS dataset) as a
    task of a held-out cluster under another name.
    """
    train = mixture.train_tasks
    if not train:
        raise ConfigError(
            f"prompted mixture {mixture.name!r} has no training tasks: every task is in a "
            f"held-out cluster ({', '.join(mixture.held_out_clusters)}) or `train` is empty; "
            "add tasks of other clusters"
        )
    held = {t.name: t for t in mixture.held_out_tasks}
    held_sources = {_source_key(mixture, t): t.name for t in held.values()}
    for t in train:
        if t.cluster in mixture.held_out_clusters:
            raise ConfigError(
                f"prompted task {t.name!r} is in held-out cluster {t.cluster!r} and cannot "
                f"enter training mixture {mixture.name!r}; held-out clusters: "
                f"{', '.join(mixture.held_out_clusters)}"
            )
        other = held_sources.get(_source_key(mixture, t))
        if other is not None:
            raise ConfigError(
                f"prompted task {t.name!r} reads the same data as held-out task {other!r} and "
                f"cannot enter training mixture {mixture.name!r}"
            )


def _source_key(mixture: PromptedMixture, task: PromptedTask) -> str:
    if task.tfds_name is not None:
        return f"tfds:{task.tfds_name}"
    if task.synthetic is not None:
        return f"synthetic:{task.synthetic}:{task.synthetic_seed}"
    return f"file:{resolve_path(task.path, mixture.data_dir, mixture.base_dir)}"


def resolve_path(path: str | None, root: str | None, base: str | None) -> Path:
    """`path` if absolute, else under `root` (itself relative to `base`, the mixture file's
    folder), else under `base`."""
    p = Path(str(path)).expanduser()
    if p.is_absolute():
        return p
    folders = []
    if root is not None:
        r = Path(root).expanduser()
        folders.append(r if r.is_absolute() or base is None else Path(base) / r)
    if base is not None:
        folders.append(Path(base))
    for folder in folders:
        if (folder / p).exists():
            return (folder / p).resolve()
    return ((folders[0] if folders else Path.cwd()) / p).resolve()


# ----------------------------------------------------------------------------- rows


def _templates(mixture: PromptedMixture, task: PromptedTask) -> list[dict]:
    """The task's templates, from its `templates` file (resolved as the mixture says)."""
    path = resolve_path(task.templates, mixture.templates_dir, mixture.base_dir)
    return read_templates(path, task.name, task.original_task_only, tuple(task.template_names))


def _fields(task: PromptedTask, row: Mapping, where: str) -> dict:
    """The row's fields as the templates expect them: nested mappings flattened one level
    (SuperGLUE WSC's `target`), the label an index (bools as 0/1, names via label_names)."""
    out = dict(row)
    for key, value in row.items():
        if isinstance(value, dict):
            out.pop(key)
            out.update({k: v for k, v in value.items() if k not in out})
    for key, expr in task.derive.items():
        try:
            out[key] = compile_expression(expr)(**row)
        except (jinja2.TemplateError, TypeError, IndexError, KeyError, ValueError) as e:
            raise DataError(
                f"{where}: prompted task {task.name!r}: derive.{key}={expr!r} failed: {e}"
            ) from None
    label = out.get(task.label_field)
    if isinstance(label, bool):
        label = int(label)
    elif isinstance(label, str) and task.label_names:
        if label not in task.label_names:
            raise DataError(
                f"{where}: label {label!r} is not one of the task's label_names "
                f"{list(task.label_names)}"
            )
        label = list(task.label_names).index(label)
    elif isinstance(label, str) and label.lstrip("-").isdigit():
        label = int(label)
    if task.label_field in out:
        out["label"] = label
    return out


def _read_rows(mixture: PromptedMixture, task: PromptedTask) -> list[tuple[dict, str]]:
    if task.synthetic is not None:
        probes = probe_tasks(SyntheticConfig(seed=task.synthetic_seed), task.synthetic_rows)
        if task.synthetic not in probes:
            raise DataError(
                f"prompted task {task.name!r}: synthetic={task.synthetic!r} is not a probe "
                f"task; accepted: {', '.join(probes)}"
            )
        return [(row, f"{task.synthetic}[{i}]") for i, row in enumerate(probes[task.synthetic])]
    if task.tfds_name is not None:
        require_seqio(f"prompted task {task.name!r} (tfds_name {task.tfds_name!r})")
        import tensorflow_datasets as tfds

        try:
            ds = tfds.load(
                task.tfds_name,
                split=task.tfds_split,
                data_dir=mixture.tfds_data_dir,
                download=False,
            )
        except Exception as e:  # TFDS raises many kinds; one line for the user
            raise DataError(
                f"prompted task {task.name!r}: TFDS dataset {task.tfds_name!r} split "
                f"{task.tfds_split!r} cannot be read ({type(e).__name__}: {str(e)[:200]}); "
                "prepare it with `tfds build` and set tfds_data_dir"
            ) from None
        rows = []
        for i, ex in enumerate(tfds.as_numpy(ds)):
            rows.append((_decode(ex), f"{task.tfds_name}[{i}]"))
        return rows
    path = resolve_path(task.path, mixture.data_dir, mixture.base_dir)
    if not path.is_file():
        raise DataError(not_found(path, f"prompted task {task.name!r}: data file"))
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{n}: expected a JSON object")
            rows.append((obj, f"{path}:{n}"))
    return rows


def _decode(value):
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    return value


_CACHE: dict[tuple[str, str], dict[str, tuple[tuple[str, str], ...]]] = {}


def _examples_cached(mixture: PromptedMixture, name: str) -> dict[str, tuple[tuple[str, str]]]:
    key = (mixture.model_dump_json() + str(mixture.base_dir), name)
    if key not in _CACHE:
        _CACHE[key] = _render_task(mixture, name)
    return _CACHE[key]


def _render_task(mixture: PromptedMixture, name: str) -> dict[str, tuple[tuple[str, str], ...]]:
    task = next(t for t in mixture.tasks if t.name == name)
    templates = _templates(mixture, task)
    out: dict[str, list[tuple[str, str]]] = {s: [] for s in SPLITS}
    applied = dict.fromkeys((t.get("name") for t in templates), 0)
    for i, (row, where) in enumerate(_read_rows(mixture, task)):
        fields = _fields(task, row, where)
        split = "validation" if i % mixture.validation_every == 0 else "train"
        for t in templates:
            pair = render(t, fields, task.name)
            if pair is not None:
                out[split].append((pair[0], mixture.delimiter + pair[1]))
                applied[t.get("name")] += 1
    empty = [n for n, k in applied.items() if k == 0]
    if empty:
        raise DataError(
            f"prompted task {task.name!r}: template(s) {empty} render an empty prompt or target "
            "for every row; check their fields against the data (or leave them out with "
            "template_names)"
        )
    for split, pairs in out.items():
        if not pairs:
            raise DataError(f"prompted task {task.name!r}: no {split} examples")
    return {s: tuple(p) for s, p in out.items()}


def examples(mixture: PromptedMixture, task: str, split: str) -> tuple[tuple[str, str], ...]:
    """(prompt, target) pairs of one task's split (rows by index: every k-th is validation)."""
    if split not in SPLITS:
        raise DataError(f"split {split!r} is not known; accepted: {', '.join(SPLITS)}")
    return _examples_cached(mixture, task)[split]


def task_name(task: str) -> str:
    """The seqio Task name of a prompted task."""
    return f"{PREFIX}.{task}"


def mixture_name(mixture: PromptedMixture) -> str:
    """The seqio Mixture name of a prompted mixture (what `data.seqio_task` names)."""
    return f"{PREFIX}.{mixture.name}"


def fingerprint(mixture: PromptedMixture) -> str:
    """Id of what the training mixture reads: its config and its rendered examples."""
    h = hashlib.sha256(mixture.model_dump_json().encode())
    for task in mixture.train_tasks:
        for split in SPLITS:
            for p, t in examples(mixture, task.name, split):
                h.update(p.encode() + b"\0" + t.encode() + b"\1")
    return h.hexdigest()[:16]


def describe(mixture: PromptedMixture) -> list[dict]:
    """One row per task: name, cluster, role (train / held out / unused), examples per split."""
    train = {t.name for t in mixture.train_tasks}
    out = []
    for t in mixture.tasks:
        role = "held_out" if t.cluster in mixture.held_out_clusters else "unused"
        role = "train" if t.name in train else role
        row: dict = {"task": t.name, "cluster": t.cluster, "role": role}
        if role == "train":
            row |= {s: len(examples(mixture, t.name, s)) for s in SPLITS}
        out.append(row)
    return out


def zero_shot_tasks(
    mixture: PromptedMixture, given: tuple[str, ...] = (), key: str = "finetune"
) -> tuple[str, ...]:
    """The tasks a run finetuned on `mixture` is evaluated on zero-shot: `given`, or by
    default the mixture's held-out tasks with an `eval_task`; ConfigError, naming `key`,
    where one of them is trained on."""
    held = {t.eval_task for t in mixture.held_out_tasks if t.eval_task}
    eval_tasks = tuple(given) or tuple(sorted(held))
    trained = {t.eval_task or t.name for t in mixture.train_tasks}
    leaked = sorted(set(eval_tasks) & trained)
    if leaked:
        raise ConfigError(
            f"{key}: evaluation tasks {leaked} are in the training mixture "
            f"{mixture.name!r} (it trains {sorted(trained)}); zero-shot evaluation needs "
            "held-out tasks"
        )
    return eval_tasks
