"""Reading runs: published-style tables with units, registries, and bad input."""

import json

import numpy as np
import pytest

from scalestudy.cli.main import main
from scalestudy.scaling.table import DataSettings, ScalingDataError, to_float
from scalestudy.scaling.table_input import load_table


def test_numbers_with_suffixes_and_separators():
    assert to_float("70B") == 70e9
    assert to_float("1.4T") == pytest.approx(1.4e12)
    assert to_float("1,234") == 1234.0
    assert to_float("5.76e23") == 5.76e23
    assert np.isnan(to_float("n/a"))


def test_published_table_with_named_columns_and_units(tmp_path):
    # Columns as a paper's table gives them: parameters in millions, tokens in billions.
    path = tmp_path / "paper.tsv"
    rows = ["# refit of a published table", "Model Size (M)\tTraining Tokens (B)\tFinal Loss"]
    rows += [f"{n}\t{d}\t{3.0 - 0.1 * i}" for i, (n, d) in enumerate([(44, 1), (90, 2), (140, 3)])]
    path.write_text("\n".join(rows) + "\n")
    s = DataSettings(
        n_col="Model Size (M)",
        d_col="Training Tokens (B)",
        loss_col="Final Loss",
        n_unit="M",
        d_unit="B",
    )
    t = load_table(path, s)
    assert t.N.tolist() == [44e6, 90e6, 140e6]
    assert t.D.tolist() == [1e9, 2e9, 3e9]
    np.testing.assert_allclose(t.C, 6 * t.N * t.D)  # no compute column: C = 6ND, recorded
    assert t.choices["c_kind"] == "6nd"
    assert t.cells() == ["all"]


def test_isoflop_table_without_tokens_derives_d_from_6nd(tmp_path):
    path = tmp_path / "isoflops.csv"
    path.write_text("Training FLOP,Model Size,loss\n6e18,80M,3.1\n6e18,120M,3.05\n")
    t = load_table(path)
    np.testing.assert_allclose(t.D, 6e18 / (6 * np.array([80e6, 120e6])))
    assert t.choices["D"].startswith("D = C / (6 N)")


def test_autodetected_columns_and_clear_errors(tmp_path):
    path = tmp_path / "runs.csv"
    path.write_text("params,tokens,flops,loss\n1e6,1e8,6e14,4.0\n2e6,1e8,1.2e15,3.8\n")
    t = load_table(path)
    assert t.choices["c_kind"] == "counted"
    with pytest.raises(ScalingDataError, match=r"'nope'.*columns: params, tokens, flops, loss"):
        load_table(path, DataSettings(n_col="nope"))
    path.write_text("params,n,loss\n1,2,3\n")
    with pytest.raises(ScalingDataError, match="several columns could be n"):
        load_table(path)
    with pytest.raises(ScalingDataError, match="unknown unit"):
        load_table(path, DataSettings(n_col="n", n_unit="furlongs"))


def test_nan_and_non_positive_rows_fail_or_are_dropped(tmp_path):
    path = tmp_path / "runs.jsonl"
    rows = [
        {"N": 1e6, "D": 1e9, "loss": 3.0},
        {"N": -1, "D": 1e9, "loss": 3.0},
        {"N": 1e7, "D": 1e9, "loss": float("nan")},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ScalingDataError, match=r"2 run\(s\).*non-positive.*--drop-invalid"):
        load_table(path)
    t = load_table(path, DataSettings(drop_invalid=True))
    assert len(t.run_id) == 1 and t.choices["dropped_invalid"] == 2


def test_cli_fit_writes_json_and_reports_errors(tmp_path, make_isoflop, capsys):
    t = make_isoflop(budgets=(1e18, 1e19, 1e20), sizes=5)
    path = tmp_path / "runs.csv"
    lines = ["N,D,loss"] + [f"{n},{d},{x}" for n, d, x in zip(t.N, t.D, t.loss)]
    path.write_text("\n".join(lines))
    out = tmp_path / "fit.json"
    rc = main(
        ["fit", str(path), "--law", "chinchilla3,kaplan_nd", "--bootstrap", "10", "--out", str(out)]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    fit = res["cells"]["all"]["fits"]["chinchilla3"]
    assert set(fit["params"]) == {"A", "B", "E", "alpha", "beta", "a", "b", "G"}
    assert res["data"]["C"].startswith("C = 6 N D")
    assert "chinchilla3" in capsys.readouterr().out
    assert main(["fit", str(path), "--loss-col", "val"]) == 2
    assert "column 'val'" in capsys.readouterr().err


def test_a_column_named_twice_or_a_row_with_extra_cells_is_refused(tmp_path):
    twice = tmp_path / "twice.csv"
    twice.write_text("N,N,L\n1e6,2e9,3.1\n2e6,4e9,2.9\n")
    with pytest.raises(ScalingDataError, match="column 'N' named twice in the header"):
        load_table(twice)
    extra = tmp_path / "extra.csv"
    extra.write_text("N,D,L\n1e6,2e9,3.1\n2e6,4e9,2.9,7\n")
    with pytest.raises(ScalingDataError, match="data row 2 has 4 cells; the header names 3"):
        load_table(extra)
