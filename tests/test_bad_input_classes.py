"""Bad input, fifth round: each class of mistake is refused where its check belongs, for
every member of the class, with one `error:` line (exit status 2), no traceback, nothing
written. Each table holds the cases the sweep named and members it did not.

Rows run `scalestudy.cli.main.main` (or the check's owner) in this process; only what JAX's
process state needs (XLA_FLAGS read at start-up, a signal before `main`) runs a subprocess.
"""

import logging
import logging.handlers
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from scalestudy.cli.main import main
from scalestudy.config.errors import ConfigError, ScalestudyError

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs/models/tiny.yaml")
SMOKE = str(REPO / "configs/studies/smoke.yaml")
LONG = "x" * 300  # past NAME_MAX (255 bytes) on every file system the tests meet

BASE = {
    "objective": {"inputs_length": 24, "targets_length": 8},
    "model": {"vocab_size": 384, "dtype": "float32", "n_heads": 2},
    "train": {"batch_size": 8, "progress": False, "async_checkpoint": False},
}
SPEC = {
    "name": "tiny",
    "base": BASE,
    "cells": [["causal_decoder", "flm"], ["encoder_decoder", "mlm"]],
    "ladder": {"sizes": [{"name": "xs", "d_model": 16, "n_layers": 2, "d_ff": 32}]},
    "budget": {"kind": "steps", "steps": 4},
    "tasks": ["synthetic_probes"],
    "fit": {"laws": ["kaplan_n"]},
}


@pytest.fixture
def place(tmp_path, monkeypatch) -> Path:
    """A working directory holding a file, a folder, a named pipe and a link to nothing."""
    (tmp_path / "a_file").write_text("x\n")
    (tmp_path / "a_dir").mkdir()
    os.mkfifo(tmp_path / "a_pipe")
    os.symlink(tmp_path / "gone" / "target", tmp_path / "dangling")
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    monkeypatch.chdir(tmp_path)
    for key in ("SCALESTUDY_DISTRIBUTED", "SCALESTUDY_COORDINATOR", "SCALESTUDY_JAX_CACHE"):
        monkeypatch.delenv(key, raising=False)
    return tmp_path


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def refused(argv: list[str], capsys) -> str:
    """The one error line a refused command prints (its exit status checked to be 2)."""
    capsys.readouterr()
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's own refusals
        status = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, f"exit {status}: {err[-800:]}"
    assert "Traceback" not in err, err
    assert lines, err
    if lines[0].startswith("error:"):  # ours: one line, or one per problem under it
        assert all(line.startswith("  ") for line in lines[1:]), err
        return err
    assert lines[-1].startswith("scalestudy") and "error: " in lines[-1], err  # argparse's
    return lines[-1]


# Paths of the wrong kind, through the one helper every command uses.
PATHS = [
    ("workdir_too_long", ["train", "--config", TINY, "--workdir", LONG], ["300 bytes", "255"]),
    ("workdir_under_a_file", ["train", "--config", TINY, "--workdir", "a_file/sub"],
     ["a_file is a file", "nothing can be under it"]),
    ("workdir_dangling_link", ["train", "--config", TINY, "--workdir", "dangling"],
     ["dangling is a link to nothing"]),
    ("experts_out_missing_folder", ["experts", "--workdir", "a_dir", "--out", "/nonexistent/d/x"],
     ["its folder /nonexistent/d does not exist"]),
    ("eval_out_too_long", ["eval", "--workdir", "a_dir", "--out", f"{LONG}.json"],
     ["--out", "305 bytes"]),
    ("eval_workdir_dangling", ["eval", "--workdir", "dangling"], ["link to nothing"]),
    ("bench_profile_a_file", ["bench", "peer", "--profile", "a_file"],
     ["--profile a_file is a file; expected a directory"]),
    ("bench_profile_under_a_file", ["bench", "peer", "--profile", "a_file/t"],
     ["a_file is a file"]),
    ("vocab_out_a_directory", ["vocab", "train", "a_file", "--out", "a_dir"],
     ["--out a_dir is a directory; expected a file"]),
    ("study_spec_a_pipe", ["study", "--spec", "a_pipe", "--out", "o"],
     ["--spec a_pipe is a named pipe; expected a YAML file"]),
    ("study_spec_dangling", ["study", "--spec", "dangling", "--out", "o", "--dry-run"],
     ["link to nothing"]),
    ("launch_spec_too_long", ["launch", "--spec", LONG, "--executor", "slurm", "--out", "o"],
     ["--spec", "300 bytes"]),
    ("compile_spec_a_directory", ["compile", "--spec", "a_dir"],
     ["--spec a_dir is a directory; expected a YAML file"]),
    ("finetune_from_a_file", ["finetune", "--from", "a_file", "--out", "o", "mixture=m.yaml"],
     ["--from a_file is a file; expected a run directory"]),
    ("config_too_long", ["describe", "--config", f"{LONG}.yaml"], ["config file", "305 bytes"]),
    ("config_under_a_file", ["describe", "--config", "a_file/c.yaml"], ["a_file is a file"]),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "words"), [pytest.param(*c[1:], id=c[0]) for c in PATHS])
