"""What leaves the registry: one typed record per run, and the flat row again for tables."""

import dataclasses

import pytest

from scalestudy.study.record.registry import Registry, load_curves, load_runs
from scalestudy.study.record.registry_schema import RUN_COLUMNS
from scalestudy.study.record.rows import (
    COLUMN_NAMES,
    RunRow,
    read_curves,
    read_planned,
    read_rows,
)
from tests.study.test_registry import ROW as REGISTRY_ROW

ROW = {
    **REGISTRY_ROW,
    "name": "t.causal_decoder.flm.rope.xs.s0",
    "config": "optim:\n  learning_rate: 0.01\n",
}


def _registry(tmp_path):
    path = tmp_path / "registry.sqlite"
    with Registry(path) as reg:
        reg.add_runs([ROW, {**ROW, "run_id": "gone", "name": "t.x.flm.s.s1"}])
        summary = {"final_val_loss": 2.5, "flops": 1e6, "eval": {"p/acc": 0.75}}
        curves = [{"step": 2, "train/loss": 3.0, "flops": 5e5}, {"step": 4, "val/loss": 2.5}]
        reg.finish("abc", summary, curves)
        reg.set_plan(["abc"])
    return path


def test_a_record_has_a_field_per_registry_column_but_the_config_text():
    assert set(COLUMN_NAMES) == {"run_id", *RUN_COLUMNS} - {"config"}
    assert list(COLUMN_NAMES[1:]) == [c for c in RUN_COLUMNS if c != "config"]  # their order
    fields = {f.name for f in dataclasses.fields(RunRow)}
    assert fields == {*COLUMN_NAMES, "recipe", "evals", "derived", "config"}


def test_the_record_reads_as_the_registry_row_and_back(tmp_path):
    path = _registry(tmp_path)
    rows, flat = read_rows(path), load_runs(path)
    assert [r.as_dict() for r in rows] == flat
    assert [list(r.as_dict()) for r in rows] == [list(d) for d in flat]  # keys in order too
    run = rows[0]
    assert run.loss == 2.5 and run.flops == 1e6 and run.evals == {"eval/p/acc": 0.75}
    assert run.recipe == {"optim.learning_rate": 0.01}
    assert run.value("eval/p/acc") == 0.75 and run.value("params_total") == 10
    assert run.value("eval/q/acc") is None and run.value("no_such_key") is None
    assert run.cell == "causal_decoder/flm/rope" and not run.moe
    kept, gone = read_planned(path)
    assert [r.run_id for r in kept] == ["abc"] and gone == ["t.x.flm.s.s1"]


def test_a_record_is_frozen_and_refuses_what_is_not_a_column():
    run = RunRow.from_row({"run_id": "a", "arch": "x", "objective": "y", "eval/t/acc": 0.5})
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.loss = 1.0  # type: ignore[misc]
    assert run.replace(loss=1.0).loss == 1.0 and run.loss is None
    with pytest.raises(KeyError, match="not a run column: colour"):
        RunRow.from_row({"run_id": "a", "colour": "red"})
    assert run.replace(derived={"gain/t": 0.1}).value("gain/t") == 0.1


def test_curve_points_are_the_registrys_curves_as_records(tmp_path):
    path = _registry(tmp_path)
    points = read_curves(path)
    assert [dataclasses.asdict(p) for p in points] == load_curves(path)
    assert [(p.step, p.loss, p.val_loss, p.flops) for p in points] == [
        (2, 3.0, None, 5e5),
        (4, None, 2.5, None),
    ]
    assert read_curves(path, {"gone"}) == [] and len(read_curves(path, {"abc"})) == 2
