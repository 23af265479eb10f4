"""The study report's BLiMP section: accuracy by size with intervals, the trend test, and the
BLiMP paper's models beside the largest run of each cell."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scalestudy.scaling.zeroshot_plots import ScoredRun, task_scores, wilson
from scalestudy.study.record.rows import RunRow
from scalestudy.study.report import blimp_report

PARADIGMS = {"agree_a": "agreement", "agree_b": "agreement", "island_a": "island"}
REF = {"agree_a": 0.6, "agree_b": 0.8, "island_a": 0.5}


def _reference(root: Path) -> Path:
    (root / "reference").mkdir(parents=True)
    rows = [
        {
            "UID": uid,
            "linguistics_term": term,
            "ngram": REF[uid],
            "lstm": 0.9,
            "txl": 0.9,
            "gpt2": 1.0,
        }
        for uid, term in PARADIGMS.items()
    ]
    (root / "reference" / "models_summary.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return root


def _run(cell: str, size: str, params: float, flops: float, accs: dict[str, float]) -> RunRow:
    arch, objective = cell.split("/")
    run = {
        "arch": arch,
        "objective": objective,
        "size": size,
        "seed": 0,
        "flops": flops,
        "params_non_embedding": params,
        "status": "done",
    }
    for uid, acc in accs.items():
        run[f"eval/blimp/{uid}/acc"] = acc
        run[f"eval/blimp/{uid}/n"] = 1000
    run["eval/blimp/acc"] = sum(accs.values()) / len(accs)
    run["eval/blimp/n"] = 1000 * len(accs)
    run["eval/blimp/chance"] = 0.5
    run["eval/blimp/field/syntax/acc"] = run["eval/blimp/acc"]
    return RunRow.from_row(run)


def _runs() -> list[RunRow]:
    out = []
    for i, (size, params) in enumerate((("25K", 2.5e4), ("100K", 1e5), ("400K", 4e5))):
        acc = 0.55 + 0.05 * i
        for cell in ("causal_decoder/flm", "noncausal_decoder/plm"):
            out.append(_run(cell, size, params, params * 1e6, dict.fromkeys(PARADIGMS, acc)))
    return out


def test_section_tables_intervals_trend_and_reference(tmp_path: Path) -> None:
    ref = _reference(tmp_path / "blimp")
    lines = blimp_report.section(_runs(), ref)
    text = "\n".join(lines)
    lo, hi = wilson(0.65 * 3000, 3000)
    assert f"| causal_decoder/flm | 400K | 0 | 4e+05 | 3000 | 0.650 [{lo:.3f}, {hi:.3f}] |" in text
    trend = [ln for ln in lines if ln.startswith("| causal_decoder/flm | 3 (3) | 9000 |")]
    assert trend and float(trend[0].split("|")[4].split()[0]) > 0  # accuracy rises with compute
    # The paper's term means beside the largest runs: agreement = mean(0.6, 0.8) for the 5-gram.
    agreement = next(ln for ln in lines if ln.startswith("| agreement |"))
    assert agreement.split("|")[2].strip() == "0.650" and agreement.split("|")[4].strip() == "0.700"
    overall = next(ln for ln in lines if ln.startswith("| **overall** |"))
    assert overall.split("|")[4].strip() == f"{sum(REF.values()) / 3:.3f}"


def test_no_blimp_no_section_and_reference_dir_from_tasks(tmp_path: Path) -> None:
    other = RunRow(arch="a", objective="b", evals={"eval/x/acc": 0.5})
    assert blimp_report.section([other], None) == []
    assert blimp_report.reference_dir(("blimp",), "data/eval") == Path("data/eval/blimp")
    assert blimp_report.reference_dir(("copa",), "data/eval") is None
    (tmp_path / "p.jsonl").write_text("")
    assert blimp_report.reference_dir((f"blimp:{tmp_path / 'p.jsonl'}",), None) == tmp_path


def test_many_parts_are_one_task_in_the_per_task_figure() -> None:
    """BLiMP's paradigms (more than MAX_PARTS) are scored as one task in the zero-shot section;
    the synthetic probes' few parts stay tasks of their own."""
    row = _runs()[0]
    scores = dict(row.evals)
    for i in range(20):
        scores[f"eval/blimp/p{i}/acc"], scores[f"eval/blimp/p{i}/n"] = 0.5, 10
    scores["eval/probes/acc"], scores["eval/probes/n"] = 0.4, 20
    for part in ("count", "pronoun"):
        scores[f"eval/probes/{part}/acc"], scores[f"eval/probes/{part}/n"] = 0.4, 10
    run = ScoredRun(row.cell, str(row.size), row.flops, row.params_non_embedding, "", scores)
    tasks = sorted(s.task for s in task_scores([run]))
    assert tasks == ["blimp", "count", "pronoun"]
    assert next(s for s in task_scores([run]) if s.task == "blimp").n == 3000


@pytest.mark.parametrize("missing", ["eval/blimp/n", "eval/blimp/acc"])
def test_runs_without_counts_are_left_out(missing: str) -> None:
    runs = [r.replace(evals={k: v for k, v in r.evals.items() if k != missing}) for r in _runs()]
    assert blimp_report.section(runs, None) == []
