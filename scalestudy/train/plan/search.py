"""`scalestudy compile --topology T --search`: the mesh and remat policy a TPU slice should use.

Candidates: every factorisation of the slice's chips into data x fsdp x tensor (x expert, for
a mixture-of-experts model) whose tensor size divides the heads and the MLP widths, whose
expert size divides the routed experts and whose data x fsdp x expert divides the batch, times
the remat policies `REMATS`. Pruning, cheapest test first:

1. a mesh whose parameters and optimizer state alone overflow a chip's HBM (exact, from the
   state's shapes and shardings: nothing compiled) loses every remat policy;
2. each remat policy of a mesh is compiled for memory, leanest first (`LEANEST_FIRST`): once
   one does not fit (or the compiler refuses it), the policies that keep more activations
   are pruned uncompiled. This assumes remat never adds memory, true where activations
   dominate (the 1B decoder on v5e-8: docs/performance.md#tpu-plans-that-search) but not for
   toy models, where recomputation's own buffers can outweigh the saving;
3. a program that fits gets the roofline (`train/plan/roofline.py`: compute, HBM and ICI times
   from the compiled program's costs) from the same compile.

The rest are ranked by the roofline's estimated step time, fastest first, and the winner's
config lines are printed to paste into an experiment YAML.

A search can be narrowed where compiles are slow (an 11B model's plan compiles in minutes on a
CPU host): a mesh axis or the remat policy given on the command line (`mesh.data=1`,
`model.remat=save_attention`) is held at that value and only the rest are searched.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import ExperimentConfig

REMATS = ("none", "save_attention", "minimal", "full")
# The remat policies by the activations they keep for the backward pass, fewest first.
LEANEST_FIRST = ("full", "minimal", "save_attention", "none")
AXES = ("data", "fsdp", "expert", "tensor")


def held(cfg: ExperimentConfig, overrides: list[str] | None) -> tuple[dict[str, int], tuple]:
    """The mesh axes and remat policy that command-line overrides set, at their values in
    `cfg` (loaded, so parsed and checked, with those overrides): ({axis: size}, the policies
    left to try)."""
    keys = {item.partition("=")[0].strip() for item in overrides or []}
    axes = {a: getattr(cfg.mesh, a) for a in AXES if f"mesh.{a}" in keys}
    return axes, (cfg.model.remat,) if "model.remat" in keys else REMATS


def factorisations(
    chips: int, cfg: ExperimentConfig, fixed: dict[str, int] | None = None
) -> list[tuple[int, int, int, int]]:
    """(data, fsdp, expert, tensor) with a product of `chips` that the model and batch allow:
    tensor divides the heads, d_ff (and the experts' width), expert divides the routed
    experts (1 for a dense model), data x fsdp x expert divides the batch; with `fixed`,
    only those whose named axes have the given sizes."""
    m, batch = cfg.model, cfg.train.batch_size
    widths = (m.n_heads, m.d_ff) + ((m.moe.width(m.d_ff),) if m.moe.enabled else ())
    experts = m.moe.routed_experts if m.moe.enabled else 1
    out = []
    for tensor in range(1, chips + 1):
        if chips % tensor or any(w % tensor for w in widths):
            continue
        per = chips // tensor
        for expert in range(1, per + 1):
            if per % expert or experts % expert or batch % per:
                continue
            rest = per // expert
            out += [
                (rest // fsdp, fsdp, expert, tensor)
                for fsdp in range(1, rest + 1)
                if rest % fsdp == 0
            ]
    fixed = fixed or {}
    return [
        m for m in out if all(dict(zip(AXES, m, strict=True))[a] == n for a, n in fixed.items())
    ]


def label(mesh: tuple[int, ...], cfg: ExperimentConfig) -> str:
    """ "data x fsdp x tensor" sizes, with expert before tensor for an MoE model."""
    data, fsdp, expert, tensor = mesh
    return "x".join(
        map(str, (data, fsdp, expert, tensor) if cfg.model.moe.enabled else (data, fsdp, tensor))
    )


def candidate(cfg: ExperimentConfig, mesh: tuple[int, ...], remat: str) -> ExperimentConfig:
    sizes = dict(zip(AXES, mesh, strict=True))
    return cfg.replace(mesh=cfg.mesh.replace(**sizes), model=cfg.model.replace(remat=remat))


def _progress(n: int, row: dict[str, Any], plan: dict[str, Any]) -> None:
    """One line on stderr per compiled candidate: a search of a large model runs for hours,
    and what it has found is kept in the log if it is stopped."""
    roof = plan.get("roofline") or {}
    found = (
        f"est. step {roof['est_step_s']:.4g} s, MFU {roof['est_mfu']:.3f}, {roof.get('bound')}"
        if "est_step_s" in roof
        else plan.get("compiler") or "does not fit"
    )
    print(
        f"search [{n}] {row['mesh']} remat {row['remat']}: "
        f"{plan.get('total_gib_per_chip')} GiB per chip; {found}",
        file=sys.stderr,
        flush=True,
    )


def search(
    cfg: ExperimentConfig,
    topology: str,
    remats: tuple[str, ...] = REMATS,
    fixed: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Every candidate plan of `cfg` on `topology` (the meshes whose axes in `fixed` have
    those sizes): {"ranked": plans with a roofline, fastest first; "pruned": the others, each
    with why; "winner": the config lines of the fastest; "compiles": programs compiled for it
    (their cost probes aside)}."""
    from scalestudy.train.plan.aot import resolve_topology, state_plan

    chips = resolve_topology(topology)[1]
    meshes = factorisations(chips, cfg, fixed)
    if not meshes:
        held_text = "".join(f", mesh.{a}={n} held" for a, n in (fixed or {}).items())
        raise ConfigError(
            f"compile --search: no data x fsdp x tensor of {chips} chips divides the batch "
            f"({cfg.train.batch_size}), the heads ({cfg.model.n_heads}) and d_ff "
            f"({cfg.model.d_ff}){held_text}; change train.batch_size or the held axes"
        )
    ranked, pruned, compiles = [], [], 0
    order = sorted(remats, key=LEANEST_FIRST.index)
    for mesh in meshes:
        rows = [{"mesh": label(mesh, cfg), "remat": remat} for remat in order]
        state, hbm = state_plan(candidate(cfg, mesh, order[0]), topology)
        if hbm is not None and state > hbm:
            why = f"state alone {state / 2**30:.3g} GiB per chip > {hbm / 2**30:.3g} GiB HBM"
            pruned += [{**row, "why": why} for row in rows]
            continue
        compiles = _compile_mesh(cfg, topology, mesh, rows, ranked, pruned, compiles)
    ranked.sort(key=lambda r: r["est_step_s"])
    return {
        "topology": topology,
        "chips": chips,
        "ranked": ranked,
        "pruned": pruned,
        "winner": _winner(ranked),
        "compiles": compiles,
    }


def _compile_mesh(
    cfg: ExperimentConfig,
    topology: str,
    mesh: tuple[int, ...],
    rows: list[dict[str, Any]],
    ranked: list[dict[str, Any]],
    pruned: list[dict[str, Any]],
    compiles: int,
) -> int:
    """Compile `mesh`'s candidates, leanest remat first, adding each to `ranked` or `pruned`
    (in place); returns the count of programs compiled so far."""
    from scalestudy.train.plan.aot import compile_plan

    too_big = None
    for row in rows:
        # Remats in leanest-first order: past one that does not fit, none fits.
        if too_big is not None:
            pruned.append({**row, "why": f"keeps more than remat {too_big}, which does not fit"})
            continue
        plan = compile_plan(candidate(cfg, mesh, row["remat"]), topology, costs="fits")
        compiles += 1
        row["total_gib_per_chip"] = plan.get("total_gib_per_chip")
        _progress(compiles, row, plan)
        if not plan.get("fits", False):
            too_big = row["remat"]
            why = plan.get("compiler") or (
                f"{plan.get('total_gib_per_chip')} GiB per chip > "
                f"{plan.get('hbm_gib_per_chip')} GiB HBM"
            )
            pruned.append({**row, "why": why})
            continue
        roof = plan.get("roofline") or {}
        if "est_step_s" not in roof:
            pruned.append({**row, "why": "no roofline for this chip"})
            continue
        ranked.append(
            {
                **row,
                "est_step_s": roof["est_step_s"],
                "est_mfu": roof["est_mfu"],
                "bound": roof.get("bound"),
                "sizes": dict(zip(AXES, mesh, strict=True)),
                **{k: roof.get(k) for k in ("compute_s", "memory_s", "communication_s")},
            }
        )
    return compiles


def _winner(ranked: list[dict[str, Any]]) -> list[str] | None:
    """The config lines of the fastest plan (`ranked` sorted), or None without one."""
    if not ranked:
        return None
    sizes = {a: n for a, n in ranked[0]["sizes"].items() if a != "expert" or n > 1}
    return [
        "mesh: {" + ", ".join(f"{a}: {n}" for a, n in sizes.items()) + "}",
        f"model: {{remat: {ranked[0]['remat']}}}",
    ]


def main(
    cfg: ExperimentConfig, topology: str | None, as_json: bool, overrides: list[str] | None = None
) -> int:
    """`compile --search`: print the search's table (or JSON); the mesh axes and remat policy
    that `overrides` set are held."""
    if not topology:
        raise ConfigError("compile --search plans a TPU slice: give --topology too (e.g. v5e-8)")
    fixed, remats = held(cfg, overrides)
    found = search(cfg, topology, remats, fixed)
    print(json.dumps(found, indent=2) if as_json else render(found, cfg))
    return 0


def render(result: dict[str, Any], cfg: ExperimentConfig) -> str:
    """The ranked table, the pruned candidates and the winner's config lines."""
    axes = "data x fsdp x expert x tensor" if cfg.model.moe.enabled else "data x fsdp x tensor"
    width = len(axes)
    lines = [
        f"plans on {result['topology']} ({result['chips']} chips), fastest first "
        f"(roofline estimate; {result['compiles']} programs compiled):",
        f"{axes:>{width}} {'remat':>16} {'GiB/chip':>9} {'step s':>10} {'MFU':>7}  "
        f"{'compute':>9} {'memory':>9} {'comm':>9}  bound",
    ]
    for r in result["ranked"]:
        terms = " ".join(
            f"{r.get(k) if r.get(k) is not None else '-':>9}"
            for k in ("compute_s", "memory_s", "communication_s")
        )
        lines.append(
            f"{r['mesh']:>{width}} {r['remat']:>16} {r['total_gib_per_chip']:>9} "
            f"{r['est_step_s']:>10.4g} {r['est_mfu']:>7.3f}  {terms}  {r['bound']}"
        )
    if result["pruned"]:
        lines += ["pruned (do not fit or refused):"]
        lines += [f"{r['mesh']:>{width}} {r['remat']:>16}  {r['why']}" for r in result["pruned"]]
    if result["winner"]:
        lines += ["winner's config lines:", *(f"  {x}" for x in result["winner"])]
    else:
        lines += ["no candidate fits: lower train.batch_size or use a larger slice"]
    return "\n".join(lines)
