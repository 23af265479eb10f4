"""What a zero-shot task is made of: `Example`s to score and the `Task` that holds them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["choice", "last_word", "text"]


@dataclass(frozen=True)
class Example:
    """One item: the choices are scored as `context + delimiter + choice`.

    `contexts` holds one shared context, or one per choice (partial scoring: Winogrande's
    option-filled contexts before one shared continuation).
    """

    contexts: tuple[str, ...]
    choices: tuple[str, ...]
    gold: int = 0
    group: str = ""  # sub-task (probe name, prompt template) for per-group metrics
    # Where it comes from: the release's own id (`formats.source_id`), else file:line. Not
    # part of equality: the same item read from two formats is the same example.
    source: str = field(default="", compare=False)
    # Few-shot demonstrations come from those with the same pool (probes: the same kind; the
    # in-context probe: the same episode, in its own demonstration split).
    pool: str = field(default="", compare=False)

    def pairs(self) -> list[tuple[str, str]]:
        """(context, continuation) for each choice."""
        if len(self.contexts) == 1:
            return [(self.contexts[0], c) for c in self.choices]
        return list(zip(self.contexts, self.choices, strict=True))


@dataclass(frozen=True)
class Task:
    """Examples to score and how to report them.

    kind "choice": rank classification (acc, acc_norm); "last_word": greedy exact match of the
    continuation and perplexity; "text": loss per token and bits per byte over documents.
    `aggregate` combines per-group accuracies into the task's (promptsource: median).
    """

    name: str
    kind: Kind
    examples: tuple[Example, ...]
    source: str
    metric: str = "acc"
    delimiter: str = " "
    aggregate: Literal["all", "median"] = "all"
    info: dict = field(default_factory=dict)
    # Few-shot prompts (evaluate/fewshot.py): text before the demonstrations, what follows
    # each demonstration (None: eval.fewshot_delimiter), and where demonstrations come from
    # (None: the task's own examples, the scored one excluded).
    description: str = ""
    fewshot_delimiter: str | None = None
    demos: tuple[Example, ...] | None = None
    demos_source: str = ""
    # Demonstrations dropped from the front so that a prompt stays within the rows the model
    # trained on (a built-in probe whose prompts are designed to fit them).
    demos_within_training: bool = False
