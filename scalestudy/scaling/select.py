"""Row filters for fitting: `--where 'N>=1e8'` conditions and `--exclude run,...` run ids.

A condition is `NAME OP VALUE` with OP one of `<=, >=, !=, ==, =, <, >`. NAME is one of the
resolved quantities `N`, `D`, `C`, `loss` (after units and conventions), `run` (the run id), or
any column of the table (`arch`, `objective`, `eval/copa/acc`, ...). Numbers compare as
numbers ('70B' is 7e10); other values compare as text with `=`/`==`/`!=` only.
"""

from __future__ import annotations

import operator
import re

import numpy as np

from scalestudy.scaling.table import ScalingDataError, to_float

_OPS = {
    "<=": operator.le,
    ">=": operator.ge,
    "!=": operator.ne,
    "==": operator.eq,
    "=": operator.eq,
    "<": operator.lt,
    ">": operator.gt,
}
_COND = re.compile(r"^\s*([^<>=!]+?)\s*(<=|>=|!=|==|=|<|>)\s*(.+?)\s*$")
RESOLVED = ("N", "D", "C", "loss", "run")


def parse_condition(text: str) -> tuple[str, str, str]:
    """(name, operator, value) of one --where condition, or a clear error."""
    m = _COND.match(text)
    if not m:
        raise ScalingDataError(
            f"--where {text!r} is not a condition; give NAME OP VALUE with OP one of "
            "<=, >=, <, >, =, !=, e.g. 'N>=1e8' or 'arch=causal_decoder'"
        )
    return m.group(1), m.group(2), m.group(3)


def row_mask(
    where: tuple[str, ...],
    exclude: tuple[str, ...],
    resolved: dict[str, np.ndarray | list],
    rows: list[dict],
) -> tuple[np.ndarray, list[str]]:
    """Which rows pass every condition and are not excluded, and a description of the filters."""
    n = len(rows)
    keep = np.ones(n, dtype=bool)
    columns = list(dict.fromkeys(k for r in rows for k in r))
    described = []
    for cond in where:
        name, op, value = parse_condition(cond)
        if name in resolved:
            got = list(resolved[name])
        elif name in columns:
            got = [r.get(name) for r in rows]
        else:
            raise ScalingDataError(
                f"--where {cond!r}: no quantity or column {name!r}; accepted: "
                f"{', '.join(RESOLVED)}, or a column: {', '.join(columns)}"
            )
        target = to_float(value)
        if np.isfinite(target):
            vals = np.array([to_float(v) for v in got], dtype=float)
            with np.errstate(invalid="ignore"):
                keep &= _OPS[op](vals, target) & np.isfinite(vals)
        elif op in ("=", "==", "!="):
            text = value.strip("'\"")
            keep &= np.array([_OPS[op](str(v), text) for v in got], dtype=bool)
        else:
            raise ScalingDataError(
                f"--where {cond!r}: {value!r} is not a number, so only =, == and != apply"
            )
        described.append(cond.strip())
    if exclude:
        ids = [str(r) for r in resolved["run"]]
        unknown = [e for e in exclude if e not in ids]
        if unknown:
            raise ScalingDataError(
                f"--exclude: no run(s) {', '.join(unknown[:5])}; run ids look like "
                f"{', '.join(ids[:3])}"
            )
        keep &= ~np.isin(ids, list(exclude))
        described.append(f"excluded runs: {', '.join(exclude)}")
    return keep, described
