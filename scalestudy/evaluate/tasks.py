"""Zero-shot task registry: released files, generic YAML tasks, TFDS, synthetic probes.

A task name resolves, in order, to:
  `synthetic_probes`           the built-in corpus's probe tasks (data/synthetic.py)
  `incontext_probe`            colours of made-up words given only in the prompt (few-shot)
  `blimp` or `blimp:PATH`      BLiMP minimal pairs (a directory of paradigm files, blimp.py)
  `text:PATH`                  held-out loss / bits per byte over a text file
  `NAME:PATH`                  a registered task read from an explicit release file
  `tfds:NAME` or `a/b`         a TFDS dataset prepared on this machine (e.g. `super_glue/copa`)
  `PATH.yaml`                  a generic multiple-choice task (a TaskConfig mapping)
  `NAME`                       a registered task read from its release file under `data_dir`

`data_dir` has the layout of ../shared/data/eval (see `DEFAULT_FILES`).

Kept whole: one name, one resolution order; splitting the resolvers from the order they are
tried in would leave a reader two files to learn which source a name means.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from scalestudy.config.errors import ConfigError, not_found, path_kind
from scalestudy.config.eval_config import EvalConfig, TaskConfig
from scalestudy.config.experiment import SyntheticConfig
from scalestudy.config.yamlio import read_yaml, validate
from scalestudy.data import require_seqio, sources
from scalestudy.data.synthetic import (
    INCONTEXT_DELIMITER,
    incontext_demonstrations,
    incontext_probe,
    probe_tasks,
)
from scalestudy.evaluate import generic, prompts
from scalestudy.evaluate.blimp import load_blimp
from scalestudy.evaluate.examples import Example, Kind, Task
from scalestudy.evaluate.formats import (
    Row,
    TaskDataError,
    read_rows,
    require_file,
    resolve_data_dir,
    source_id,
)
from scalestudy.evaluate.promptsource import promptsource_task

__all__ = ["REGISTRY", "Spec", "Task", "check_names", "load_task", "load_tasks"]


@dataclass(frozen=True)
class Spec:
    """A registered task: its release file under data_dir and how to read it."""

    files: tuple[str, ...]  # candidates under data_dir, first existing wins
    kind: Kind = "choice"
    metric: str = "acc"
    keep: tuple[str, int, int] | None = None  # (field, lo, hi): the default file's standard split
    tfds: tuple[str, str] | None = None  # (name, split)
    promptsource: str | None = None  # directory under promptsource_templates/


REGISTRY: dict[str, Spec] = {
    # COPA: the SuperGLUE validation split (dev ids 401-500), as the harness and T0 evaluate it.
    "copa": Spec(
        ("copa/copa-dev.xml", "copa/copa-dev.jsonl"),
        keep=("id", 401, 500),
        tfds=("super_glue/copa", "validation"),
        promptsource="super_glue/copa",
    ),
    "piqa": Spec(
        ("piqa/valid.jsonl",), metric="acc_norm", tfds=("piqa", "validation"), promptsource="piqa"
    ),
    "hellaswag": Spec(
        ("hellaswag/hellaswag_val.jsonl",),
        metric="acc_norm",
        tfds=("hellaswag", "validation"),
        promptsource="hellaswag",
    ),
    "boolq": Spec(
        ("boolq/boolq_dev.llmfoundry.jsonl",),
        tfds=("super_glue/boolq", "validation"),
        promptsource="super_glue/boolq",
    ),
    "arc_easy": Spec(
        ("arc_easy/arc_easy_test.llmfoundry.jsonl",),
        metric="acc_norm",
        tfds=("ai2_arc/ARC-Easy", "test"),
        promptsource="ai2_arc/ARC-Easy",
    ),
    "winogrande": Spec(
        ("winogrande/winogrande_xl_dev.llmfoundry.jsonl",),
        tfds=("winogrande/winogrande_xl", "validation"),
    ),
    "lambada": Spec(
        ("lambada/lambada_openai_test.llmfoundry.jsonl",),
        kind="last_word",
        tfds=("lambada", "test"),
    ),
    "rte": Spec(
        ("rte/val.jsonl",), tfds=("super_glue/rte", "validation"), promptsource="super_glue/rte"
    ),
    "cb": Spec(
        ("cb/val.jsonl",), tfds=("super_glue/cb", "validation"), promptsource="super_glue/cb"
    ),
    "wic": Spec(
        ("wic/dev.jsonl", "wic/dev.data.txt"),
        tfds=("super_glue/wic", "validation"),
        promptsource="super_glue/wic",
    ),
    "wsc": Spec(
        ("wsc_superglue/val.jsonl",),
        tfds=("super_glue/wsc.fixed", "validation"),
        promptsource="super_glue/wsc.fixed",
    ),
    # Tasks of Wang et al.'s evaluation (T0's held-out set and the harness tasks) not above;
    # the released files are not bundled: give them under data_dir in these layouts, as
    # NAME:PATH, or prepare the TFDS dataset. ANLI: the dev set of each round, as T0 reports.
    "anli_r1": Spec(("anli/R1/dev.jsonl",), tfds=("anli/r1", "validation"), promptsource="anli"),
    "anli_r2": Spec(("anli/R2/dev.jsonl",), tfds=("anli/r2", "validation"), promptsource="anli"),
    "anli_r3": Spec(("anli/R3/dev.jsonl",), tfds=("anli/r3", "validation"), promptsource="anli"),
    # StoryCloze 2016 validation (1,871 stories), the release's CSV.
    "story_cloze": Spec(
        (
            "story_cloze/cloze_test_val__spring2016 - cloze_test_ALL_val.csv",
            "story_cloze/validation.jsonl",
        ),
        promptsource="story_cloze/2016",
    ),
    "arc_challenge": Spec(
        ("arc_challenge/ARC-Challenge-Test.jsonl", "arc_challenge/arc_challenge_test.jsonl"),
        metric="acc_norm",
        tfds=("ai2_arc/ARC-Challenge", "test"),
        promptsource="ai2_arc/ARC-Challenge",
    ),
    "openbookqa": Spec(
        ("openbookqa/Main/test.jsonl",),
        metric="acc_norm",
        promptsource="openbookqa/main",
    ),
    "sciq": Spec(("sciq/test.json",), tfds=("sciq", "test")),
    # GLUE validation sets (the GLUE download's dev.tsv; test labels are not public).
    "mrpc": Spec(("glue/MRPC/dev.tsv",), tfds=("glue/mrpc", "validation")),
    "qnli": Spec(("glue/QNLI/dev.tsv",), tfds=("glue/qnli", "validation")),
    "sst2": Spec(("glue/SST-2/dev.tsv",), tfds=("glue/sst2", "validation")),
    "wnli": Spec(("glue/WNLI/dev.tsv",), tfds=("glue/wnli", "validation")),
    "qqp": Spec(("glue/QQP/dev.tsv",), tfds=("glue/qqp", "validation")),
    # PubMedQA's 1,000 expert-labelled questions, as the harness scores them.
    "pubmedqa": Spec(("pubmedqa/ori_pqal.json",)),
    "mathqa": Spec(("mathqa/test.json",), metric="acc_norm"),
    "logiqa": Spec(("logiqa/Test.txt",), metric="acc_norm"),
}
DEFAULT_FILES = {name: spec.files[0] for name, spec in REGISTRY.items()}
# Tasks that need no file: the synthetic corpus's probes, and BLiMP under data_dir.
BUILT_IN = ("synthetic_probes", "incontext_probe", "blimp")
TFDS_NAMES = {spec.tfds[0]: name for name, spec in REGISTRY.items() if spec.tfds}


def build_examples(name: str, rows: list[Row]) -> tuple[Example, ...]:
    """Examples of registered task `name` from release rows (harness prompts)."""
    build = prompts.BUILDERS[name]
    return tuple(dataclasses.replace(build(row), source=source_id(row)) for row in rows)


def _registered(name: str, path: Path | None, data_dir, prompt_set: str) -> Task:
    spec = REGISTRY[name]
    keep = None
    if path is None:
        root = resolve_data_dir(data_dir)
        found = [root / f for f in spec.files if (root / f).is_file()]
        if not found:
            raise TaskDataError(
                f"task {name!r}: none of {', '.join(spec.files)} under {root}; give the file "
                f"explicitly as {name}:PATH, or --data-dir pointing at the released task files"
            )
        path, keep = found[0], spec.keep
    rows = read_rows(path)
    if keep is not None:
        key, lo, hi = keep
        rows = [r for r in rows if lo <= int(r.get(key, (int, str))) <= hi]
    if prompt_set == "promptsource":
        return promptsource_task(name, spec.promptsource, rows, str(path), data_dir)
    return Task(name, spec.kind, build_examples(name, rows), str(path), spec.metric)


def _decode(value):
    """TFDS numpy values -> plain Python (bytes to str, arrays to lists, dicts recursively)."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    if hasattr(value, "tolist"):
        return _decode(value.tolist())
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _tfds(tfds_name: str, tfds_data_dir: str | None) -> Task:
    base = tfds_name.partition(":")[0]  # name[:version]
    if base not in TFDS_NAMES:
        raise TaskDataError(
            f"no prompt mapping for TFDS dataset {base!r}; accepted: "
            f"{', '.join(sorted(TFDS_NAMES))} (or write a generic task YAML over a JSONL export)"
        )
    name = TFDS_NAMES[base]
    split = REGISTRY[name].tfds[1]
    require_seqio(
        f"the TFDS task {tfds_name!r}",
        instead=f"score the task's released file instead (`{name}:PATH`, or `{name}` with "
        "eval.data_dir), which needs none of them",
    )
    import tensorflow_datasets as tfds

    try:  # try_gcs=False and no download: a missing dataset is an error, never a network wait
        builder = tfds.builder(tfds_name, data_dir=tfds_data_dir, try_gcs=False)
        prepared = builder.is_prepared()
    except Exception as e:  # TFDS raises several types for unknown or unregistered names
        raise TaskDataError(f"TFDS dataset {tfds_name!r} unavailable: {e}") from None
    if not prepared:
        raise TaskDataError(
            f"TFDS dataset {tfds_name!r} is not prepared in {builder.data_dir}; prepare it with "
            f"`tfds build {base}` where there is network access (or set eval.tfds_data_dir), "
            f"or use the released files: --tasks {name} --data-dir DIR"
        )
    ds = builder.as_dataset(split=split)
    rows = [
        Row(_decode(x), f"tfds:{tfds_name}[{split}] #{i}") for i, x in enumerate(tfds.as_numpy(ds))
    ]
    spec = REGISTRY[name]
    return Task(name, spec.kind, build_examples(name, rows), f"tfds:{tfds_name}", spec.metric)


