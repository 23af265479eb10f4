"""The attention-rank section of the decoder-only report: the tables (entropy beside every
rank figure), each bidirectional block's deficit against random QK at matched entropy, and
the verdict, which is the argument's own prediction (an interaction of the mask with d_kv
relative to n) or, without blocks on both sides of d_kv = n, no verdict."""

from __future__ import annotations

import functools
import math
from collections import defaultdict

from scalestudy.decoder_only import attention_rank, stats
from scalestudy.scaling import render

FLOAT32_TOLERANCE = "rtol = n x float32 eps (n the block size; NumPy's matrix_rank rule)"


def figure_lines(figures: dict[str, list[str]], key: str) -> list[str]:
    """Markdown image lines of the figures under `key` (and a blank line after any)."""
    return [f"![{key}]({f})" for f in figures.get(key, [])] + ([""] if figures.get(key) else [])


def _kind(group: str, region: str) -> str:
    """Whether a measured region's attention is bidirectional or causal."""
    if region == "encoder" or (region == "prefix" and group.startswith("noncausal_decoder")):
        return "bidirectional"
    return "causal"


def _seed_layer_means(rows: list[dict], key: str) -> dict[int, float]:
    """Per seed, the mean over layers of `key` at that seed's last kept step."""
    last = {}
    for r in rows:
        last[r["seed"]] = max(last.get(r["seed"], r["step"]), r["step"])
    out: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        if r["step"] == last[r["seed"]]:
            out[r["seed"]].append(r[key])
    return {s: sum(v) / len(v) for s, v in out.items()}


INTERACTION = "effective rank / n deficit beyond random QK at matched entropy"


def _reference(rank: dict[str, list[dict]], group: str) -> str | None:
    """The causal decoder group a bidirectional block is compared with: the same variant
    (e.g. the same head width) when it was measured, else the first causal decoder group."""
    variant = group.split("/", 2)[2:]  # arch/objective/variant
    causal = [g for g in rank if g.startswith("causal_decoder")]
    same = [g for g in causal if g.split("/", 2)[2:] == variant]
    return (same or causal or [None])[0]


def rank_deficits(rank: dict[str, list[dict]]) -> list[dict]:
    """Per bidirectional block and seed (final kept step, mean over layers): its effective
    rank / n minus the causal prefix block's of the same variant (`measured`), the same
    difference for random queries and keys of the same n and d_kv at each block's measured
    attention entropy (`baseline`, `attention_rank.random_qk_eff_rank`), and `excess` =
    measured - baseline; with d_kv, n and both entropies."""
    out = []
    for group, rows in rank.items():
        ref = _reference(rank, group)
        if ref is None:
            continue
        ref_rows = [r for r in rank[ref] if r["region"] == "prefix"]
        for region in sorted({r["region"] for r in rows}):
            if _kind(group, region) != "bidirectional":
                continue
            mine = [r for r in rows if r["region"] == region]
            eff_b, eff_c = (_seed_layer_means(x, "eff_rank_rel") for x in (mine, ref_rows))
            has_entropy = all("entropy" in r for r in (*mine, *ref_rows))
            ent_b = _seed_layer_means(mine, "entropy") if has_entropy else {}
            ent_c = _seed_layer_means(ref_rows, "entropy") if has_entropy else {}
            d_kv, n = int(mine[0]["head_dim"]), round(_mean(mine, "length"))
            n_c = round(_mean(ref_rows, "length"))
            for seed in sorted(set(eff_b) & set(eff_c)):
                measured = eff_b[seed] - eff_c[seed]
                baseline = None
                if seed in ent_b and seed in ent_c:
                    baseline = attention_rank.random_qk_eff_rank(
                        n, d_kv, ent_b[seed], causal=False, seed=seed
                    ) - attention_rank.random_qk_eff_rank(
                        n_c, d_kv, ent_c[seed], causal=True, seed=seed
                    )
                out.append(
                    {
                        "group": f"{group} ({region})",
                        "ref": f"{ref} (prefix)",
                        "seed": seed,
                        "d_kv": d_kv,
                        "n": n,
                        "entropy": ent_b.get(seed),
                        "ref_entropy": ent_c.get(seed),
                        "measured": measured,
                        "baseline": baseline,
                        "excess": None if baseline is None else measured - baseline,
                    }
                )
    return out


