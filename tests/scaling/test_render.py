"""The one Markdown table renderer and the shared number formats."""

import math

import pytest

from scalestudy.scaling import render


def test_a_two_by_two_table():
    assert render.table(["a", "b"], [["1", "2"], [3, None]]) == [
        "| a | b |",
        "|---|---|",
        "| 1 | 2 |",
        "| 3 | None |",
    ]


def test_an_empty_cell_and_a_blank_one():
    assert render.table(["a", "b"], [["x", ""], ["y", render.BLANK]])[2:] == [
        "| x |  |",
        "| y | |",
    ]


def test_alignment():
    assert render.table(["l", "r", "c", "d"], [], align=["left", "right", "center", None]) == [
        "| l | r | c | d |",
        "|:---|---:|:---:|---|",
    ]
    with pytest.raises(ValueError, match="2 entries for 3 columns"):
        render.separator(3, ["left", "right"])


def test_numbers_and_intervals():
    assert render.num(0.12345, ".3f") == "0.123"
    assert render.num(None, ".3f") == render.num(math.nan, ".3g") == "-"
    assert render.bracket((1.0, 2.5), lambda v: render.num(v, ".3g")) == " [1, 2.5]"
    assert render.bracket(None, str) == ""
