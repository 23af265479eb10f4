"""`scalestudy fit` / `plot`: every bad option, path or file is one line on stderr, exit 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scalestudy.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def runs_csv(tmp_path, make_isoflop):
    t = make_isoflop(budgets=(1e18, 1e19, 1e20), sizes=5)
    path = tmp_path / "runs.csv"
    lines = ["run,N,D,loss"] + [
        f"r{i},{n},{d},{x}" for i, (n, d, x) in enumerate(zip(t.N, t.D, t.loss))
    ]
    path.write_text("\n".join(lines))
    return path


def _one_line_error(capsys, *words):
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--huber-delta", "0"),
        ("--huber-delta", "nan"),
        ("--huber-delta", "-1e-3"),
        ("--isoflop-tol", "0"),
        ("--isoflop-tol", "nan"),
        ("--isoflop-tol", "-0.1"),
        ("--holdout", "-1"),
        ("--flops-per-nd", "0"),
        ("--flops-per-nd", "nan"),
        ("--flops-per-nd", "-6"),
        ("--seed", "-1"),
        ("--ci", "0"),
        ("--ci", "1.5"),
        ("--ci", "nan"),
        ("--bootstrap", "-1"),
        ("--bootstrap", "1"),
        ("--at-compute", "-1e21"),
        ("--at-compute", "nan"),
        ("--at-compute", "1e21,big"),
        ("--compare-at", "0"),
        ("--kfold", "1"),
        ("--kfold", "many"),
        ("--min-points-per-param", "0"),
        ("--min-points-per-param", "inf"),
    ],
)
def test_numeric_options_are_validated(runs_csv, capsys, flag, value):
    assert main(["fit", str(runs_csv), "--law", "chinchilla2", f"{flag}={value}"]) == 2
    _one_line_error(capsys, flag)


def test_paths_and_fits_files_give_one_line_errors(tmp_path, runs_csv, capsys):
    assert main(["fit", str(tmp_path / "missing.csv")]) == 2
    _one_line_error(capsys, "not found")
    assert main(["fit", str(runs_csv), "--law", "chinchilla2", "--out", str(tmp_path)]) == 2
    _one_line_error(capsys, "--out", "is a directory")
    (tmp_path / "afile").write_text("x")
    assert main(["plot", str(runs_csv), "--out", str(tmp_path / "afile")]) == 2
    _one_line_error(capsys, "--out", "is a file")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["plot", str(runs_csv), "--out", str(tmp_path / "f"), "--fits", str(bad)]) == 2
    _one_line_error(capsys, "--fits", "not valid JSON")
    bad.write_text("[1, 2]")
    assert main(["plot", str(runs_csv), "--out", str(tmp_path / "f"), "--fits", str(bad)]) == 2
    _one_line_error(capsys, "--fits", "not a fit result")
    assert main(["plot", str(runs_csv), "--out", str(tmp_path / "f"), "--bootstrap=-2"]) == 2
    _one_line_error(capsys, "--bootstrap")


def test_plot_refuses_fits_made_from_other_data(tmp_path, runs_csv, capsys):
    fits = tmp_path / "fits.json"
    args = ["--law", "chinchilla2", "--bootstrap", "0"]
    assert main(["fit", str(runs_csv), *args, "--out", str(fits)]) == 0
    assert len(json.loads(fits.read_text())["data_fingerprint"]) == 16
    capsys.readouterr()
    out = tmp_path / "figs"
    assert main(["plot", str(runs_csv), "--out", str(out), "--fits", str(fits)]) == 0
    other = tmp_path / "other.csv"
    other.write_text(runs_csv.read_text().replace("r0,", "r0,1", 1))
    capsys.readouterr()
    assert main(["plot", str(other), "--out", str(out), "--fits", str(fits)]) == 2
    _one_line_error(capsys, "fitted to other runs", "fingerprint")


def test_broken_pipe_ends_quietly(runs_csv):
    # `true` exits at once, so the fit's output meets a closed pipe (`| head -1` on output
    # longer than the pipe's buffer does the same).
    fit = f"{sys.executable} -m scalestudy.cli.main fit {runs_csv} --law chinchilla2 --bootstrap 0"
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    for reader in ("true", "head -1"):
        proc = subprocess.run(
            ["bash", "-c", f"set -o pipefail; {fit} | {reader}"],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,  # a safety net under load, not a measurement
            cwd=ROOT,
        )
        assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
        assert proc.returncode in (0, 141)
    assert proc.stdout.startswith("data: ")


def test_where_and_exclude_filter_runs(runs_csv, tmp_path, capsys):
    out = tmp_path / "fit.json"
    rc = main(
        [
            "fit",
            str(runs_csv),
            "--law",
            "chinchilla2",
            "--bootstrap",
            "0",
            "--run-col",
            "run",
            "--where",
            "C>=5e18",
            "--exclude",
            "r14",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["cells"]["all"]["summary"]["runs"] == 9  # 10 runs at 1e19 and 1e20, less r14
    assert res["data"]["filters"] == ["C>=5e18", "excluded runs: r14"]
    assert "filters: C>=5e18; excluded runs: r14" in capsys.readouterr().out
    assert main(["fit", str(runs_csv), "--where", "size>1"]) == 2
    _one_line_error(capsys, "--where", "no quantity or column 'size'")
    assert main(["fit", str(runs_csv), "--run-col", "run", "--exclude", "nope"]) == 2
    _one_line_error(capsys, "--exclude", "nope")
    assert main(["fit", str(runs_csv), "--where", "N>>3"]) == 2
    _one_line_error(capsys, "--where")


def test_malformed_run_files_give_one_line_errors(tmp_path, capsys):
    bad = tmp_path / "runs.json"
    bad.write_text('[{"N": 1e6,')
    assert main(["fit", str(bad)]) == 2
    _one_line_error(capsys, "not valid JSON")
    bad.write_text("[1, 2]")
    assert main(["fit", str(bad)]) == 2
    _one_line_error(capsys, "array of objects")
    lines = tmp_path / "runs.jsonl"
    lines.write_text("[1, 2]\n")
    assert main(["fit", str(lines)]) == 2
    _one_line_error(capsys, "JSON object")
    binary = tmp_path / "runs.csv"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 10)
    assert main(["fit", str(binary)]) == 2
    _one_line_error(capsys, "not a text file")