def test_a_path_of_the_wrong_kind_is_one_line_and_nothing_is_written(argv, words, place, capsys):
    before = _tree(place)
    line = refused(argv, capsys)
    for word in words:
        assert word in line, line
    assert _tree(place) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_folder_that_cannot_be_written_is_refused(place, capsys):
    locked = place / "locked"
    locked.mkdir(mode=0o500)
    line = refused(["train", "--config", TINY, "--workdir", str(locked / "run")], capsys)
    assert "is not writable" in line


# Empty text where text is needed: refused by the config validator, naming the key.
@pytest.mark.parametrize(
    "key",
    ["data.delimiter", "data.text_key", "data.train_split", "name", "data.validation_split"],
)
def test_an_empty_text_value_is_refused_by_the_config(key):
    from scalestudy.config.experiment import load_config

    with pytest.raises(ConfigError, match=rf"{key}: is empty; give a non-empty value"):
        load_config(TINY, [f"{key}="])


def test_empty_text_stays_accepted_where_it_means_something():
    from scalestudy.config.experiment import load_config

    cfg = load_config(TINY, ["eval.fewshot_delimiter="])
    assert cfg.eval.fewshot_delimiter == ""


# A list that gives a value twice; a value given in two places; negative seeds.
TWICE = [
    ("num_fewshot_config", ["describe", "--config", TINY, "eval.num_fewshot=[1,1]"],
     ["eval.num_fewshot", "gives 1 twice"]),
    ("num_fewshot_flag", ["eval", "--workdir", "a_dir", "--num-fewshot", "0,2,0"],
     ["0 is given twice"]),
    ("num_fewshot_per_task", ["describe", "--config", TINY,
     "eval.num_fewshot_per_task={synthetic_probes: [2, 4, 2]}"], ["gives 2 twice"]),
    ("members_value_twice", ["train", "--config", TINY, "--workdir", "w", "--members",
     "optim.learning_rate=1e-3,1e-3"], ["twice"]),
    ("members_seed_and_train_seed", ["train", "--config", TINY, "--workdir", "w", "--members",
     "seed=0,1", "train.seed=2,3"], ["seed=... and train.seed=... both set train.seed"]),
    ("members_seed_and_data_seed", ["train", "--config", TINY, "--workdir", "w", "--members",
     "seed=0,1", "data.seed=5,6"], ["both set data.seed"]),
    ("override_and_member_axis", ["train", "--config", TINY, "--workdir", "w",
     "optim.learning_rate=1e-3", "--members", "optim.learning_rate=2e-3,3e-3"],
     ["optim.learning_rate=1e-3 and --members optim.learning_rate=... both set"]),
    ("fewshot_seed_negative", ["describe", "--config", TINY, "eval.fewshot_seed=-1"],
     ["eval.fewshot_seed", "greater than or equal to 0"]),
    ("fewshot_seed_past_a_prng", ["describe", "--config", TINY, "eval.fewshot_seed=4294967296"],
     ["eval.fewshot_seed", "less than or equal to"]),
    ("member_seed_negative", ["train", "--config", TINY, "--workdir", "w", "--members",
     "seed=-1,0"], ["seed", "greater than or equal to 0"]),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "words"), [pytest.param(*c[1:], id=c[0]) for c in TWICE])
def test_a_value_given_twice_or_out_of_range_is_refused_naming_it(argv, words, place, capsys):
    line = refused(argv, capsys)
    for word in words:
        assert word in line, line
    assert not (place / "w").exists()


