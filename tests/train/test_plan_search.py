"""`compile --topology T --search`: every mesh and remat policy the model allows, pruned by
memory, ranked by the roofline's step time, and the winner's lines load as a config."""

import dataclasses
import importlib.util

import pytest
import yaml

from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import load_config
from scalestudy.train import datasheets
from scalestudy.train.plan import search

pytestmark = [
    pytest.mark.slow,
    pytest.mark.optimized,  # the compiler's memory and cost analysis
    pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None, reason="no TPU compiler (the `tpu` extra)"
    ),
]

TINY = ["model.d_model=32", "model.d_ff=64", "model.n_heads=4", "model.n_layers=2",
        "model.vocab_size=384", "model.dtype=float32", "objective.inputs_length=24",
        "objective.targets_length=8", "train.batch_size=8"]  # fmt: skip
MOE = ["model.moe.enabled=true", "model.moe.routed_experts=4", "model.moe.d_expert=16",
       "model.moe.dispatch=capacity"]  # fmt: skip


def test_factorisations_divide_the_chips_the_heads_and_the_batch():
    cfg = load_config(None, TINY)
    meshes = search.factorisations(8, cfg)
    assert all(d * f * e * t == 8 and 4 % t == 0 and 8 % (d * f) == 0 for d, f, e, t in meshes)
    assert {e for _, _, e, _ in meshes} == {1}  # a dense model has no expert axis
    assert (1, 1, 1, 8) not in meshes  # 8-way tensor parallelism cannot split 4 heads
    assert len(meshes) == len(set(meshes)) == 9


def test_an_moe_models_factorisations_add_an_expert_axis_dividing_its_experts():
    cfg = load_config(None, [*TINY, *MOE])
    meshes = search.factorisations(8, cfg)
    assert all(d * f * e * t == 8 and 4 % e == 0 and 16 % t == 0 for d, f, e, t in meshes)
    assert {e for _, _, e, _ in meshes} == {1, 2, 4}  # not 8: it must divide 4 experts
    assert (1, 1, 4, 2) in meshes and (2, 1, 4, 1) in meshes
    assert search.label((2, 1, 4, 1), cfg) == "2x1x4x1"


def test_axes_and_remat_given_as_overrides_are_held():
    over = [*TINY, "mesh.data=1", "model.remat=save_attention"]
    cfg = load_config(None, over)
    fixed, remats = search.held(cfg, over)
    assert fixed == {"data": 1} and remats == ("save_attention",)
    meshes = search.factorisations(8, cfg, fixed)
    assert meshes == [m for m in search.factorisations(8, cfg) if m[0] == 1]
    assert {(f, t) for _, f, _, t in meshes} == {(8, 1), (4, 2), (2, 4)}
    assert search.held(load_config(None, TINY), TINY) == ({}, search.REMATS)
    with pytest.raises(ConfigError, match=r"mesh\.tensor=8 held"):  # 8 cannot split 4 heads
        search.search(cfg, "v5e-8", fixed={"tensor": 8})


def _small_hbm(monkeypatch, gib: float) -> None:
    real = datasheets.chip

    def small_hbm(kind):  # a chip whose HBM holds only some plans of this tiny model
        entry = real(kind)
        return dataclasses.replace(entry, hbm_gib=gib) if entry is not None else None

    monkeypatch.setattr(datasheets, "chip", small_hbm)


def test_search_ranks_by_estimated_step_time_prunes_what_does_not_fit(monkeypatch):
    cfg = load_config(None, TINY)
    _small_hbm(monkeypatch, 0.0095)
    found = search.search(cfg, "v5e-4", remats=("none", "full"))
    ranked, pruned = found["ranked"], found["pruned"]
    assert len(ranked) + len(pruned) == 2 * len(search.factorisations(4, cfg))
    assert ranked and pruned
    assert all(r["total_gib_per_chip"] <= 0.0095 for r in ranked)
    steps = [r["est_step_s"] for r in ranked]
    assert steps == sorted(steps)
    # The roofline's three terms are shown beside the step, which none of them exceeds.
    terms = ("compute_s", "memory_s", "communication_s")
    assert all(r["est_step_s"] >= max(r[k] for k in terms) * (1 - 1e-3) for r in ranked)
    # Remat none keeps more than full: where full does not fit, none is not compiled.
    full_out = {p["mesh"] for p in pruned if p["remat"] == "full"}
    assert all(
        p["why"] == "keeps more than remat full, which does not fit"
        for p in pruned
        if p["remat"] == "none" and p["mesh"] in full_out
    )
    assert found["compiles"] == len(ranked) + len(pruned) - len(full_out)
    # The winner's lines are config YAML that loads, on the slice's four chips.
    lines = yaml.safe_load("\n".join(found["winner"]))
    best = load_config(
        None, [*TINY, *(f"{k}.{kk}={v}" for k, d in lines.items() for kk, v in d.items())]
    )
    assert best.mesh.data * best.mesh.fsdp * best.mesh.tensor == 4
    assert f"{best.mesh.data}x{best.mesh.fsdp}x{best.mesh.tensor}" == ranked[0]["mesh"]
    text = search.render(found, cfg)
    assert text.index(ranked[0]["mesh"]) < text.index("pruned") < text.index("winner")


def test_a_mesh_whose_state_alone_overflows_is_pruned_uncompiled(monkeypatch, capsys):
    """Replicated state (all data) overflows a chip that fsdp 4's quarter of it fits."""
    from scalestudy.train.plan import aot

    cfg = load_config(None, TINY)
    state = {m: aot.state_plan(search.candidate(cfg, m, "full"), "v5e-4")[0]
             for m in search.factorisations(4, cfg)}  # fmt: skip
    assert state[(4, 1, 1, 1)] > state[(1, 4, 1, 1)]
    _small_hbm(monkeypatch, (state[(4, 1, 1, 1)] - 1) / 2**30)
    found = search.search(cfg, "v5e-4", remats=("full",))
    overflow = {search.label(m, cfg) for m, b in state.items() if b > state[(4, 1, 1, 1)] - 1}
    assert "4x1x1" in overflow
    for row in found["pruned"]:
        assert row["why"].startswith("state alone") == (row["mesh"] in overflow), row
    assert found["compiles"] == len(state) - len(overflow)
    # One progress line per compiled candidate, none for the pruned uncompiled.
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("search [")]
    assert len(lines) == found["compiles"]
    assert not any(f" {mesh} " in x for mesh in overflow for x in lines)


def test_an_moe_search_plans_the_expert_axis_and_its_winner_loads(monkeypatch):
    cfg = load_config(None, [*TINY, *MOE])
    found = search.search(cfg, "v5e-4", remats=("full",))
    assert len(found["ranked"]) + len(found["pruned"]) == len(search.factorisations(4, cfg))
    assert any(r["sizes"]["expert"] > 1 for r in found["ranked"])
    lines = yaml.safe_load("\n".join(found["winner"]))
    best = load_config(
        None, [*TINY, *MOE, *(f"{k}.{kk}={v}" for k, d in lines.items() for kk, v in d.items())]
    )
    sizes = (best.mesh.data, best.mesh.fsdp, best.mesh.expert, best.mesh.tensor)
    assert search.label(sizes, cfg) == found["ranked"][0]["mesh"]
    assert "data x fsdp x expert x tensor" in search.render(found, cfg)
