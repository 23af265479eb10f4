"""Few-shot prompts: K demonstrations before each question, as lm-evaluation-harness builds them.

A prompt is

    description + demo_1 + fewshot_delimiter + ... + demo_K + fewshot_delimiter + context

where a demonstration is an example's context, the task's delimiter (the harness's
`target_delimiter`) and its right answer; the choices are then scored after the prompt as in
zero-shot evaluation. The architecture decides where the prompt goes, as it does for any
context: the causal decoder reads it causally, the non-causal decoder holds it in its
bidirectional prefix, the encoder-decoder's encoder reads it.

Demonstrations are drawn per scored example, in example order, from one
`random.Random(eval.fewshot_seed)`: K examples of another split (`eval.fewshot_files`, a task
YAML's `fewshot_path`), or K + 1 of the task's own examples with the scored one removed (the
harness's sampler with `fewshot_split` set to the scored split; the same seed shows the same
demonstrations). The scored example is removed as that row, not as every row equal to it: a
repeated item may show its twin. Examples of a built-in probe
draw only from examples of their own pool (`Example.pool`), and so do examples scored against
a demonstration split whose examples carry pools (the in-context probe's: each episode's lines,
a pool disjoint from the scored items).

Context budget: a prompt longer than its pair's budget (`budget.context_budget`; for a task
with `demos_within_training`, also what training's rows hold beside the continuation) loses
whole demonstrations from the front until it fits, never part of one; each example's record says
how many it really got and which, `<task>/shots` is the mean, `<task>/fewshot_dropped` counts
the examples given fewer than K.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from scalestudy.evaluate.examples import Example, Task
from scalestudy.evaluate.formats import TaskDataError


def task_name(name: str, k: int) -> str:
    """The name K-shot results are reported under ("<task>.<K>shot"; zero-shot: the task's)."""
    return f"{name}.{k}shot" if k else name


_SHOT_NAME = re.compile(r"\.(\d+)shot$")


def shots_of(name: str) -> int:
    """K of a result's task name ("copa.4shot" -> 4; a zero-shot task's name -> 0)."""
    m = _SHOT_NAME.search(name)
    return int(m[1]) if m else 0


def in_context_results(tasks: Iterable[str]) -> set[str]:
    """The result task names among `tasks` that belong to a task scored with demonstrations:
    its "<task>.<K>shot" rows and its zero-shot row "<task>" (reports read them as one curve
    over K, apart from the zero-shot tasks; the in-context probe is at chance at K = 0 by
    construction)."""
    tasks = set(tasks)
    bases = {_SHOT_NAME.sub("", t) for t in tasks if shots_of(t)}
    return {t for t in tasks if shots_of(t) or t in bases}


def in_context_tasks(results: Mapping[str, object]) -> set[str]:
    """`in_context_results` of the task names in a run's results (`eval/<task>/<metric>`)."""
    return in_context_results(key.split("/")[1] for key in results if key.count("/") == 2)


def demonstration(task: Task, example: Example) -> str:
    """An example as a demonstration: its (gold) context, the delimiter, its right answer."""
    context, answer = example.pairs()[example.gold]
    return context + task.delimiter + answer


@dataclass(frozen=True)
class Shots:
    """One scored example's demonstrations: those drawn (pool indices, in prompt order) and
    how many of them the prompt kept (the last `kept`: they are dropped from the front)."""

    drawn: tuple[int, ...]
    kept: int


def _pool(task: Task) -> tuple[list[Example], bool]:
    """The demonstration pool and whether it is the scored split itself."""
    if task.demos is not None:
        return list(task.demos), False
    return list(task.examples), True


def draw(task: Task, examples: list[Example], k: int, seed: int) -> list[tuple[int, ...]]:
    """Per example, the pool indices of its K demonstrations (the harness's sampler: from the
    scored split, K + 1 drawn and the scored example removed; from a demonstration split
    whose examples carry pools, K of the scored example's pool)."""
    pool, same_split = _pool(task)
    pooled = same_split or any(d.pool for d in pool)
    rnd = random.Random(seed)
    by_pool: dict[str, list[int]] = {}
    for i, d in enumerate(pool):
        by_pool.setdefault(d.pool if pooled else "", []).append(i)
    out = []
    for ex in examples:
        candidates = by_pool.get(ex.pool if pooled else "", [])
        others = [i for i in candidates if pool[i] is not ex] if same_split else candidates
        if len(others) < k:
            where = (
                f"the task's own {len(candidates)} examples"
                + (f" of pool {ex.pool!r}" if ex.pool else "")
                + " without the scored one"
                if same_split
                else (task.demos_source or "its demonstration split")
                + (f", pool {ex.pool!r}" if pooled and ex.pool else "")
            )
            raise TaskDataError(
                f"task {task.name!r}: eval.num_fewshot={k} but only {len(others)} "
                f"demonstrations are available ({where}); lower eval.num_fewshot or give a "
                "larger demonstration split (eval.fewshot_files, a task YAML's fewshot_path)"
            )
        if not k:
            out.append(())
            continue
        if not same_split:
            out.append(tuple(candidates[j] for j in _sample(rnd, len(candidates), k)))
            continue
        picked = [candidates[j] for j in _sample(rnd, len(candidates), k + 1)]
        out.append(tuple(i for i in picked if pool[i] is not ex)[:k])
    return out


def _sample(rnd: random.Random, n: int, k: int) -> list[int]:
    """k distinct positions of a population of n, as `rnd.sample(population, k)` picks them."""
    return rnd.sample(range(n), k)


def fewshot_examples(
    task: Task,
    examples: list[Example],
    k: int,
    seed: int,
    delimiter: str,
    encode: Callable[[str], list[int]],
    budget: Callable[[list[Example]], list[np.ndarray]],
) -> tuple[list[Example], list[Shots]]:
    """`examples` with K demonstrations before each context, and each example's `Shots`.

    `budget(examples)` gives, per example, the context tokens each of its pairs may keep;
    demonstrations that would take a prompt past it are dropped from the front. Refused
    (TaskDataError) when no example can hold even one demonstration.
    """
    pool, _ = _pool(task)
    drawn = draw(task, examples, k, seed)
    fewshot_delimiter = delimiter if task.fewshot_delimiter is None else task.fewshot_delimiter
    budgets = budget(examples)
    out, shots = [], []
    for ex, picks, room in zip(examples, drawn, budgets, strict=True):
        demos = [demonstration(task, pool[i]) + fewshot_delimiter for i in picks]
        for start in range(len(demos) + 1):
            prefix = task.description + "".join(demos[start:])
            contexts = tuple(prefix + c for c in ex.contexts)
            if start == len(demos) or _fits(contexts, ex, room, encode):
                break
        out.append(dataclasses.replace(ex, contexts=contexts))
        shots.append(Shots(picks, len(demos) - start))
    if k and examples and not any(s.kept for s in shots):
        raise TaskDataError(
            f"task {task.name!r}: not one {k}-shot prompt fits a single demonstration in its "
            "context budget; raise eval.inputs_length (or eval.max_length), or evaluate it "
            "with fewer shots"
        )
    return out, shots


def _fits(contexts: tuple[str, ...], ex: Example, room: np.ndarray, encode) -> bool:
    """Whether every pair of the example keeps its whole context within its `room`."""
    pairs = dataclasses.replace(ex, contexts=contexts).pairs()
    lengths = {c: len(encode(c)) for c in contexts}
    return all(lengths[c] <= r for (c, _), r in zip(pairs, room.tolist(), strict=True))


def shot_records(task: Task, shots: list[Shots]) -> list[dict]:
    """Per example: how many demonstrations its prompt held and which (their sources)."""
    pool, _ = _pool(task)
    return [
        {
            "shots": s.kept,
            "shown": [pool[i].source for i in s.drawn[len(s.drawn) - s.kept :]],
            "fewshot_dropped": len(s.drawn) - s.kept,
        }
        for s in shots
    ]


def shot_metrics(prefix: str, k: int, shots: list[Shots]) -> dict[str, float]:
    """`<task>/shots` (mean demonstrations per example) and `<task>/fewshot_dropped`."""
    kept = np.array([s.kept for s in shots], dtype=np.float64)
    return {
        f"{prefix}/shots": float(kept.mean()) if kept.size else 0.0,
        f"{prefix}/fewshot_dropped": int((kept < k).sum()),
    }
