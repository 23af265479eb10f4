"""Command-line habits of other tools get one error naming this CLI's override form."""

from __future__ import annotations

import pytest

from scalestudy.cli import main as cli


@pytest.mark.parametrize(
    "habit",
    [["--model.d_model=64"], ["--model.d_model", "64"], ["--config.model.d_model=64"]],
)
def test_flag_style_overrides_name_the_override_form(habit, capsys):
    argv = ["describe", "--config", "configs/models/tiny.yaml", *habit]
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(argv)
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()  # no usage block before it
    assert line.startswith("error: scalestudy: " + " ".join(habit) + ": ")
    assert line.endswith("without dashes: model.d_model=64 (see `scalestudy --help`)")


def test_the_override_form_is_read(capsys):
    args = cli.parse_args(["describe", "--config", "configs/models/tiny.yaml", "model.d_model=64"])
    assert args.overrides == ["model.d_model=64"]


def test_other_unknown_flags_keep_argparses_message(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["describe", "--config", "configs/models/tiny.yaml", "--bogus"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: scalestudy: unrecognized arguments: --bogus")