@pytest.mark.parametrize("value", ["-1", "-3"])
@pytest.mark.parametrize("form", ["split", "joined"])
def test_the_harness_refuses_a_negative_number_of_shots(value, form):
    from scalestudy.evaluate.harness_model import check_shots

    argv = ["--tasks", "x", *(["--num_fewshot", value] if form == "split" else
                              [f"--num_fewshot={value}"])]  # fmt: skip
    with pytest.raises(ScalestudyError, match=f"--num_fewshot {value}: a number"):
        check_shots(argv)
    check_shots(["--num_fewshot", "2"])  # a count is fine


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda d: d / "missing", "not found"),
        (lambda d: (d / "a.yaml").write_text("x: 1") and d / "a.yaml", "is a file"),
        (lambda d: d / ("x" * 300), "has a name of 300 bytes"),
    ],
)
def test_the_harness_refuses_an_include_path_that_is_not_a_directory(make, words, tmp_path):
    """lm-eval skips such a path without a word and looks the tasks up elsewhere (on a hub)."""
    from scalestudy.evaluate.harness_model import check_shots

    path = make(tmp_path)
    with pytest.raises(ScalestudyError, match=f"--include_path .*{words}"):
        check_shots(["--tasks", "x", "--include_path", str(path)])
    check_shots(["--tasks", "x", f"--include_path={tmp_path}"])  # a directory is fine


def test_task_data_lm_eval_cannot_fetch_is_one_line(monkeypatch, capsys):
    """A task whose data is on a hub this host cannot reach, after the model has started."""
    from scalestudy.evaluate import harness_model

    def fetch() -> None:
        harness_model._release_logs()  # the model started
        raise ConnectionError("Couldn't reach 'allenai/ai2_arc' on the Hub")

    monkeypatch.setattr(harness_model, "cli_evaluate", fetch)
    line = refused(["harness", "--model", "scalestudy", "--tasks", "arc_easy"], capsys)
    assert line.startswith("error: lm-eval could not fetch a task's data") and "ai2_arc" in line


# Config files that hold nothing, YAML syntax errors, and files past the size limit.
FILES = {
    "zero_bytes.yaml": ("", ["holds no keys"]),
    "comments.yaml": ("# a comment\n\n# another\n", ["holds no keys"]),
    "only_a_marker.yaml": ("---\n", ["holds no keys"]),
    "null.yaml": ("~\n", ["holds no keys"]),
    "open_list.yaml": ("model:\n  d_model: [1, 2\ntrain: {a: 1\n", ["open_list.yaml:3:6:"]),
    "bad_indent.yaml": ("model:\n  d_model: 1\n n_layers: 2\n", ["bad_indent.yaml:3:"]),
    "tab.yaml": ("model:\n\td_model: 1\n", ["tab.yaml:2:1:", "tab"]),
    "unclosed_quote.yaml": ('name: "abc\n', ["unclosed_quote.yaml:2:"]),
}


@pytest.mark.parametrize("name", list(FILES))
def test_an_empty_or_broken_config_file_is_one_line_naming_where(name, place, capsys):
    text, words = FILES[name]
    (place / name).write_text(text)
    line = refused(["describe", "--config", name], capsys)
    for word in words:
        assert word in line, line
    assert "^" not in line and "<unicode string>" not in line


