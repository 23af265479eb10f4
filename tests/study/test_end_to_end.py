"""The main job in miniature: `scalestudy study` trains, evaluates, fits, plots and reports."""

import json
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import yaml

from scalestudy.cli import main as cli
from scalestudy.study.record.registry import load_curves, load_runs
from scalestudy.study.report.fits import load_table
from tests.study.conftest import write_spec

pytest.importorskip("scalestudy.train.loop")
pytest.importorskip("scalestudy.scaling.fit_plots")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[Path, Path]:
    """(spec, out) of the tiny study trained once by one process; both tests read it."""
    spec = write_spec(tmp_path_factory.mktemp("spec") / "tiny.yaml")
    out = tmp_path_factory.mktemp("one") / "study"
    assert cli.main(["study", "--spec", str(spec), "--out", str(out)]) == 0
    return spec, out


@pytest.mark.slow
def test_tiny_study_end_to_end(one_process, capsys):
    tiny_spec, out = one_process
    runs = load_runs(out)
    assert len(runs) == 4 and all(r["status"] == "done" for r in runs)
    for r in runs:
        assert r["loss"] is not None and r["flops"] > 0 and r["tokens"] > 0
        assert 0.0 <= r["eval/synthetic_probes/acc"] <= 1.0
        assert r["params_total"] > r["params_non_embedding"] > 0
    # Training FLOPs recorded by the run equal the planned steps x batch x FLOPs per example.
    for r in runs:
        assert r["flops"] == pytest.approx(r["steps"] * r["batch_size"] * r["flops_per_example"])
    assert {c["run_id"] for c in load_curves(out)} == {r["run_id"] for r in runs}
    # Every run keeps its per-example scores in its own directory, and the registry's task
    # loss is their gold answers' mean negative log-likelihood per byte.
    for r in runs:
        files = list(Path(r["workdir"]).glob("eval_examples/step_*/synthetic_probes.jsonl"))
        assert [f.parent.name for f in files] == [f"step_{r['steps']}"]
        rows = [json.loads(line) for line in files[0].read_text().splitlines()]
        gold = [x["choices"][x["gold"]] for x in rows]
        per_byte = np.mean([-g["logprob"] / len((" " + g["text"]).encode()) for g in gold])
        assert r["eval/synthetic_probes/task_loss"] == pytest.approx(per_byte, rel=1e-9)
        assert np.isfinite(r["eval/synthetic_probes/pronoun/task_loss"])
    report = (out / "report.md").read_text()
    assert "Equal parameters" in report and "Equal compute" in report
    assert "not comparable" in report
    # Matched comparisons name what is held equal; one seed gives no between-run interval.
    assert "## Matched comparisons" in report and "Held equal: " in report
    assert "not a between-run interval" in report
    # Two sizes are too few for a task law, and the report says so.
    assert "## Zero-shot task laws" in report
    assert "task law of synthetic_probes, synthetic_probes/friend_name" in report
    assert all(r["data_seed"] == 0 and r["loss_tokens"] for r in runs)
    assert any((out / "figures").glob("*.png")) and (out / "report.html").is_file()
    assert (out / "fits.json").is_file()

    # A second invocation trains nothing and rewrites the same report.
    capsys.readouterr()
    assert cli.main(["study", "--spec", str(tiny_spec), "--out", str(out)]) == 0
    assert "4 of 4 runs already done; 0 to go" in capsys.readouterr().out


class _Page(HTMLParser):
    """What a browser would build of report.html: tags that do not close in order, the
    images, the headings' text."""

    VOID = frozenset({"br", "col", "hr", "img", "input", "link", "meta", "source", "wbr"})

    def __init__(self):
        super().__init__()
        self.open, self.misnested, self.images, self.headings = [], [], [], []
        self._heading: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        if re.fullmatch(r"h[1-6]", tag):
            self._heading = ""
        if tag not in self.VOID:
            self.open.append(tag)

    def handle_endtag(self, tag):
        if re.fullmatch(r"h[1-6]", tag) and self._heading is not None:
            self.headings.append(self._heading.strip())
            self._heading = None
        if self.open and self.open[-1] == tag:
            self.open.pop()
        else:
            self.misnested.append(f"</{tag}> where {self.open[-1:]} is open")

    def handle_data(self, data):
        if self._heading is not None:
            self._heading += data


