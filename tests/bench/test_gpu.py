"""`bench gpu`: its rows' configs are valid, it refuses a host without a GPU in one line, and a
row that fails records its error while the rest go on."""

import json

from scalestudy.bench import gpu
from scalestudy.cli.main import main


def test_bench_gpu_refuses_a_host_without_a_gpu(capsys):
    assert main(["bench", "gpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: bench gpu") and "'cpu'" in err and "[gpu]" in err


def test_every_row_of_the_plan_is_named_once_and_its_configs_validate(monkeypatch):
    built = []
    monkeypatch.setattr(gpu, "ours", lambda cfg, blocks=None: built.append(cfg) or {})
    monkeypatch.setattr(gpu, "nanodo", lambda cfg: built.append(cfg) or {})
    monkeypatch.setattr(gpu, "agreement", lambda *a: {})
    monkeypatch.setattr(gpu, "member_steps", lambda k: {})
    names = []
    for name, measure in gpu.plan_rows():
        names.append(name)
        measure()
    assert len(names) == len(set(names))
    assert {c.model.arch for c in built} == {
        "causal_decoder",
        "noncausal_decoder",
        "encoder_decoder",
    }
    assert all(c.model.dtype == "bfloat16" and c.model.scan_layers in (True, False) for c in built)


def test_a_failing_row_is_recorded_and_the_rest_go_on(monkeypatch, tmp_path):
    def plan():
        yield "broken", lambda: 1 / 0
        yield "fine", lambda: {"step_ms": 1.0}

    monkeypatch.setattr(gpu, "plan_rows", plan)
    rows = gpu.bench(tmp_path / "rows.jsonl", budget_s=60)
    assert rows["broken"]["error"].startswith("ZeroDivisionError") and rows["fine"]["step_ms"] == 1
    lines = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [x["row"] for x in lines] == ["device", "broken", "fine"]
