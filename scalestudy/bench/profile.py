"""Where a compiled train step spends its time: `scalestudy bench peer --profile DIR`.

Each side's step runs under `jax.profiler.trace`; the trace's events name the compiled
program's top-level operations (fusions, dots, copies), so each event's time is attributed
to the operation of that name in the program's optimized HLO and summed by kind. On CPU an
event is one operation's run on one thread, so the sums are thread time per step (a stall on
a busy machine counts as time too: compare programs traced side by side, not across moments).
"""

from __future__ import annotations

import collections
import gzip
import json
import re
from pathlib import Path
from typing import Any

import jax

# The kinds, in the order they are reported.
KINDS = (
    "matmuls",
    "feed-forward elementwise",
    "vocabulary-wide elementwise (loss, softmax)",
    "attention elementwise (scores, softmax)",
    "layout copies and transposes",
    "other elementwise (norms, residual, embedding)",
    "after the gradient (optimizer, metrics)",
)

_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w-]*)\(")


def entry_ops(hlo_text: str) -> dict[str, tuple[str, str, str]]:
    """Top-level operations of the program's entry computation: name -> (result shape,
    opcode, the instruction's text)."""
    ops, inside = {}, False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY"):
            inside = True
        elif inside and line.startswith("}"):
            break
        elif inside and (m := _INSTRUCTION.match(line)):
            ops[m.group(1)] = (m.group(2), m.group(3), line)
    return ops


def kind_of(shape: str, opcode: str, line: str, *, vocab: int, d_ff: int) -> str:
    """Which of `KINDS` an operation is, from its result shape, opcode and source op name."""
    m = re.search(r'op_name="([^"]*)"', line)
    op_name = m.group(1) if m else ""
    if opcode == "dot" or "__ynn_fusion" in line or "dot_general" in op_name:
        return "matmuls"
    if "jvp" not in op_name and "transpose(" not in op_name:
        return "after the gradient (optimizer, metrics)"
    dims = set(re.findall(r"\d+", shape.split("{")[0]))
    if str(vocab) in dims:
        return "vocabulary-wide elementwise (loss, softmax)"
    if re.search(r"\[\d+,\d+,(\d+),\1\]", shape):  # [B, H, L, L]
        return "attention elementwise (scores, softmax)"
    if str(d_ff) in dims:
        return "feed-forward elementwise"
    name = line.split("=")[0]
    if opcode in ("copy", "transpose") or "copy" in name or "transpose" in name:
        return "layout copies and transposes"
    return "other elementwise (norms, residual, embedding)"


def _trace_events(trace_dir: Path) -> list[dict]:
    files = sorted(trace_dir.glob("plugins/profile/*/*.trace.json.gz"))
    if not files:
        return []
    with gzip.open(files[-1], "rt") as f:
        return [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]


def profile_step(
    step_fn: Any, state: Any, batch: Any, steps: int, out_dir: Path, *, vocab: int, d_ff: int
) -> tuple[Any, dict[str, Any]]:
    """Trace `steps` calls of the compiled `step_fn` (state donated and returned) into
    `out_dir`; returns the new state and {kind: ms per step}, their total, and the count of
    top-level operations. The program's HLO is written beside the trace."""
    compiled = step_fn.lower(state, batch).compile() if hasattr(step_fn, "lower") else step_fn
    hlo = compiled.as_text()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "program.hlo.txt").write_text(hlo)
    with jax.profiler.trace(str(out_dir)):
        for _ in range(steps):
            state, out = step_fn(state, batch)
        jax.block_until_ready(out)
    ops = entry_ops(hlo)
    us: collections.Counter[str] = collections.Counter()
    for event in _trace_events(out_dir):
        if event["name"] in ops:
            us[kind_of(*ops[event["name"]], vocab=vocab, d_ff=d_ff)] += event.get("dur", 0)
    per_step = {k: round(us[k] / 1e3 / steps, 2) for k in KINDS}
    return state, {
        **per_step,
        "total_ms": round(sum(per_step.values()), 2),
        "top_level_ops": len(ops),
    }
