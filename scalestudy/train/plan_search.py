"""`scalestudy compile --topology T --search`: the mesh and remat policy a TPU slice should use.

Candidates: every factorisation of the slice's chips into data x fsdp x tensor whose tensor
size divides the heads and the MLP width and whose data x fsdp divides the batch, times the
remat policies `REMATS`. Each is compiled for memory first (`compile_plan(costs=False)`); one
that does not fit the chip's HBM, or that the compiler refuses, is pruned there. The rest get
the roofline (`train/roofline.py`: compute, HBM and ICI times from the compiled program's
costs) and are ranked by its estimated step time, fastest first. The winner's config lines
are printed to paste into an experiment YAML.
"""

from __future__ import annotations

import json
from typing import Any

from scalestudy.config import ExperimentConfig
from scalestudy.errors import ConfigError

REMATS = ("none", "save_attention", "minimal", "full")


def factorisations(chips: int, cfg: ExperimentConfig) -> list[tuple[int, int, int]]:
    """(data, fsdp, tensor) with data x fsdp x tensor = `chips` that the model and batch
    allow: tensor divides the heads and d_ff, data x fsdp divides the batch."""
    m, batch = cfg.model, cfg.train.batch_size
    out = []
    for tensor in range(1, chips + 1):
        if chips % tensor or m.n_heads % tensor or m.d_ff % tensor:
            continue
        rest = chips // tensor
        for fsdp in range(1, rest + 1):
            if rest % fsdp == 0 and batch % rest == 0:
                out.append((rest // fsdp, fsdp, tensor))
    return out


def candidate(cfg: ExperimentConfig, mesh: tuple[int, int, int], remat: str) -> ExperimentConfig:
    data, fsdp, tensor = mesh
    return cfg.replace(
        mesh=cfg.mesh.replace(data=data, fsdp=fsdp, tensor=tensor),
        model=cfg.model.replace(remat=remat),
    )


def search(
    cfg: ExperimentConfig, topology: str, remats: tuple[str, ...] = REMATS
) -> dict[str, Any]:
    """Every candidate plan of `cfg` on `topology`: {"ranked": plans with a roofline, fastest
    first; "pruned": the others, each with why; "winner": the config lines of the fastest}."""
    from scalestudy.train.aot import compile_plan, resolve_topology

    chips = resolve_topology(topology)[1]
    meshes = factorisations(chips, cfg)
    if not meshes:
        raise ConfigError(
            f"compile --search: no data x fsdp x tensor of {chips} chips divides the batch "
            f"({cfg.train.batch_size}), the heads ({cfg.model.n_heads}) and d_ff "
            f"({cfg.model.d_ff}); change train.batch_size"
        )
    ranked, pruned = [], []
    for mesh in meshes:
        for remat in remats:
            trial = candidate(cfg, mesh, remat)
            row = {"mesh": "x".join(map(str, mesh)), "remat": remat}
            memory = compile_plan(trial, topology=topology, costs=False)
            row["total_gib_per_chip"] = memory.get("total_gib_per_chip")
            if not memory.get("fits", False):
                why = memory.get("compiler") or (
                    f"{memory.get('total_gib_per_chip')} GiB per chip > "
                    f"{memory.get('hbm_gib_per_chip')} GiB HBM"
                )
                pruned.append({**row, "why": why})
                continue
            full = compile_plan(trial, topology=topology, costs=True)
            roof = full.get("roofline") or {}
            if "est_step_s" not in roof:
                pruned.append({**row, "why": "no roofline for this chip"})
                continue
            ranked.append(
                {**row, "est_step_s": roof["est_step_s"], "est_mfu": roof["est_mfu"],
                 "bound": roof.get("bound")}
            )  # fmt: skip
    ranked.sort(key=lambda r: r["est_step_s"])
    winner = None
    if ranked:
        data, fsdp, tensor = (int(x) for x in ranked[0]["mesh"].split("x"))
        winner = [
            f"mesh: {{data: {data}, fsdp: {fsdp}, tensor: {tensor}}}",
            f"model: {{remat: {ranked[0]['remat']}}}",
        ]
    return {"topology": topology, "chips": chips, "ranked": ranked, "pruned": pruned,
            "winner": winner}  # fmt: skip


def main(cfg: ExperimentConfig, topology: str | None, as_json: bool) -> int:
    """`compile --search`: print the search's table (or JSON)."""
    if not topology:
        raise ConfigError("compile --search plans a TPU slice: give --topology too (e.g. v5e-8)")
    found = search(cfg, topology)
    print(json.dumps(found, indent=2) if as_json else render(found))
    return 0


def render(result: dict[str, Any]) -> str:
    """The ranked table, the pruned candidates and the winner's config lines."""
    lines = [
        f"plans on {result['topology']} ({result['chips']} chips), fastest first "
        "(roofline estimate):",
        f"{'data x fsdp x tensor':>22} {'remat':>16} {'GiB/chip':>9} {'step s':>10} "
        f"{'MFU':>7}  bound",
    ]
    for r in result["ranked"]:
        lines.append(
            f"{r['mesh']:>22} {r['remat']:>16} {r['total_gib_per_chip']:>9} "
            f"{r['est_step_s']:>10.4g} {r['est_mfu']:>7.3f}  {r['bound']}"
        )
    if result["pruned"]:
        lines += ["pruned (do not fit or refused):"]
        lines += [f"{r['mesh']:>22} {r['remat']:>16}  {r['why']}" for r in result["pruned"]]
    if result["winner"]:
        lines += ["winner's config lines:", *(f"  {x}" for x in result["winner"])]
    else:
        lines += ["no candidate fits: lower train.batch_size or use a larger slice"]
    return "\n".join(lines)