def _probes(synthetic: SyntheticConfig | None) -> Task:
    examples = []
    for group, items in probe_tasks(synthetic or SyntheticConfig()).items():
        for i, item in enumerate(items):
            row = Row(item, f"{group}[{i}]")
            choices = prompts.check_choices(
                row, tuple(row.get("choices", (list, tuple))), "choices"
            )
            gold = prompts.gold_index(row, "gold", choices)
            context = row.get("context", str)
            examples.append(Example((context,), choices, gold, group, row.where, pool=group))
    return Task("synthetic_probes", "choice", tuple(examples), "data.synthetic.probe_tasks")


def _incontext(synthetic: SyntheticConfig | None) -> Task:
    """The in-context probe: demonstrations come from the scored item's own episode, in a
    pool of their own (never a scored item), and a prompt keeps within training's rows."""
    cfg = synthetic or SyntheticConfig()
    examples = []
    for i, item in enumerate(incontext_probe(cfg)):
        where = f"incontext_probe[{i}] (episode {item['episode']})"
        ex = Example((item["context"],), tuple(item["choices"]), item["gold"], source=where)
        examples.append(dataclasses.replace(ex, pool=item["episode"]))
    demos = tuple(
        Example(
            (d["context"],),
            (d["answer"],),
            0,
            source=f"incontext_demonstrations[{i}] (episode {d['episode']})",
            pool=d["episode"],
        )
        for i, d in enumerate(incontext_demonstrations(cfg))
    )
    return Task(
        "incontext_probe",
        "choice",
        tuple(examples),
        "data.synthetic.incontext_probe",
        fewshot_delimiter=INCONTEXT_DELIMITER,
        demos=demos,
        demos_source="data.synthetic.incontext_demonstrations",
        demos_within_training=True,
    )


