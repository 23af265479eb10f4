"""A run's recipe: the config keys of how it was trained, which a comparison between cells
names when they differ (study/report/comparisons.py), so that a cell trained with its own learning
rate, batch, lengths or model settings is never compared as if it were not."""

from __future__ import annotations

from typing import Any

from scalestudy.config.yamlio import flatten

# Config keys that are a cell's recipe (how it is trained), compared between the runs of a
# comparison: the optimizer and schedule, the batch, the objective's lengths and rates, the
# model's settings other than its shape (which the ladder and the matching mode set), the
# data. Not the architecture or objective (the comparison itself), seeds, steps (set by a
# budget), cadence or implementation choices (scan, remat, attention kernels).
_RECIPE = ("optim.", "train.batch_size", "train.microbatches", "train.z_loss", "objective.")
_RECIPE += ("model.", "data.")
_NOT_RECIPE = {"objective.name", "data.seed", "model.arch", "model.d_model", "model.n_layers"}
_NOT_RECIPE |= {"model.n_encoder_layers", "model.n_heads", "model.d_kv", "model.d_ff"}
_NOT_RECIPE |= {"model.scan_layers", "model.remat", "model.attention_impl"}


def recipe(config_yaml: str | None) -> dict[str, Any]:
    """{dotted key: value} of a run's recipe keys, from its resolved config (YAML text)."""
    import yaml

    flat = flatten(yaml.safe_load(config_yaml or "") or {})
    return {
        k: v
        for k, v in flat.items()
        if k.startswith(_RECIPE) and k not in _NOT_RECIPE and not k.startswith("model.remat")
    }


def recipe_differences(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[str]:
    """'recipe: key value vs value' for each recipe key the runs of `a` and `b` do not share
    (a key one side lacks counts as its default, shown as `default`)."""
    ra = [r["recipe"] for r in a if r.get("recipe") is not None]
    rb = [r["recipe"] for r in b if r.get("recipe") is not None]
    if not ra or not rb:
        return []
    out = []
    for key in sorted(set().union(*ra, *rb)):
        va = {repr(r.get(key, "default")) for r in ra}
        vb = {repr(r.get(key, "default")) for r in rb}
        if va != vb:
            out.append(f"recipe: {key} {'/'.join(sorted(va))} vs {'/'.join(sorted(vb))}")
    return out
