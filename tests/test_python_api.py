"""docs/python.md runs as written: its code blocks, in order, in one namespace, in a fresh
directory; and the names it uses are exported by `scalestudy`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "python.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_import_scalestudy_imports_nothing_heavy():
    """The exports are lazy: `import scalestudy` loads neither JAX nor the package's rooms."""
    code = (
        "import sys, scalestudy\n"
        "heavy = [m for m in ('jax', 'flax', 'scalestudy.train', 'scalestudy.scaling') "
        "if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert callable(scalestudy.fit_cells) and 'scalestudy.scaling' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_every_export_resolves():
    import scalestudy

    for name in scalestudy.__all__:
        assert getattr(scalestudy, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        scalestudy.nothing  # noqa: B018


def test_a_dataframe_is_a_table():
    """build_table takes a pandas DataFrame as it takes the list of its rows."""
    pd = pytest.importorskip("pandas")
    from scalestudy import DataSettings, build_table

    rows = [{"N": n, "D": d, "loss": 2 + 1 / n + 1 / d} for n in (1e6, 1e7) for d in (1e8, 1e9)]
    from_frame = build_table(pd.DataFrame(rows), DataSettings(), "t")
    from_rows = build_table(rows, DataSettings(), "t")
    for field in ("N", "D", "loss", "C"):
        np.testing.assert_array_equal(getattr(from_frame, field), getattr(from_rows, field))


def test_the_python_page_runs(tmp_path: Path, monkeypatch):
    blocks = BLOCK.findall(PAGE.read_text())
    assert len(blocks) == 6
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{PAGE.name} block {i + 1}", "exec"), namespace)
    ns = namespace
    assert len(ns["summaries"]) == 2
    assert ns["summaries"][0]["final_train_loss"] != ns["summaries"][1]["final_train_loss"]
    assert ns["step"] == 8 and ns["scores"]["step"] == 8
    assert np.all(np.isfinite(ns["logprob"])) and np.all(ns["logprob"] < 0)
    assert list(ns["n_tokens"]) == [len(ns["vocab"].encode(c)) for c in ns["choices"]]
    assert any(k.endswith("/acc") for k in ns["scores"])
    params = ns["fits"]["cells"]["all"]["fits"]["chinchilla3"]["params"]  # the page's truth
    want = {"E": 1.7, "A": 400, "alpha": 0.34, "B": 410, "beta": 0.28}
    assert {k: params[k]["value"] for k in want} == pytest.approx(want, rel=1e-3)
    assert ns["paths"] and all(Path(p).is_file() for p in ns["paths"])