def _text(path: str, name: str = "text") -> Task:
    file = require_file(path, "text file")
    text = sources.read_text(file)
    if not text.strip():
        raise TaskDataError(f"{file}: empty text file")
    return Task(name, "text", (Example(("",), (text,)),), str(file), "bpb")


def _reader(spec: str) -> str | None:
    """Which of the forms in this module's docstring the task name `spec` has (the reader
    `load_task` gives it), or None for a name no reader takes."""
    head, sep, _ = spec.partition(":")
    if spec in ("synthetic_probes", "incontext_probe"):
        return spec
    if sep and head in ("text", "tfds"):
        return head
    if spec == "blimp" or (sep and head == "blimp"):
        return "blimp"
    if sep and head in REGISTRY:
        return "registered_file"
    if spec.endswith((".yaml", ".yml")):
        return "yaml"
    if spec in REGISTRY:
        return "registered"
    if "/" in spec and head in TFDS_NAMES:
        return "tfds_name"
    return None


ACCEPTED = (*BUILT_IN, *REGISTRY, "NAME:PATH", "text:PATH", "tfds:NAME", "FILE.yaml")


def load_task(
    name_or_path: str | TaskConfig,
    data_dir: str | Path | None = None,
    prompts: str = "harness",
    *,
    synthetic: SyntheticConfig | None = None,
    tfds_data_dir: str | None = None,
) -> Task:
    """Load one task by name, `NAME:PATH`, TFDS name, task YAML file or TaskConfig."""
    if isinstance(name_or_path, TaskConfig):
        return generic.generic_task(name_or_path, data_dir)
    spec = str(name_or_path)
    if prompts not in ("harness", "promptsource"):
        raise ConfigError(f"eval.prompts={prompts!r}; accepted: harness, promptsource")
    head, sep, tail = spec.partition(":")
    reader = _reader(spec)
    if reader == "synthetic_probes":
        return _probes(synthetic)
    if reader == "incontext_probe":
        return _incontext(synthetic)
    if reader == "text":
        return _text(tail)
    if reader in ("tfds", "tfds_name"):
        return _tfds(tail if reader == "tfds" else spec, tfds_data_dir)
    if reader == "blimp":
        return load_blimp(Path(tail) if sep else resolve_data_dir(data_dir) / "blimp")
    if reader == "registered_file":
        return _registered(head, Path(tail), data_dir, prompts)
    if reader == "yaml":
        path = require_file(spec, "task YAML file")
        cfg = validate(TaskConfig, read_yaml(path), str(path))
        return generic.generic_task(cfg, data_dir, base_dir=path.parent)
    if reader == "registered":
        return _registered(spec, None, data_dir, prompts)
    raise TaskDataError(f"unknown task {spec!r}; accepted: {', '.join(ACCEPTED)}")


