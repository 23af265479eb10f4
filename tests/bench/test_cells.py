"""The benchmarks' one loop over cells, and each benchmark run once at a tiny size."""

import pytest

from scalestudy.bench import data, train
from scalestudy.bench.cells import cells
from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import VALID_CELLS, load_config

TINY = [
    "model.d_model=32",
    "model.d_ff=64",
    "model.n_heads=2",
    "model.n_layers=2",
    "objective.inputs_length=24",
    "objective.targets_length=8",
    "train.batch_size=8",
    "data.synthetic.n_train_documents=60",
    "data.synthetic.n_validation_documents=10",
]


def test_cells_are_exactly_the_valid_cells_and_keep_the_rest_of_the_config():
    base = load_config(None, TINY)
    got = [(a, o) for a, o, _ in cells(base)]
    assert got == [(a, o) for a, objs in VALID_CELLS.items() for o in objs]
    for arch, name, cell in cells(base, data={"seed": 7}):
        assert (cell.model.arch, cell.objective.name) == (arch, name)
        assert cell.model.d_model == 32 and cell.data.seed == 7


def test_one_cell_per_arch_prefers_the_configured_objective():
    flm = load_config(None, [*TINY, "objective.name=flm"])
    picked = {a: o for a, o, _ in cells(flm, one_per_arch=True)}
    assert picked == {"causal_decoder": "flm", "noncausal_decoder": "plm", "encoder_decoder": "plm"}
    with pytest.raises(ConfigError, match=r"--arch \['gpt'\].*causal_decoder"):
        list(cells(flm, archs=("gpt",)))


def test_data_bench_reports_every_cell():
    out = data.bench(load_config(None, TINY), steps=2)
    for arch, objectives in VALID_CELLS.items():
        for name in objectives:
            assert out[f"{name}/{arch}/tokens_per_s"] >= out[f"{name}/{arch}/loss_tokens_per_s"] > 0


@pytest.mark.slow
def test_train_bench_one_row_per_requested_arch():
    cfg = load_config(None, TINY)
    out = train.bench(cfg, steps=1, archs=("causal_decoder", "encoder_decoder"))
    rows = {k for k, v in out.items() if isinstance(v, dict)}
    assert rows == {"causal_decoder", "encoder_decoder"}
    assert all(out[a]["mfu"] > 0 for a in rows)


@pytest.mark.slow
def test_train_bench_runs_steps_per_call_as_the_loop_does_with_cpu_time_mfu():
    cfg = load_config(None, [*TINY, "train.steps_per_call=2"])
    row = train.bench(cfg, steps=3, archs=("causal_decoder",))["causal_decoder"]
    assert row["steps_per_call"] == 2
    # Counted FLOPs over CPU time against the host's matmul FLOPs per CPU second: a tiny
    # step on a CPU is far below the matmul peak, and never above it.
    assert 0 < row["mfu_cpu"] < 1 and row["cpu_ms"] > 0


def test_eval_bench_times_bucketed_rows_against_one_shape_and_they_agree():
    from scalestudy.bench.eval import time_tasks

    out = time_tasks(load_config(None, [*TINY, "eval.max_examples=6"]), rounds=1)
    assert out["pairs"] > 24 and out["same_predictions"]
    assert out["max_logprob_diff"] < 1e-4
    # A task this small fills no shorter row's calls: never more positions than one shape.
    assert 0 < out["bucketed/positions"] <= out["one_shape/positions"]
    assert out["bucketed/cpu_s"] > 0 and out["one_shape/cpu_s"] > 0
