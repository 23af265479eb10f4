"""A study's seeds train as members of one program, and its registry is the one a study of
runs trained alone writes (within the float32 tolerance of batched matmuls)."""

import json
from pathlib import Path

import pytest

from scalestudy.cli import main as cli
from scalestudy.config.errors import ConfigError
from scalestudy.study.plan import groups
from scalestudy.study.record.registry import load_runs
from scalestudy.study.run.main_job import expand, load_study
from tests.study.conftest import write_spec

RTOL = 1e-3  # tests/train/test_members.py states where it comes from


def _spec(tmp_path: Path, **changes) -> Path:
    return write_spec(
        tmp_path / "seeds.yaml",
        cells=[["causal_decoder", "flm"], ["encoder_decoder", "plm"]],
        ladder={"sizes": [{"name": "xs", "d_model": 16, "n_layers": 2, "d_ff": 32}]},
        seeds=[0, 1, 2],
        fit={"laws": [], "bootstrap": 0},
        # A cell trained with its own rate: the report must say so wherever cells meet.
        cell_base={"encoder_decoder/plm": {"optim": {"learning_rate": 0.002}}},
        **changes,
    )


@pytest.mark.slow
def test_seeds_train_as_groups_and_record_what_runs_alone_record(tmp_path, capsys):
    spec = _spec(tmp_path)
    assert cli.main(["study", "--spec", str(spec), "--out", str(tmp_path / "g")]) == 0
    assert "6 runs in 2 programs: 2 groups of 3 members, 0 alone" in capsys.readouterr().out
    argv = ["study", "--spec", str(spec), "members=1", "--out", str(tmp_path / "a")]
    assert cli.main(argv) == 0
    grouped = {r["run_id"]: r for r in load_runs(tmp_path / "g")}
    alone = {r["run_id"]: r for r in load_runs(tmp_path / "a")}
    assert grouped.keys() == alone.keys() and len(grouped) == 6
    for run_id, r in alone.items():
        g = grouped[run_id]
        assert g["status"] == r["status"] == "done"
        assert g["loss"] == pytest.approx(r["loss"], rel=RTOL)
        assert g["tokens"] == r["tokens"] and g["flops"] == r["flops"]
        # Every member evaluated as a run is (its own per-example files).
        assert g["eval/synthetic_probes/acc"] == pytest.approx(
            r["eval/synthetic_probes/acc"], abs=1 / 8 + 1e-9
        )
        summary = json.loads((Path(g["workdir"]) / "summary.json").read_text())
        assert summary["timing"]["members"] == 3.0
    report = (tmp_path / "g" / "report.md").read_text()
    assert "recipe: optim.learning_rate 0.002 vs 0.001" in report


def test_the_dry_run_shows_the_groups_and_members_one_turns_them_off(tmp_path, capsys):
    spec = _spec(tmp_path)
    assert cli.main(["study", "--spec", str(spec), "--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "members: 6 runs in 2 programs" in out
    assert "one program: causal_decoder.flm.xs.s0, causal_decoder.flm.xs.s1" in out
    argv = ["study", "--spec", str(spec), "members=1", "--dry-run", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    assert "members: 6 runs, each alone (members: 1)" in capsys.readouterr().out


def test_groups_keep_the_study_order_and_respect_the_cap(tmp_path):
    study = load_study(_spec(tmp_path))
    runs = expand(study, tmp_path)
    jobs = groups.plan_groups(runs, 2)
    # Runs are planned seed by seed over the cells; a group starts where its first run is.
    assert [len(j) for j in jobs] == [2, 2, 1, 1]
    assert jobs[0][0] is runs[0]
    assert all(len({r.arch for r in j}) == 1 for j in jobs)
    assert groups.plan_groups(runs, 1) == [[r] for r in runs]


def test_groups_split_over_the_data_axis_hold_whole_multiples_of_it(tmp_path):
    """With `mesh.members: data` each data slice trains whole members, so a group's size is a
    multiple of mesh.data: 7 seeds of a cell at a cap of 5 over mesh.data=2 train as groups of
    4 and 2 (never 5, or the 1 left over) and one run alone, without a member axis."""
    import jax

    spec = _spec(tmp_path)
    mesh = ["base.mesh.data=2", f"base.mesh.fsdp={jax.device_count() // 2}"]
    mesh += ["seeds=[0,1,2,3,4,5,6]"]
    runs = expand(load_study(spec, [*mesh, "base.mesh.members=data"]), tmp_path)
    jobs = groups.plan_groups(runs, 5)
    assert [len(j) for j in jobs] == [4, 4, 2, 2, 1, 1]  # per cell: 4, 2 and 1 alone
    assert sorted(id(r) for j in jobs for r in j) == sorted(map(id, runs))
    assert groups.member_multiple(runs[0].cfg) == 2
    unsplit = expand(load_study(spec, mesh), tmp_path)
    assert [len(j) for j in groups.plan_groups(unsplit, 5)] == [5, 5, 2, 2]
    assert [len(j) for j in groups.plan_groups(runs, 1)] == [1] * 14


@pytest.mark.parametrize("bad", [0, -1, "most", 1000, True])
def test_a_bad_members_value_is_one_error(tmp_path, bad):
    with pytest.raises(ConfigError, match="members"):
        load_study(_spec(tmp_path, members=bad))