def rank_tests(rank: dict[str, list[dict]]) -> list[stats.PairedTest]:
    """The low-rank argument's own prediction, tested: an interaction of the mask with the
    head width relative to the length. Below d_kv = n a bidirectional softmax matrix can lose
    rank, at or above it the argument gives no reason to, so the deficit beyond random QK at
    matched entropy should be larger (more negative) where d_kv < n. One paired test over
    seeds (each seed's mean excess over its d_kv < n blocks minus over its d_kv >= n blocks);
    none, and so no verdict, unless both kinds of block were measured."""
    rows = [r for r in rank_deficits(rank) if r["excess"] is not None]
    small = [(r["seed"], r["excess"]) for r in rows if r["d_kv"] < r["n"]]
    large = [(r["seed"], r["excess"]) for r in rows if r["d_kv"] >= r["n"]]
    if not small or not large:
        return []

    def per_seed(xs: list[tuple[int, float]]) -> dict[int, float]:
        by: dict[int, list[float]] = defaultdict(list)
        for seed, excess in xs:
            by[seed].append(excess)
        return {s: sum(v) / len(v) for s, v in by.items()}

    est = stats.seed_difference(per_seed(small), per_seed(large))
    return [
        stats.PairedTest("blocks with d_kv < n", "blocks with d_kv >= n", INTERACTION, None, est)
    ]


def deficit_table(rank: dict[str, list[dict]]) -> list[str]:
    """Each bidirectional block's deficit against its causal reference, measured and for
    random QK at the measured entropies, means over seeds."""
    rows = rank_deficits(rank)
    if not rows:
        return []
    by: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by[r["group"]].append(r)
    head = ["block", "vs", "d_kv / n", "entropy (nats)", "reference entropy"]
    head += ["deficit, measured", "random QK at these entropies", "excess", "seeds"]
    out = []

    def fmt(xs: list, spec: str = "+.3f") -> str:
        xs = [x for x in xs if x is not None]
        return format(sum(xs) / len(xs), spec) if xs else "-"

    for group, rs in by.items():
        out.append(
            [
                group,
                rs[0]["ref"],
                f"{rs[0]['d_kv']} / {rs[0]['n']}",
                fmt([r["entropy"] for r in rs], ".2f"),
                fmt([r["ref_entropy"] for r in rs], ".2f"),
                _t_cell([r["measured"] for r in rs]),
                fmt([r["baseline"] for r in rs]),
                _t_cell([r["excess"] for r in rs if r["excess"] is not None]),
                len(rs),
            ]
        )
    return render.table(head, out)


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def _t_cell(xs: list[float]) -> str:
    if not xs:
        return "-"
    mean = sum(xs) / len(xs)
    if len(xs) < 2:
        return f"{mean:.3f}"
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    return f"{mean:.3f} ± {stats.t95(len(xs) - 1) * sd / math.sqrt(len(xs)):.3f}"


def rank_section(number: int, results: dict, figures: dict, verdicts: list[str]) -> list[str]:
    rank = results["rank"]
    seeds = sorted({r["seed"] for rows in rank.values() for r in rows})
    lines = _rank_intro(number)
    if len(seeds) < 2:
        lines += [
            f"**One seed ({seeds[0] if seeds else '-'}).** Intervals over heads, layers or "
            "examples are not between-run intervals, so none is given: train at least three "
            "seeds (`seeds=[0,1,2]`).",
            "",
        ]
    lines += _final_rank_table(rank)
    lines += _rank_over_training(rank)
    lines += ["", *figure_lines(figures, "rank")]
    lines += _rank_verdict(rank, verdicts)
    return lines


def _rank_intro(number: int) -> list[str]:
    """The section's title and what it measures."""
    tolerances = ", ".join(f"full@{k}: rtol {k}" for k in attention_rank.TOLERANCES)
    lines = [
        f"## {number}. Attention rank over training",
        "",
        "The argument: a causal attention matrix is lower-triangular with a positive diagonal, "
        "so it is exactly full rank; a bidirectional n x n softmax matrix built from n x d_kv "
        "queries and keys can lose rank. Measured per architecture, region and layer (never "
        "pooled across architectures) on every kept checkpoint of every seed, averaged over "
        "heads and validation examples: for decoder-only models the block of the input "
        "(prefix) positions, bidirectional in the non-causal decoder and causal in the causal "
        "one; for the encoder-decoder its encoder and decoder stacks. Columns: `exact` the "
        "fraction provably full rank (lower-triangular, positive diagonal); `full` numerical "
        f"rank = n at {FLOAT32_TOLERANCE} (a conditioning cut-off: an exactly invertible but "
        f"ill-conditioned matrix fails it) and at looser tolerances ({tolerances}); effective "
        "rank (entropy of the normalised singular values) and stable rank (||A||_F^2 / "
        "||A||_2^2), both over n, with 95% t-intervals over seeds; log10 condition number; "
        "`states` the effective rank of the residual stream entering the layer over min(n, D) "
        "(rank collapse with depth).",
        "",
    ]
    return lines


