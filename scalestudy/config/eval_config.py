"""Zero-shot evaluation configs: the `eval` section of a run and tasks defined in YAML.

`EvalConfig` is one section of `config.ExperimentConfig`; `TaskConfig` describes a task over a
JSONL file entirely in configuration (evaluate/generic.py reads it).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from scalestudy.config.base import Frozen, Tuple
from scalestudy.config.errors import ConfigError
from scalestudy.config.yamlio import shown


class TaskConfig(Frozen):
    """A zero-shot task defined entirely in YAML over a JSONL file (evaluate/generic.py).

    kind "choice": each row has a context and choices, scored as context + delimiter + choice;
    "partial": the choices field holds one context per option, all followed by the shared
    `continuation_field` (Winogrande); "last_word": context + continuation, exact match and
    perplexity (LAMBADA); "pair": two sentences per row (`choice_fields`, the acceptable one
    first), each scored whole with no context, the more probable one picked (BLiMP).
    """

    empty_ok = frozenset({"delimiter", "fewshot_delimiter"})  # "": choice right after context

    name: str = Field(min_length=1)
    path: str  # JSONL; relative paths: to the task YAML's folder, then eval.data_dir, then cwd
    kind: Literal["choice", "partial", "last_word", "pair"] = "choice"
    group_field: str | None = None  # per-group accuracy by this field's value (pair, choice)
    context_field: str = "query"
    choices_field: str | None = "choices"  # a list field ...
    choice_fields: Tuple = ()  # ... or several fields, one per choice ...
    choices: Tuple = ()  # ... or the same choice texts for every row (e.g. [no, yes])
    label_field: str = "gold"  # an index, a digit string, a bool, or the text of the right choice
    label_names: Tuple = ()  # label values in choice order, e.g. [entailment, not_entailment]
    label_offset: int = 0  # subtracted from integer labels (1 for 1-based labels)
    continuation_field: str = "continuation"  # partial and last_word
    template: str | None = None  # Jinja over the row's fields; default: the context field
    choice_template: str | None = None  # Jinja over the row's fields and `choice`
    delimiter: str = " "  # between context and choice (the harness's target_delimiter)
    metric: Literal["acc", "acc_norm"] = "acc"
    # Few-shot prompts (eval.num_fewshot > 0; evaluate/fewshot.py): text before the
    # demonstrations, what follows each demonstration (None: eval.fewshot_delimiter), and the
    # file demonstrations are drawn from (the same format; None: this file without the
    # scored example).
    description: str = Field("", exclude_if=lambda v: v == "")
    fewshot_delimiter: str | None = Field(None, exclude_if=lambda v: v is None)
    fewshot_path: str | None = Field(None, exclude_if=lambda v: v is None)

    @model_validator(mode="after")
    def _check(self) -> TaskConfig:
        if self.kind == "last_word":
            return self
        if self.kind == "pair" and len(self.choice_fields) != 2:
            raise ConfigError(
                f"task {self.name!r}: kind 'pair' needs choice_fields: [acceptable, "
                f"unacceptable] (two field names); got {list(self.choice_fields)}"
            )
        sources = [
            f"choices_field={self.choices_field!r}" if self.choices_field else "",
            f"choice_fields={list(self.choice_fields)}" if self.choice_fields else "",
            f"choices={list(self.choices)}" if self.choices else "",
        ]
        if self.choice_fields or self.choices:  # explicit lists replace the default list field
            sources[0] = ""
        given = [s for s in sources if s]
        if len(given) != 1:
            raise ConfigError(
                f"task {self.name!r}: give exactly one source of choices (choices_field: a list "
                f"field; choice_fields: one field per choice; choices: fixed texts); got "
                f"{', '.join(given) or 'none'}"
            )
        return self

    @property
    def choice_source(self) -> str:
        if self.choices:
            return "choices"
        return "choice_fields" if self.choice_fields else "choices_field"


class EvalConfig(Frozen):
    """Zero-shot evaluation: task names from the registry, YAML task files, or inline tasks."""

    empty_ok = frozenset({"fewshot_delimiter"})  # "": demonstrations run into each other

    tasks: Tuple = ("synthetic_probes",)
    custom_tasks: Annotated[tuple[TaskConfig, ...], Field(strict=False)] = ()
    data_dir: str | None = None  # where released task files live (layout: README `eval`)
    tfds_data_dir: str | None = None  # TFDS tasks: where datasets are prepared (None: default)
    batch_size: int = Field(32, ge=1)  # rows (context-choice pairs) per scoring call
    max_examples: int | None = Field(None, ge=1)  # per task
    prompts: Literal["harness", "promptsource"] = "harness"
    every_steps: int = Field(0, ge=0)  # 0: only at the end of training
    # Context budget in tokens (contexts cut from the left, reported); None: no cut (rule
    # "same") or the training length (rule "wang2022"). Continuations are never cut: rows grow
    # to the longest, at least targets_length. Rules: docs/evaluation.md, evaluate/budget.py.
    inputs_length: int | None = Field(None, ge=1)
    targets_length: int | None = Field(None, ge=1)
    context_rule: Literal["same", "wang2022"] = "same"
    max_length: int = Field(2048, ge=1)  # longest scoring row; a task needing more is refused
    # Few-shot prompts (evaluate/fewshot.py): each K > 0 scores every task again with K
    # demonstrations before each question, reported as "<task>.<K>shot/<metric>". Left out
    # of dumps (and settings keys) while zero-shot only.
    num_fewshot: Tuple = Field((0,), exclude_if=lambda v: tuple(v) == (0,))
    # task name (as in `tasks`) -> its own numbers of demonstrations, in place of num_fewshot
    # (e.g. the in-context probe at [0, 1, 2, 4, 8] beside zero-shot probes)
    num_fewshot_per_task: dict[str, Tuple] = Field(
        default_factory=dict, strict=False, exclude_if=lambda v: not v
    )
    # the harness's default; a seed of NumPy's generators (config.MAX_SEED)
    fewshot_seed: int = Field(1234, ge=0, le=2**31 - 1, exclude_if=lambda v: v == 1234)
    fewshot_delimiter: str = Field("\n\n", exclude_if=lambda v: v == "\n\n")
    # registered task name -> the file its demonstrations come from (another split of the
    # release, in the same format); a task not named draws from its own file minus the
    # scored example
    fewshot_files: dict[str, str] = Field(
        default_factory=dict, strict=False, exclude_if=lambda v: not v
    )

    @field_validator("num_fewshot", mode="before")
    @classmethod
    def _shots(cls, value):
        return _shot_list("eval.num_fewshot", value)

    @field_validator("num_fewshot_per_task", mode="before")
    @classmethod
    def _shots_per_task(cls, value):
        if value is None:  # cleared (`eval --num-fewshot` sets K for every task)
            return {}
        if not isinstance(value, dict):
            raise ConfigError(
                f"eval.num_fewshot_per_task={value!r}; accepted: a mapping of task name to "
                "numbers of demonstrations, e.g. {incontext_probe: [0, 1, 2, 4, 8]}"
            )
        return {
            str(task): _shot_list(f"eval.num_fewshot_per_task.{task}", shots)
            for task, shots in value.items()
        }

    @field_validator("fewshot_files", mode="before")
    @classmethod
    def _files(cls, value):
        if not isinstance(value, dict):
            return value  # pydantic names the type
        for task, path in value.items():
            if not isinstance(path, str) or not path:
                # `{copa:/x.jsonl}` in YAML is one key "copa:/x.jsonl" with no value
                raise ConfigError(
                    f"eval.fewshot_files.{task}={shown(path)}; accepted: a task name and the "
                    "file its demonstrations come from, with a space after the colon, e.g. "
                    "eval.fewshot_files={copa: data/copa/train.jsonl}"
                )
        return value

    def shots(self, task: str) -> tuple[int, ...]:
        """The numbers of demonstrations `task` is scored with."""
        return tuple(self.num_fewshot_per_task.get(task, self.num_fewshot))

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        bad = [t for t in self.tasks if not isinstance(t, str) or not t.strip()]
        if bad:
            raise ConfigError(
                f"eval.tasks holds {bad!r}; each entry is a task name (synthetic_probes, copa, "
                "blimp, ...), a task YAML file or 'blimp:PATH' / 'text:PATH', as a string"
            )
        if not self.tasks and not self.custom_tasks:
            raise ConfigError(
                "eval.tasks is empty (and there are no eval.custom_tasks): nothing would be "
                "evaluated; give task names or task YAML files, e.g. eval.tasks=[synthetic_probes]"
            )
        return self


def _shot_list(key: str, value) -> tuple[int, ...]:
    """Numbers of demonstrations: whole numbers >= 0, each once, in the order given."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 0]
    if bad or not values:
        raise ConfigError(
            f"{key}={value!r}; accepted: a whole number of demonstrations >= 0, "
            "or a list of them, e.g. 0 or [0, 1, 2, 4, 8]"
        )
    check_once(key, values)
    return tuple(values)


def check_once(key: str, values: list) -> None:
    """Refuse a list that names a value twice (a K scored twice, a seed trained twice),
    naming the repeat: which of the two was meant is the user's to say."""
    seen: set = set()
    twice = [v for v in values if v in seen or seen.add(v)]
    if twice:
        raise ConfigError(
            f"{key}={shown(values)} gives {shown(twice[0])} twice; each value once is accepted"
        )
