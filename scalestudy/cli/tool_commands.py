"""The tool commands' handlers: `bench` (data, train, members, eval, peer, gpu) and `compile`
(ahead-of-time plans, TPU plan search). As `cli/commands.py`: one handler per subcommand,
heavy modules imported inside."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from scalestudy.cli import args as cli_args
from scalestudy.cli.commands import print_dict
from scalestudy.config.errors import ScalestudyError
from scalestudy.config.experiment import load_config


def cmd_bench(args: argparse.Namespace) -> int:
    if args.config and args.preset:
        raise ScalestudyError(
            f"--config and --preset {args.preset} exclude each other: --config gives the whole "
            "shape, --preset a built-in one; give one"
        )
    args.preset = args.preset or "small"
    if args.profile is not None:  # the traces' folder, checked before the benchmark runs
        cli_args.output_dir(args.profile, "--profile")
    if args.what == "gpu":
        from scalestudy.bench.gpu import main as bench_gpu

        return bench_gpu(args.out, args.budget, args.only)
    if args.what == "train":
        return _bench_train(args)
    if args.what == "peer":
        from scalestudy.bench.peer import PEER_SHAPE, bench_peer
        from scalestudy.bench.train import preset_config

        overrides = (*PEER_SHAPE, *args.overrides)
        if args.config:
            cfg = load_config(args.config, overrides)
        else:
            cfg = preset_config(args.preset, args.seq, overrides)
        out = bench_peer(cfg, steps=args.steps, which=args.peer, profile_dir=args.profile)
        profile = out.pop("profile_ms_per_step", None) if not args.json else None
        print_dict(out, args.json)
        for kind, sides in (profile or {}).items():  # ms per step of each side, by kind
            print(f"{kind:<48}" + "".join(f"  {side} {ms:>10}" for side, ms in sides.items()))
        return 0
    if args.what == "data":
        from scalestudy.bench.data import bench as bench_fn
    else:
        from scalestudy.bench.eval import bench as bench_fn
    cfg = load_config(args.config, args.overrides) if args.config or args.overrides else None
    print_dict(bench_fn(cfg, steps=args.steps), args.json)
    return 0


def _bench_train(args: argparse.Namespace) -> int:
    from scalestudy.bench.train import bench, preset_config

    if args.config:
        cfg = load_config(args.config, args.overrides)
    else:
        cfg = preset_config(args.preset, args.seq, tuple(args.overrides))
    archs = tuple(args.arch.split(",")) if args.arch else None
    if args.members is not None:
        return _bench_members(args, cfg, archs)
    result = bench(cfg, steps=args.steps, archs=archs)
    if args.json:
        print_dict(result, True)
        return 0
    rows = {k: v for k, v in result.items() if isinstance(v, dict)}  # one per architecture
    print_dict({k: v for k, v in result.items() if not isinstance(v, dict)}, False)
    cols = list(next(iter(rows.values())))
    print("\n" + "  ".join(f"{c:>17}" for c in ["arch", *cols]))
    for arch, row in rows.items():
        print("  ".join(f"{v!s:>17}" for v in [arch, *row.values()]))
    return 0


def _bench_members(args: argparse.Namespace, cfg: Any, archs: tuple | None) -> int:
    from scalestudy.bench.cells import cells
    from scalestudy.bench.members_cost import bench

    if archs is None or len(archs) != 1:
        raise ScalestudyError(
            "bench train --members: give one architecture with --arch (e.g. --arch "
            "causal_decoder): the whole-run comparison trains K runs each way"
        )
    (_, _, cell), *_ = cells(cfg, archs=archs, one_per_arch=True)
    result = bench(cell, args.members, args.steps, whole_runs=not args.steps_only)
    if args.json:
        print_dict(result, True)
        return 0
    curve = result.pop("curve")
    print_dict(result, False)
    cols = list(curve[0])
    print("\n" + "  ".join(f"{c:>22}" for c in cols))
    for row in curve:
        print("  ".join(f"{v!s:>22}" for v in row.values()))
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    if args.topology:  # the TPU compiler needs no local TPU: keep JAX off any TPU runtime
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from scalestudy.train.plan.aot import compile_plan

    if (args.config is None) == (args.spec is None):
        raise ScalestudyError("compile: give --config FILE (one run) or --spec STUDY (every shape)")
    if args.spec is not None:
        cli_args.checked_path(args.spec, "--spec", "a YAML file", must_exist=True)
    from scalestudy.train.members import check_count

    check_count(args.members, "compile --members")
    if args.members > 1 and (args.spec or args.search):
        raise ScalestudyError(
            f"compile --members {args.members} plans one group of --config's shape; it does not "
            f"combine with {'--spec' if args.spec else '--search'}: give --config FILE alone"
        )
    if args.spec:  # every shape of the study: pretraining and the stages after it
        from scalestudy.study.run.compile_plan import compile_study

        plans = compile_study(args.spec, args.overrides, args.topology, not args.memory_only)
        if args.json:
            print(json.dumps(plans, indent=2, default=str))
        for plan in [] if args.json else plans:
            print_dict(plan, False)
            print()
        return 0
    cfg = load_config(args.config, args.overrides)
    if args.search:  # every mesh and remat policy of the slice, ranked
        from scalestudy.train.plan.search import main as search

        return search(cfg, args.topology, args.json, args.overrides)
    plan = compile_plan(
        cfg, topology=args.topology, costs=not args.memory_only, members=args.members
    )
    print_dict(plan, args.json)
    return 0