def _final_rank_table(rank: dict[str, list[dict]]) -> list[str]:
    """Per group, region and layer: the rank measures at each seed's last step."""
    tol_cols = [f"full@{k}" for k in attention_rank.TOLERANCES]
    head = ["group", "region", "kind", "d_kv / n", "layer", "seeds", "exact", "full", *tol_cols]
    head += ["eff. rank / n", "stable rank / n", "entropy", "log10 cond", "states"]
    lines = []
    for group, rows in rank.items():
        for region in sorted({r["region"] for r in rows}):
            mine = [r for r in rows if r["region"] == region]
            last = {
                s: max(r["step"] for r in mine if r["seed"] == s) for s in {r["seed"] for r in mine}
            }
            final = [r for r in mine if r["step"] == last[r["seed"]]]
            for layer in sorted({r["layer"] for r in final}):
                at = [r for r in final if r["layer"] == layer]
                mean = functools.partial(_mean, at)
                lines.append(
                    [
                        group,
                        region,
                        _kind(group, region),
                        f"{at[0]['head_dim']} / {mean('length'):.0f}",
                        layer,
                        len(at),
                        f"{mean('exact_full'):.3f}",
                        f"{mean('full'):.3f}",
                        *(f"{mean(c):.3f}" for c in tol_cols),
                        _t_cell([r["eff_rank_rel"] for r in at]),
                        _t_cell([r["stable_rank_rel"] for r in at]),
                        _entropy(at),
                        f"{mean('log10_cond'):.1f}",
                        f"{mean('hidden_eff_rank_rel'):.3f}",
                    ]
                )
    return render.table(head, lines)


def _rank_over_training(rank: dict[str, list[dict]]) -> list[str]:
    """Per group, region and step: the rank measures' means over layers and seeds."""
    lines = [
        "",
        "Over training (means over layers and seeds):",
        "",
    ]
    head = ["group", "region", "step", "exact", "full", "eff. rank / n", "stable rank / n"]
    head.append("entropy")
    body = []
    for group, rows in rank.items():
        by: dict[tuple, list[dict]] = defaultdict(list)
        for r in rows:
            by[r["region"], r["step"]].append(r)
        for (region, step), at in sorted(by.items()):
            mean = functools.partial(_mean, at)
            body.append(
                [
                    group,
                    region,
                    step,
                    f"{mean('exact_full'):.3f}",
                    f"{mean('full'):.3f}",
                    f"{mean('eff_rank_rel'):.3f}",
                    f"{mean('stable_rank_rel'):.3f}",
                    _entropy(at),
                ]
            )
    return lines + render.table(head, body)


def _rank_verdict(rank: dict[str, list[dict]], verdicts: list[str]) -> list[str]:
    """The deficits against random queries and keys, then the verdict or why there is none."""
    lines: list[str] = []
    table = deficit_table(rank)
    if table:
        lines += [
            "Each bidirectional block against the causal prefix block of the same variant "
            "(effective rank / n, final step, mean over layers; 95% t-intervals over seeds). "
            "Random QK: Gaussian queries and keys of the same n and d_kv, softmax temperature "
            "set so each block's mean row entropy is the measured one (causal rows masked), "
            "no training: how much of a deficit the shape and the diffuseness alone give.",
            "",
            *table,
            "",
        ]
    if verdicts:
        lines += [
            "**Verdict** (the argument's own prediction: the deficit beyond random QK is "
            "larger where d_kv < n than where d_kv >= n). " + " ".join(verdicts),
            "",
        ]
    else:
        widths = sorted({(r["d_kv"], r["n"]) for r in rank_deficits(rank)})
        said = ", ".join(f"d_kv {d} / n {n}" for d, n in widths) or "no bidirectional block"
        lines += [
            "**No verdict.** The low-rank argument predicts an interaction: a bidirectional "
            "deficit where d_kv < n that vanishes where d_kv >= n, beyond what random queries "
            "and keys give at the same attention entropy. Testing it needs blocks on both "
            f"sides of d_kv = n (with entropy measured); this study has {said}.",
            "",
        ]
    return lines


def _entropy(rows: list[dict]) -> str:
    """Mean attention row entropy (nats) of rows measured with it, else "-"."""
    xs = [r["entropy"] for r in rows if r.get("entropy") is not None]
    return f"{sum(xs) / len(xs):.2f}" if xs else "-"