def _cells(row: str) -> int:
    return len(re.split(r"(?<!\\)\|", row.strip())) - 2


def _ragged_table_rows(md: str) -> list[str]:
    """Markdown table rows whose cell count is not their header's (an unescaped '|' in a
    cell): the HTML table drops or pads their cells without a word."""
    lines, bad = md.splitlines(), []
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and re.fullmatch(r"\|[-|: ]+\|", lines[i + 1]):
            width = _cells(line)
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                if _cells(row) != width:
                    bad.append(row)
    return bad


@pytest.mark.slow
def test_the_html_report_is_whole_and_holds_what_the_markdown_holds(one_process):
    """Offline in place of a browser: report.html's tags nest, every image it shows is a file
    of the study, every heading of report.md is a heading there, and no table row of
    report.md has more or fewer cells than its header."""
    _, out = one_process
    md = (out / "report.md").read_text()
    page = _Page()
    page.feed((out / "report.html").read_text())
    page.close()
    assert page.misnested == [] and page.open == []
    assert page.images and len(page.images) == md.count("![")
    assert [src for src in page.images if not (out / src).is_file()] == []
    headings = [line.lstrip("#").strip().replace("`", "") for line in md.splitlines()
                if line.startswith("#")]  # fmt: skip
    assert headings and headings == page.headings
    assert _ragged_table_rows(md) == []
    assert _ragged_table_rows("| a | b |\n|---|---|\n| 1 | x | y |\n") != []  # it can fail


@pytest.mark.slow
def test_a_smaller_spec_reports_only_its_own_runs_and_names_the_rest(one_process, tmp_path):
    """The registry keeps the runs of an earlier, larger spec; the report and its fits cover
    only what the spec plans now, and name the runs left out."""
    tiny_spec, one = one_process
    out = tmp_path / "study"
    shutil.copytree(one, out)
    spec = yaml.safe_load(tiny_spec.read_text())
    spec["ladder"]["sizes"] = spec["ladder"]["sizes"][:1]
    small = tmp_path / "small.yaml"
    small.write_text(yaml.safe_dump(spec))
    assert cli.main(["study", "--spec", str(small), "--out", str(out), "fit.bootstrap=0"]) == 0
    report = (out / "report.md").read_text()
    left = sorted(r["name"] for r in load_runs(out) if r["size"] != "xs")
    assert len(left) == 2 and len(load_runs(out)) == 4  # the registry keeps them
    assert "2 of 2 runs finished" in report
    sentence = (
        f"Left out: 2 run(s) of the registry that this spec does not plan ({', '.join(left)})."
    )
    assert report.count(sentence) == 1
    assert [name for name in left if name in report.replace(sentence, "")] == []
    table = load_table(out)  # `scalestudy fit OUT` and `plot` read what the report reads
    assert table.choices["unplanned_runs_left_out"] == left
    assert set(table.run_id) == {r["run_id"] for r in load_runs(out) if r["size"] == "xs"}


@pytest.mark.slow
def test_two_workers_train_the_same_runs_as_one(one_process, tmp_path, capsys):
    # Trained by two worker processes, each run's validation loss and probe accuracy are
    # those of a one-process study (the fit's bootstrap, skipped here, trains nothing).
    tiny_spec, one = one_process
    two = tmp_path / "two"
    argv = ["study", "--spec", str(tiny_spec), "fit.bootstrap=0"]
    assert cli.main([*argv, "--out", str(two), "--workers", "2"]) == 0
    a = {r["run_id"]: r for r in load_runs(one)}
    b = {r["run_id"]: r for r in load_runs(two)}
    assert a.keys() == b.keys() and all(r["status"] == "done" for r in b.values())
    for k, r in a.items():
        assert b[k]["loss"] == pytest.approx(r["loss"], rel=1e-6)
        assert b[k]["eval/synthetic_probes/acc"] == r["eval/synthetic_probes/acc"]
    assert {c["run_id"] for c in load_curves(two)} == set(b)
    with pytest.raises(SystemExit):
        cli.main([*argv, "--out", str(two), "--workers", "0"])
    assert "--workers: a whole number of at least 1 is accepted; got '0'" in capsys.readouterr().err
