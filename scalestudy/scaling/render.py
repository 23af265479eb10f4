"""Markdown for reports: the one table renderer and the number formats several reports share.

Every report writer (`scaling/`, `study/`, `decoder_only/`) builds its tables here, so a
separator row is written in this module only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

# Separator cell for each alignment: None (or "") leaves the column to the renderer's default.
_RULES = {None: "---", "": "---", "left": ":---", "right": "---:", "center": ":---:"}


def separator(n: int, align: Sequence[str | None] | None = None) -> str:
    """The row under a table's head of `n` columns: `|---|---|`; `align` gives each column
    "left", "right", "center" or None (`|:---|---:|:---:|`)."""
    if align is None:
        align = [None] * n
    if len(align) != n:
        raise ValueError(f"align has {len(align)} entries for {n} columns")
    return "|" + "".join(_RULES[a] + "|" for a in align)


class _Blank:
    """The type of `BLANK`."""

    def __repr__(self) -> str:
        return "BLANK"


BLANK = _Blank()
"""A cell written `| |` (one space), where an empty string is written `|  |`."""


def row(cells: Iterable[Any]) -> str:
    """One table row, `| a | b |`: each cell written with `str`, `BLANK` as `| |`."""
    return "|" + "|".join(" " if c is BLANK else f" {c} " for c in cells) + "|"


def table(
    head: Sequence[Any],
    rows: Iterable[Iterable[Any]],
    align: Sequence[str | None] | None = None,
) -> list[str]:
    """A Markdown table as lines: the head, its separator (`separator`, with `align`) and one
    line per row (`row`)."""
    return [row(head), separator(len(head), align), *(row(r) for r in rows)]


def num(x: Any, spec: str) -> str:
    """`x` in `spec`; "-" for a missing or non-finite number."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, spec)


def bracket(ci: Any, one: Callable[[Any], str]) -> str:
    """` [low, high]` with each end written by `one`; "" when there is no interval."""
    return f" [{one(ci[0])}, {one(ci[1])}]" if ci else ""