def task_path(spec: str) -> tuple[Path, tuple[str, ...]] | None:
    """The local path a task name reads and the kinds it may be ("a file", "a directory"),
    for `text:PATH`, `blimp:PATH`, `NAME:PATH` and `FILE.yaml`; None for a task read from the
    data directory, TFDS or built in."""
    _, sep, tail = spec.partition(":")
    reader = _reader(spec)
    if reader == "text":
        return Path(tail), ("a file",)
    if reader == "blimp" and sep:  # a directory of paradigm files, or one paradigm's file
        return Path(tail), ("a directory", "a file")
    if reader == "registered_file":
        return Path(tail), ("a file", "a directory")
    if reader == "yaml":
        return Path(spec), ("a file",)
    return None


def check_spelling(names: Sequence[str], key: str = "eval.tasks") -> None:
    """ConfigError, naming `key`, for a task name no reader takes (files are not looked
    for: a study's cluster runs read theirs where they run)."""
    for name in names:
        if _reader(name) is None:
            close = difflib.get_close_matches(name, [*BUILT_IN, *REGISTRY], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{key}: unknown task {name!r}{hint}; accepted: {', '.join(ACCEPTED)}"
            )


def check_names(names: Sequence[str], key: str = "eval.tasks") -> None:
    """ConfigError, naming `key`, for a task name no reader takes, or one whose local file
    (`text:PATH`, `blimp:PATH`, `NAME:PATH`, `FILE.yaml`) is not there: checked where a
    config is loaded, not first when a trained run is evaluated. Tasks read from the data
    directory or TFDS are looked for then (`--data-dir` may name it)."""
    check_spelling(names, key)
    for name in names:
        found = task_path(name)
        if found is not None and path_kind(found[0]) not in found[1]:
            expected = " or ".join(found[1])
            raise ConfigError(
                f"{key}: {name!r}: " + not_found(found[0], "the task's data", expected)
            )


