"""The `scalestudy` command: help, argument errors and user errors without tracebacks."""

import subprocess
import sys

from scalestudy.cli.main import build_parser, main

SUBCOMMANDS = {"describe", "train", "eval", "study", "fit", "plot", "bench", "compile", "launch"}


def test_parser_has_every_subcommand():
    actions = [a for a in build_parser()._actions if a.dest == "command"]
    assert set(actions[0].choices) >= SUBCOMMANDS


def test_config_error_is_one_clear_line_and_exit_2(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {d_model: 64, n_heads: 5}\n")
    assert main(["describe", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "n_heads=5" in err and "Traceback" not in err


def test_bad_override_and_missing_file(capsys, tmp_path):
    assert main(["describe", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "not found" in capsys.readouterr().err
    good = tmp_path / "ok.yaml"
    good.write_text("model: {d_model: 64}\n")
    assert main(["describe", "--config", str(good), "model.d_model"]) == 2
    assert "key.sub=value" in capsys.readouterr().err


def test_unknown_subcommand_is_an_argparse_error():
    proc = subprocess.run(
        [sys.executable, "-m", "scalestudy.cli.main", "frobnicate"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_overrides_may_follow_options_even_after_two_positionals(capsys, tmp_path):
    bad = tmp_path / "exp.yaml"
    bad.write_text("model: {d_model: 64}\n")
    # The override after --config must reach the config (and here make it invalid).
    assert main(["bench", "data", "--config", str(bad), "model.n_heads=5"]) == 2
    assert "n_heads=5" in capsys.readouterr().err


def test_a_folder_inside_a_run_is_not_taken_for_the_run(capsys, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "4").mkdir(parents=True)
    (run / "config.yaml").write_text("name: r\n")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for inner in (run / "checkpoints", run / "checkpoints" / "4"):
        assert main(["eval", "--workdir", str(inner)]) == 2
        err = capsys.readouterr().err
        assert f"is inside the run {run}" in err and f"--workdir {run}" in err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