@pytest.mark.parametrize("command", ["describe", "study"])
def test_a_file_past_the_size_limit_is_refused_before_it_is_parsed(command, place, capsys):
    from scalestudy.config.yamlio import MAX_FILE_BYTES

    big = place / "big.yaml"
    big.write_text("seeds: [" + "1, " * (MAX_FILE_BYTES // 3 + 10) + "1]\n")
    argv = ["describe", "--config", "big.yaml"]
    if command == "study":
        argv = ["study", "--spec", "big.yaml", "--out", "o", "--dry-run"]
    start = time.perf_counter()
    line = refused(argv, capsys)
    assert time.perf_counter() - start < 5
    assert f"at most {MAX_FILE_BYTES:,} bytes" in line
    assert not (place / "o").exists()


# Study specs checked whole when read.
SPECS = [
    ("unknown_objective", {"cells": [["causal_decoder", "bogus"]]},
     ["objective.name: got 'bogus'", "flm, plm, mlm"]),
    ("unknown_arch", {"cells": [["decoder_only", "flm"]]}, ["'decoder_only'", "causal_decoder"]),
    ("rate_not_a_number", {"lr_search": {"rates": ["abc", 0.01]}},
     ["lr_search.rates.0", "'abc'"]),
    ("rate_inf", {"lr_search": {"rates": [float("inf"), 0.01]}}, ["lr_search.rates.0", "inf"]),
    ("rate_nan", {"lr_search": {"rates": [0.01, float("nan")]}}, ["lr_search.rates.1", "nan"]),
    ("search_size_not_in_ladder", {"lr_search": {"rates": [0.01, 0.02], "sizes": ["zz"]}},
     ["lr_search.sizes: ['zz'] are not sizes of the study; accepted: xs"]),
    ("too_many_runs", {"seeds": list(range(6000))}, ["at least 12,000 runs", "at most 10,000"]),
    ("too_many_runs_by_sizes", {"ladder": {"sizes": [
        {"name": f"s{i}", "d_model": 16, "n_layers": 2, "d_ff": 32} for i in range(60)]},
        "seeds": list(range(100))}, ["at least 12,000 runs"]),
]  # fmt: skip


@pytest.mark.parametrize(("changes", "words"), [pytest.param(*c[1:], id=c[0]) for c in SPECS])
@pytest.mark.parametrize("dry_run", [True, False], ids=["dry_run", "run"])
def test_a_spec_is_checked_whole_before_anything_is_written(changes, words, dry_run, place, capsys):
    (place / "s.yaml").write_text(yaml.safe_dump({**SPEC, **changes}))
    argv = ["study", "--spec", "s.yaml", "--out", "o", *(["--dry-run"] if dry_run else [])]
    line = refused(argv, capsys)
    for word in words:
        assert word in line, line
    assert "at least 2 items" not in line
    assert not (place / "o").exists()  # no spec.yaml, no study.lock


def test_a_dry_run_states_the_run_count_against_its_limit(place, capsys):
    assert main(["study", "--spec", "spec.yaml", "--out", "o", "--dry-run"]) == 0
    assert "study tiny: 2 runs of at most 10,000 (2 cells)" in capsys.readouterr().out


# lm-eval's own refusals, as one line with none of its log before it.
@pytest.mark.parametrize(
    "raised",
    [
        ValueError("Tasks not found: no_such_task"),
        FileNotFoundError("[Errno 2] No such file or directory: '/nonexistent'"),
        NotADirectoryError("include path /etc/hosts"),
    ],
)
def test_lm_evals_refusal_is_one_line_without_its_log(raised, monkeypatch, capsys):
    from scalestudy.evaluate import harness_model

    def refuse() -> None:
        logging.getLogger("lm_eval.tasks").warning("noise before the refusal")
        raise raised

    monkeypatch.setattr(harness_model, "cli_evaluate", refuse)
    logger = logging.getLogger("lm_eval")
    line = refused(["harness", "--model", "scalestudy", "--tasks", "x"], capsys)
    assert line.startswith("error: lm-eval refused the command:") and str(raised)[:20] in line
    assert not harness_model._log_held
    # nothing held is left on lm-eval's logger to be printed at exit
    assert not [h for h in logger.handlers if isinstance(h, logging.handlers.MemoryHandler)]


def test_lm_evals_log_is_held_until_the_model_starts_then_given_out(monkeypatch):
    from scalestudy.evaluate import harness_model

    class Collect(logging.Handler):
        def __init__(self):
            super().__init__()
            self.seen: list[str] = []

        def emit(self, record):
            self.seen.append(record.getMessage())

    collect = Collect()
    logger = logging.getLogger("lm_eval")
    monkeypatch.setattr(logger, "handlers", [*logger.handlers, collect])

    def evaluate() -> None:
        logging.getLogger("lm_eval.tasks").warning("before the model")
        assert collect.seen == []  # held: lm-eval may yet refuse the command
        harness_model._release_logs()  # what the model's constructor calls
        logging.getLogger("lm_eval.evaluator").warning("after")

    monkeypatch.setattr(harness_model, "cli_evaluate", evaluate)
    assert harness_model.run_cli(["--tasks", "x"]) == 0
    assert collect.seen == ["before the model", "after"]
    assert collect in logger.handlers and not harness_model._log_held


# The environment, checked before JAX starts its backend.
ENVIRONMENT = [
    ({"JAX_PLATFORMS": "cuda"}, "asks for a GPU"),
    ({"JAX_PLATFORMS": "cpu,rocm"}, "asks for a GPU"),
    ({"XLA_FLAGS": "garbage"}, "'garbage' is not a flag"),
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8 -x"}, "'-x' is not a flag"),
    ({"XLA_FLAGS": "--=3"}, "'--=3' is not a flag"),
    ({"SCALESTUDY_JAX_CACHE": "a_file"}, "SCALESTUDY_JAX_CACHE a_file is a file"),
    ({"SCALESTUDY_JAX_CACHE": "a_file/jax"}, "a_file is a file"),
    ({"SCALESTUDY_JAX_CACHE": LONG}, "300 bytes"),
    ({"SCALESTUDY_JAX_CACHE": "dangling"}, "link to nothing"),
]


@pytest.mark.parametrize(("env", "words"), ENVIRONMENT)
def test_the_environment_is_refused_by_name_before_jax_starts(env, words, place):
    from scalestudy.cli import args

    if "cuda" in env.get("JAX_PLATFORMS", "") and list(Path("/dev").glob("nvidia[0-9]*")):
        pytest.skip("this host has a GPU")
    if "rocm" in env.get("JAX_PLATFORMS", "") and Path("/dev/kfd").exists():
        pytest.skip("this host has a ROCm GPU")
    with pytest.raises(ScalestudyError, match=words.replace("(", r"\(")):
        args.check_environment(env)


def test_a_distributed_job_without_a_cluster_is_one_config_error(tmp_path):
    """JAX joins a cluster only before its backend starts, once per process: a process of its
    own, as a user's command is."""
    env = {**os.environ, "SCALESTUDY_DISTRIBUTED": "auto"}
    done = subprocess.run(
        [sys.executable, "-m", "scalestudy.cli.main", "train", "--config", TINY, "--workdir", "w"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: SCALESTUDY_DISTRIBUTED=auto, and JAX finds no cluster"), line
    assert list(tmp_path.iterdir()) == []


def test_garbage_xla_flags_are_one_line_from_the_command(tmp_path):
    """XLA reads XLA_FLAGS when its backend starts and ends the process on a flag it cannot
    parse: the command refuses first (a process of its own, as XLA's state is per process)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2 not-a-flag"}
    done = subprocess.run(
        [sys.executable, "-m", "scalestudy.cli.main", "train", "--config", TINY, "--workdir", "w"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: XLA_FLAGS: 'not-a-flag' is not a flag; XLA takes --name or --name=value "
        "separated by spaces (e.g. --xla_force_host_platform_device_count=8)"
    ]
    assert list(tmp_path.iterdir()) == []


def test_a_stop_during_start_up_is_a_stopped_line(tmp_path):
    code = (
        "import os, signal, sys; sys.argv = ['scalestudy']; import scalestudy.cli.main; "
        "os.kill(os.getpid(), signal.SIGTERM); import time; time.sleep(30)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert done.stderr.strip() == "stopped: SIGTERM during start-up; nothing was started"


# A refused command leaves the disk as it found it.
@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "--workdir", "run"],
        ["eval", "--workdir", "run", "--tasks", "synthetic_probes", "--num-fewshot", "1"],
        ["experts", "--workdir", "run"],
        ["attention-rank", "--workdir", "run"],
    ],
)
def test_a_refused_command_appends_nothing_to_the_runs_log(argv, place, capsys):
    run = place / "run"
    run.mkdir()
    (run / "train.log").write_text("the run's own log\n")
    before = _tree(place)
    line = refused(argv, capsys)
    assert "no checkpoint" in line
    assert (run / "train.log").read_text() == "the run's own log\n"
    assert _tree(place) == before


@pytest.mark.parametrize("argv", [["eval"], ["experts"], ["attention-rank"]])
def test_a_missing_run_directory_is_not_created(argv, place, capsys):
    line = refused([*argv, "--workdir", "no_run"], capsys)
    assert "run directory not found" in line
    assert not (place / "no_run").exists()


@pytest.mark.parametrize(
    "garbage", ["model: [unclosed\n", "- a list\n", "model:\n  d_model: banana\n"]
)
@pytest.mark.parametrize("members", [False, True], ids=["run", "group"])
def test_a_garbage_config_in_a_run_directory_is_not_overwritten(garbage, members, place, capsys):
    run = place / "run"
    where = run / "seed0" if members else run
    where.mkdir(parents=True)
    (where / "config.yaml").write_text(garbage)
    extra = ["--members", "seed=0,1"] if members else []
    line = refused(["train", "--config", TINY, "--workdir", "run", *extra], capsys)
    assert "config.yaml, which is not a run's config" in line and "move it away" in line
    assert (where / "config.yaml").read_text() == garbage


# Wrong words: a path's kind said as such, the missing file named.
def test_a_sentencepiece_path_that_is_a_directory_says_so(tmp_path):
    from scalestudy.config.experiment import DataConfig
    from scalestudy.data import DataError
    from scalestudy.data.vocab import get_vocabulary

    cfg = DataConfig(vocab="sentencepiece", spm_path=str(tmp_path))
    with pytest.raises(DataError, match=r"is a directory; expected a SentencePiece \.model file"):
        get_vocabulary(cfg)


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("eval.fewshot_files={copa: /nonexistent.jsonl}", "copa /nonexistent.jsonl: not found"),
        ("eval.fewshot_files={copa: a_dir}", "copa a_dir is a directory; expected a file"),
        ("eval.fewshot_files={copa:/nonexistent.jsonl}", "with a space after the colon"),
        ("eval.fewshot_files={copa: ''}", "with a space after the colon"),
    ],
)
def test_a_missing_demonstrations_file_is_named(override, words, place, capsys):
    line = refused(["describe", "--config", TINY, "eval.tasks=[copa]", override], capsys)
    assert words in line, line


@pytest.mark.parametrize("key", ["bogus", "synthetic_probe", "copa_x"])
@pytest.mark.parametrize("setting", ["num_fewshot_per_task", "fewshot_files"])
def test_per_task_keys_naming_no_task_are_refused_by_eval_as_by_train(key, setting, place, capsys):
    from scalestudy.config.eval_config import EvalConfig
    from scalestudy.evaluate.tasks import load_tasks

    value = "[1]" if setting == "num_fewshot_per_task" else "a_file"
    if setting == "num_fewshot_per_task":  # train's tasks: refused when they load
        cfg = EvalConfig(tasks=("synthetic_probes",), num_fewshot_per_task={key: [1]})
        with pytest.raises(ConfigError, match=f"names '{key}', which is not a task scored"):
            load_tasks(cfg)
    run = place / "run"
    run.mkdir()
    argv = ["eval", "--workdir", "run", "--tasks", "synthetic_probes"]
    line = refused([*argv, f"eval.{setting}={{{key}: {value}}}"], capsys)
    assert f"eval.{setting} names '{key}', which is not a task scored here" in line
    assert list(run.iterdir()) == []


def test_a_resume_refused_for_its_config_leaves_the_runs_log_as_it_was(tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", "--config", TINY, "--workdir", str(run), "train.steps=2"]
    argv += ["train.async_checkpoint=false", "train.progress=false", "train.eval_batches=1"]
    argv += ["data.synthetic.n_train_documents=200", "data.synthetic.n_validation_documents=20"]
    assert main(argv) == 0
    log = (run / "train.log").read_bytes()
    capsys.readouterr()
    assert main([*argv, "model.d_model=64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "trained with a different config" in err
    assert "Traceback" not in err
    assert (run / "train.log").read_bytes() == log


@pytest.mark.parametrize(
    "argv",
    [
        ["bogus"],  # an unknown command
        ["train", "--config", TINY],  # a required argument left out
        ["eval", "--workdir", "w", "--num-fewshot", "1,1"],  # a repeated value
        ["fit", "--no-such-flag"],  # an unknown flag
        ["train", "--config", TINY, "--workdir", "w", "--model.d_model", "64"],  # a habit
    ],
)
def test_an_argument_refusal_is_one_error_line_without_a_usage_block(
    argv, capsys, tmp_path, monkeypatch
):
    """argparse's refusals read as the package's: one `error:` line, exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: scalestudy") and line.endswith("--help`)"), line
    assert list(tmp_path.iterdir()) == []
