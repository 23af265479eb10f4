"""Export a study's runs (and, with --curves, its training curves) to CSV.

    python analysis/runs_table.py runs/smoke --out runs/smoke/runs.csv
    python analysis/runs_table.py runs/smoke --curves --out runs/smoke/curves.csv

Columns are those of `scalestudy.study.run.registry.load_runs` / `load_curves`; every run carries
total and non-embedding parameters, its stack shape and its training FLOPs, so a comparison in
another matching mode can be redone from the CSV alone.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from scalestudy.study.run.registry import load_curves, load_runs


def _write(handle, columns: list[str], rows: list[dict]) -> None:
    writer = csv.DictWriter(handle, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("study", help="study directory or registry.sqlite")
    p.add_argument("--curves", action="store_true", help="per-step curves instead of runs")
    p.add_argument("--out", default=None, help="CSV path (default: stdout)")
    args = p.parse_args(argv)
    rows = load_curves(args.study) if args.curves else load_runs(args.study)
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    if args.out is None:
        _write(sys.stdout, columns, rows)
    else:
        with open(args.out, "w", newline="") as handle:
            _write(handle, columns, rows)
        print(f"{len(rows)} rows -> {Path(args.out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
