"""`compile --topology T --search`: every mesh and remat policy the model allows, pruned by
memory, ranked by the roofline's step time, and the winner's lines load as a config."""

import dataclasses
import importlib.util

import pytest
import yaml

from scalestudy.config import load_config
from scalestudy.train import chips, plan_search

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None, reason="no TPU compiler (the `tpu` extra)"
    ),
]

TINY = ["model.d_model=32", "model.d_ff=64", "model.n_heads=4", "model.n_layers=2",
        "model.vocab_size=384", "model.dtype=float32", "objective.inputs_length=24",
        "objective.targets_length=8", "train.batch_size=8"]  # fmt: skip


def test_factorisations_divide_the_chips_the_heads_and_the_batch():
    cfg = load_config(None, TINY)
    meshes = plan_search.factorisations(8, cfg)
    assert all(d * f * t == 8 and 4 % t == 0 and 8 % (d * f) == 0 for d, f, t in meshes)
    assert (1, 1, 8) not in meshes  # 8-way tensor parallelism cannot split 4 heads
    assert len(meshes) == len(set(meshes)) == 9


def test_search_ranks_by_estimated_step_time_prunes_what_does_not_fit(monkeypatch, capsys):
    cfg = load_config(None, TINY)
    real = chips.chip

    def small_hbm(kind):  # a chip whose HBM holds only the leaner plans of this tiny model
        entry = real(kind)
        return dataclasses.replace(entry, hbm_gib=0.0095) if entry is not None else None

    monkeypatch.setattr(chips, "chip", small_hbm)
    found = plan_search.search(cfg, "v5e-4", remats=("none", "full"))
    ranked, pruned = found["ranked"], found["pruned"]
    assert len(ranked) + len(pruned) == 2 * len(plan_search.factorisations(4, cfg))
    assert ranked and pruned and all("GiB per chip" in p["why"] for p in pruned)
    assert all(r["total_gib_per_chip"] <= 0.0095 for r in ranked)
    steps = [r["est_step_s"] for r in ranked]
    assert steps == sorted(steps)
    # The winner's lines are config YAML that loads, on the slice's four chips.
    lines = yaml.safe_load("\n".join(found["winner"]))
    best = load_config(
        None, [*TINY, *(f"{k}.{kk}={v}" for k, d in lines.items() for kk, v in d.items())]
    )
    assert best.mesh.data * best.mesh.fsdp * best.mesh.tensor == 4
    assert f"{best.mesh.data}x{best.mesh.fsdp}x{best.mesh.tensor}" == ranked[0]["mesh"]
    text = plan_search.render(found)
    assert text.index(ranked[0]["mesh"]) < text.index("pruned") < text.index("winner")