def load_tasks(
    eval_cfg: EvalConfig,
    synthetic: SyntheticConfig | None = None,
    names: list[str] | None = None,
    data_dir: str | None = None,
) -> list[Task]:
    """The tasks of an EvalConfig: `tasks` plus `custom_tasks`, or just `names` when given."""
    data_dir = eval_cfg.data_dir if data_dir is None else data_dir
    tasks = [
        load_task(
            n, data_dir, eval_cfg.prompts, synthetic=synthetic, tfds_data_dir=eval_cfg.tfds_data_dir
        )
        for n in (eval_cfg.tasks if names is None else names)
    ]
    if names is None:
        tasks += [generic.generic_task(tc, data_dir) for tc in eval_cfg.custom_tasks]
    seen = [t.name for t in tasks]
    dupes = sorted({n for n in seen if seen.count(n) > 1})
    if dupes:
        raise ConfigError(f"duplicate task names {dupes}; give each task a distinct name")
    if names is None:
        check_fewshot_files(eval_cfg, tasks)
    return [_with_demos(t, eval_cfg, data_dir) for t in tasks]


def _with_demos(task: Task, eval_cfg: EvalConfig, data_dir) -> Task:
    """`task` with its demonstration split from eval.fewshot_files, when one is named."""
    path = eval_cfg.fewshot_files.get(task.name)
    if path is None:
        return task
    demos = _registered(task.name, Path(path), data_dir, eval_cfg.prompts)
    return dataclasses.replace(task, demos=demos.examples, demos_source=demos.source)


def check_fewshot_files(eval_cfg: EvalConfig, tasks: list[Task]) -> None:
    """Refuse eval.fewshot_files and eval.num_fewshot_per_task entries that name no task being
    evaluated."""
    names = {t.name for t in tasks}
    bad = [n for n in eval_cfg.fewshot_files if n not in REGISTRY or n not in names]
    if bad:
        raise ConfigError(
            f"eval.fewshot_files names {bad}: each key is a registered task being evaluated "
            f"({', '.join(sorted(names & set(REGISTRY))) or 'none here'}); a task YAML gives "
            "its demonstrations as fewshot_path"
        )
    unknown = sorted(set(eval_cfg.num_fewshot_per_task) - names)
    if unknown:
        raise ConfigError(
            f"eval.num_fewshot_per_task names {unknown[0]!r}, which is not a task scored here "
            f"({', '.join(sorted(names)) or 'none'}); accepted: a task's name as it is scored "
            "(a registered name, or the `name` in a task YAML)"
        )
