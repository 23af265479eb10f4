"""Which experts the tokens of a mixture-of-experts run go to (`scalestudy experts`).

A checkpoint's model reads evaluation text, the validation split of the run's own source cut
into domains (`data.sources.labelled_documents`: the synthetic corpus's episode kinds, a
text source's files), laid out as the architecture reads text (`data.pipeline.reading_batch`).
Each MoE layer's router choices are counted. The unit is the assignment: a position that reads
a text token and chooses K routed experts makes K assignments (the router's choices: those a
capacity dispatch would drop are counted too). Per layer (`count_layer`):

- "domains": per domain, the share of its assignments each expert received (rows sum to 1);
- "experts": per expert, its share of all assignments and the tokens it is given most: each
  token's share of that expert's assignments, and its lift (that share over the token's share
  of all assignments; above 1: the expert prefers it);
- "tokens": for given strings, the share of their assignments each expert received; a string
  of several tokens (" the" is 4 bytes) counts at its last token, where all of it was read;
- "mi_domain_bits", "mi_token_bits": the mutual information between the chosen expert and the
  domain, or the token read (0: routing ignores it);
- "training": load balance over training from metrics.jsonl (`moe/<layer>/...`: the busiest
  expert's load over the mean, dropped share, the balancing biases' range), where logged.

Figures (`expert_plots.py`) and `experts.json` with every number behind them go to
`<workdir>/experts/` or `--out`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from scalestudy.config.errors import ScalestudyError

DEFAULT_TOKENS = (".", ",", " the", " and")
DEFAULT_ROWS = 64
DEFAULT_TOP = 6
ROWS_PER_CALL = 8
TRAINING_METRICS = ("load_max", "dropped", "entropy", "bias_min", "bias_max")


class ExpertsError(ScalestudyError):
    """The run or the request cannot give expert pictures."""


# ----------------------------------------------------------------------------- counting


def _mutual_information(joint: np.ndarray) -> float:
    """I(row; column) in bits of a table of counts."""
    total = joint.sum()
    if total <= 0:
        return 0.0
    p = joint / total
    outer = p.sum(axis=1, keepdims=True) * p.sum(axis=0, keepdims=True)
    nz = p > 0
    return float(np.sum(p[nz] * np.log2(p[nz] / outer[nz])))


def _share(counts: np.ndarray) -> list[float] | None:
    total = counts.sum()
    return None if total == 0 else (counts / total).tolist()


def string_ends(tokens_RL: np.ndarray, read_RL: np.ndarray, ids: Sequence[int]) -> np.ndarray:
    """Positions [R, L] that read the last token of `ids` right after the others (in the same
    row, every one of them read text)."""
    n, length = len(ids), tokens_RL.shape[1]
    hit = read_RL.copy()
    for j, token in enumerate(reversed(ids)):  # j tokens before the end
        shifted_tok = np.zeros_like(tokens_RL)
        shifted_read = np.zeros_like(read_RL)
        shifted_tok[:, j:] = tokens_RL[:, : length - j]
        shifted_read[:, j:] = read_RL[:, : length - j]
        hit &= (shifted_tok == token) & shifted_read
    if n > length:
        hit[:] = False
    return hit


def _top_tokens(
    by_token: np.ndarray, load: np.ndarray, token_share: np.ndarray, decode: Any, top: int
) -> list[dict[str, Any]]:
    """Per expert: its assignments and the `top` tokens it is chosen for most, each with its
    lift (the token's share of the expert over its share of all reads)."""
    experts = []
    for e in range(len(by_token)):
        n = int(load[e])
        order = sorted(np.flatnonzero(by_token[e]), key=lambda t: (-by_token[e, t], t))[:top]
        experts.append(
            {
                "expert": e,
                "assignments": n,
                "share": float(n / max(load.sum(), 1)),
                "top_tokens": [
                    {
                        "id": int(t),
                        "text": decode([int(t)]),
                        "count": int(by_token[e, t]),
                        "share": float(by_token[e, t] / n),
                        "lift": float(by_token[e, t] / n / token_share[t]),
                    }
                    for t in order
                ],
            }
        )
    return experts


def _string_counts(
    tokens_RL: np.ndarray,
    read_RL: np.ndarray,
    experts_RLK: np.ndarray,
    n_experts: int,
    strings: dict[str, list[int]],
) -> dict[str, Any]:
    """Per given string: the experts chosen where it ends (at its last token's position)."""
    given = {}
    for text, ids in strings.items():
        at_RL = string_ends(tokens_RL, read_RL, ids)
        counts = np.bincount(experts_RLK[at_RL].ravel(), minlength=n_experts)
        given[text] = {
            "ids": list(ids),
            "positions": int(at_RL.sum()),
            "counts": counts.tolist(),
            "share": _share(counts),
        }
    return given


def count_layer(
    tokens_RL: np.ndarray,
    labels_RL: np.ndarray,
    experts_RLK: np.ndarray,
    n_experts: int,
    domains: Sequence[str],
    strings: dict[str, list[int]],
    decode: Any,
    top: int = DEFAULT_TOP,
) -> dict[str, Any]:
    """The numbers of one layer's pictures from its router choices `experts_RLK` at the
    positions of rows R (`labels_RL`: 1 + the domain index of the token each position reads,
    0 where it reads none; `tokens_RL`: that token). `strings` maps each given string to its
    ids; `decode(ids) -> str`."""
    read_RL = labels_RL > 0
    k = experts_RLK.shape[-1]
    chosen_PK = experts_RLK[read_RL]
    token_P, domain_P = tokens_RL[read_RL], labels_RL[read_RL] - 1
    by_domain = np.zeros((len(domains), n_experts), np.int64)
    np.add.at(by_domain, (np.repeat(domain_P, k), chosen_PK.ravel()), 1)
    vocab = int(tokens_RL.max(initial=0)) + 1
    by_token = np.zeros((n_experts, vocab), np.int64)
    np.add.at(by_token, (chosen_PK.ravel(), np.repeat(token_P, k)), 1)
    load = by_domain.sum(axis=0)
    token_share = by_token.sum(axis=0) / max(load.sum(), 1)
    experts = _top_tokens(by_token, load, token_share, decode, top)
    given = _string_counts(tokens_RL, read_RL, experts_RLK, n_experts, strings)
    mean = load.mean() if load.size else 0.0
    return {
        "positions": int(read_RL.sum()),
        "assignments": int(load.sum()),
        "load": load.tolist(),
        "load_max": float(load.max() / mean) if mean > 0 else None,
        "domains": {
            name: {
                "positions": int((domain_P == d).sum()),
                "counts": by_domain[d].tolist(),
                "share": _share(by_domain[d]),
            }
            for d, name in enumerate(domains)
        },
        "experts": experts,
        "tokens": given,
        "mi_domain_bits": _mutual_information(by_domain),
        "mi_token_bits": _mutual_information(by_token.T),
    }


def training_curves(rows: list[dict[str, Any]], layer: str) -> dict[str, Any]:
    """Per logged training row, the layer's load-balance metrics (those logged)."""
    out: dict[str, Any] = {"logged": []}
    for name in TRAINING_METRICS:
        key = f"moe/{layer}/{name}"
        points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
        if points:
            out["logged"].append(name)
            out[name] = {"steps": [p[0] for p in points], "values": [p[1] for p in points]}
    return out


# ----------------------------------------------------------------------------- reading


def text_rows(
    cfg: Any, vocab: Any, rows: int
) -> tuple[list[np.ndarray], list[np.ndarray], list[str]]:
    """Up to `rows` rows of validation text for `reading_batch`: (token ids, domain labels
    (1 + index), domain names); documents are cut into consecutive rows."""
    from scalestudy.data import pipeline, sources

    width = pipeline.reading_length(cfg)
    domains: list[str] = []
    tokens_out, labels_out = [], []
    for doc in sources.labelled_documents(cfg.data, "validation"):
        ids, labels = [], []
        for i, (domain, text) in enumerate(doc):
            if domain not in domains:
                domains.append(domain)
            piece = vocab.encode(text if i == 0 else " " + text)
            ids += piece
            labels += [domains.index(domain) + 1] * len(piece)
        for start in range(0, len(ids), width):
            if len(ids) - start >= 2:
                tokens_out.append(np.asarray(ids[start : start + width], np.int32))
                labels_out.append(np.asarray(labels[start : start + width], np.int32))
            if len(tokens_out) == rows:
                break
        if len(tokens_out) == rows:
            break
    # Only the domains the rows hold, numbered in order of appearance.
    used = sorted(set(np.concatenate(labels_out).tolist())) if labels_out else []
    renumber = np.zeros(len(domains) + 1, np.int32)
    renumber[used] = np.arange(1, len(used) + 1)
    return tokens_out, [renumber[x] for x in labels_out], [domains[u - 1] for u in used]


def route_rows(
    cfg: Any, params: Any, tokens: list[np.ndarray], labels: list[np.ndarray]
) -> dict[str, dict[str, np.ndarray]]:
    """Per stack with MoE layers: "tokens" and "labels" [R, L] as its positions read them, and
    "experts" [MoE layers, R, L, K] (the router's choices)."""
    import jax

    from scalestudy.data.pipeline import reading_batch
    from scalestudy.models.api import build_model

    intermediates = jax.jit(build_model(cfg.model).intermediates)
    parts: dict[str, dict[str, list]] = {}
    for start in range(0, len(tokens), ROWS_PER_CALL):
        stop = start + ROWS_PER_CALL
        batch = reading_batch(cfg, tokens[start:stop])
        label_batch = reading_batch(cfg, labels[start:stop])
        inter = jax.device_get(intermediates(params, batch))
        for stack, got in inter.items():
            if "experts" not in got:
                continue
            part = parts.setdefault(stack, {"tokens": [], "labels": [], "experts": []})
            part["tokens"].append(batch[f"{stack}_input_tokens"])
            part["labels"].append(label_batch[f"{stack}_input_tokens"])
            part["experts"].append(np.asarray(got["experts"]))
    return {
        stack: {
            "tokens": np.concatenate(p["tokens"]),
            "labels": np.concatenate(p["labels"]),
            "experts": np.concatenate(p["experts"], axis=1),
        }
        for stack, p in parts.items()
    }


# ----------------------------------------------------------------------------- entry point


def measure_run(
    workdir: Path,
    step: int | None = None,
    out: Path | None = None,
    strings: Sequence[str] = DEFAULT_TOKENS,
    rows: int = DEFAULT_ROWS,
    top: int = DEFAULT_TOP,
) -> dict[str, Any]:
    """Count a run's router choices on its validation text, draw the pictures and write them
    with `experts.json` to `out` (default `<workdir>/experts/`); returns the headline numbers."""
    from scalestudy.analysis import expert_plots
    from scalestudy.data.vocab import get_vocabulary
    from scalestudy.train.rundir import layout as rundir
    from scalestudy.train.rundir import saved_run as saved

    workdir = Path(workdir)
    step, cfg = _moe_run(workdir, step)
    vocab = get_vocabulary(cfg.data)
    ids = {s: vocab.encode(s) for s in strings}
    if empty := [s for s, i in ids.items() if not i]:
        raise ExpertsError(f"--tokens {empty[0]!r} has no tokens; give non-empty strings")
    _, params, step = saved.restore_params(workdir, step)
    tokens, labels, domains = text_rows(cfg, vocab, rows)
    if not tokens:
        raise ExpertsError(f"the validation split of data.source={cfg.data.source!r} is empty")
    routed = route_rows(cfg, params, tokens, labels)
    metrics = rundir.read_metrics(workdir)
    layers = _count_layers(cfg, routed, metrics, domains, ids, vocab.decode, top)
    m = cfg.model.moe
    results = {
        "run": str(workdir),
        "step": step,
        "router": m.router,
        "routed_experts": m.routed_experts,
        "top_k": m.top_k,
        "rows": len(tokens),
        "domains": domains,
        "layers": layers,
    }
    out = Path(out) if out is not None else rundir.experts_dir(workdir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        results["figures"] = [str(p) for p in expert_plots.draw(results, out)]
        rundir.write_atomic(out / EXPERTS_JSON, json.dumps(results, indent=1) + "\n")
    except OSError as e:
        raise ExpertsError(f"could not write the pictures to {out}: {e}") from None
    headline: dict[str, Any] = {"step": step, "rows": len(tokens), "out": str(out)}
    for name, layer in layers.items():
        headline[f"{name}/load_max"] = round(layer["load_max"] or 0.0, 3)
        headline[f"{name}/mi_domain_bits"] = round(layer["mi_domain_bits"], 3)
        headline[f"{name}/mi_token_bits"] = round(layer["mi_token_bits"], 3)
    return headline


def _moe_run(workdir: Path, step: int | None) -> tuple[int, Any]:
    """The checkpoint step measured (default: the latest) and the run's config, refused
    when there is no checkpoint or the model has no MoE layers."""
    from scalestudy.train.rundir import saved_run as saved

    if step is None:
        step = saved.latest_step(workdir)
        if step is None:
            raise ExpertsError(
                f"no checkpoint in {saved.checkpoint_dir(workdir)}; train first "
                "(`scalestudy train --workdir ...`)"
            )
    cfg = saved.load_config(workdir, step)
    if not cfg.model.moe.enabled:
        raise ExpertsError(
            f"the run in {workdir} has no MoE layers (model.moe.enabled is false): `experts` "
            "draws the routing of mixture-of-experts layers; give a run trained with "
            "model.moe.enabled=true"
        )
    return step, cfg


def _count_layers(
    cfg: Any,
    routed: dict[str, dict[str, np.ndarray]],
    metrics: list[dict[str, Any]],
    domains: Sequence[str],
    ids: dict[str, list[int]],
    decode: Any,
    top: int,
) -> dict[str, dict[str, Any]]:
    """`count_layer` and `training_curves` of each MoE layer, named `<stack>_<index>`."""
    from scalestudy.models.api import build_model

    layers = {}
    for stack, index in build_model(cfg.model).moe_layers().items():
        got = routed[stack]
        for j, i in enumerate(index):
            name = f"{stack}_{i}"
            layers[name] = count_layer(
                got["tokens"],
                got["labels"],
                got["experts"][j],
                cfg.model.moe.routed_experts,
                domains,
                ids,
                decode,
                top,
            )
            layers[name]["training"] = training_curves(metrics, name)
    return layers


EXPERTS_JSON = "experts.json"
