"""The decoder-only report's statistics: paired seeds, accuracy intervals over examples and
seeds (coverage on simulated data), Holm, and rank tests that never pool architectures."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from scalestudy.decoder_only import attention_rank, stats
from scalestudy.decoder_only.rank_report import rank_deficits, rank_tests
from scalestudy.study.record.rows import RunRow


def _runs(losses: dict[int, float]) -> list[RunRow]:
    return [RunRow(seed=s, loss=x) for s, x in losses.items()]


def test_paired_seeds_see_a_difference_that_seed_noise_hides():
    # Each seed shifts both variants alike (same data order and initialisation); the variant
    # is 0.01 better on every seed. Unpaired, the seed spread (0.1) hides it; paired, it shows.
    shift = {0: 0.0, 1: 0.2, 2: -0.15, 3: 0.05}
    a = _runs({s: 2.0 + x - 0.01 + 0.001 * s for s, x in shift.items()})
    b = _runs({s: 2.0 + x for s, x in shift.items()})
    est = stats.paired_difference(a, b, "loss")
    assert est.seeds == 4 and est.d == pytest.approx(-0.0085)
    assert est.d + est.half < 0  # the interval excludes zero
    unpaired = stats.loss_stats(a)["half"] + stats.loss_stats(b)["half"]
    assert unpaired > abs(est.d)  # what an unpaired comparison would have said
    assert "better" in stats.verdict("a", "b", est, "loss", True, stats.holm([est.p])[0])


def test_only_common_seeds_are_paired_and_one_seed_gives_no_interval():
    est = stats.paired_difference(_runs({0: 1.0, 5: 2.0}), _runs({0: 1.5, 7: 9.0}), "loss")
    assert est.seeds == 1 and est.d == pytest.approx(-0.5) and est.half is None
    text = stats.verdict("a", "b", est, "loss", True, None)
    assert "no between-run interval" in text and "n = 1 seed" in text


def test_holm_matches_its_definition():
    got = stats.holm([0.01, 0.04, None, 0.03, 0.5])
    # sorted 0.01, 0.03, 0.04, 0.5 (m = 4): 4 x 0.01, 3 x 0.03, max(0.09, 2 x 0.04), 0.5
    assert got[2] is None
    assert [got[i] for i in (0, 1, 3, 4)] == pytest.approx([0.04, 0.09, 0.09, 0.5])


def _accuracy_rows(rng, p_examples, seed_sd, seeds, shift):
    """Per seed, one run's accuracy on the same examples: correctness ~ Bernoulli of the
    example's difficulty moved by the seed's effect (and the variant's `shift`)."""
    rows = []
    for s in range(seeds):
        p = np.clip(p_examples + shift + rng.normal(0, seed_sd), 0, 1)
        acc = float((rng.random(p.size) < p).mean())
        rows.append(RunRow(seed=s, evals={"eval/t/acc": acc, "eval/t/n": float(p.size)}))
    return rows


def test_accuracy_interval_covers_the_difference_with_the_run_as_the_unit():
    # Examples are drawn from a population; every seed scores the same draw. Each run's
    # accuracy already holds its examples' noise, so the interval over per-seed differences
    # alone covers the true difference (0.05) about 95% of the time: not less (the examples
    # are in the runs) and not more (no separate examples term counted twice).
    rng = np.random.default_rng(0)
    hits, seed_only_hits, sims = 0, 0, 600
    for _ in range(sims):
        p_examples = rng.beta(2, 2, size=200)  # a new sample of examples each simulation
        a = _accuracy_rows(rng, p_examples, 0.02, 3, 0.05)
        b = _accuracy_rows(rng, p_examples, 0.02, 3, 0.0)
        est = stats.paired_difference(a, b, "acc")
        hits += abs(est.d - 0.05) <= est.half
        ds = [x.evals["eval/t/acc"] - y.evals["eval/t/acc"] for x, y in zip(a, b)]
        half = stats.t95(2) * np.std(ds, ddof=1) / np.sqrt(3)
        seed_only_hits += abs(np.mean(ds) - 0.05) <= half
    assert 0.92 <= hits / sims <= 0.98
    assert seed_only_hits == hits  # one method: the t interval over the runs


def _rank_rows(group_value, region_of, head_dim=16, length=48, entropy=None):
    """Rows of `group_value` ({group: {seed: effective rank / n}}) at two layers."""
    return {
        g: [
            {
                "seed": s,
                "step": 10,
                "layer": layer,
                "region": region_of[g],
                "eff_rank_rel": v,
                "stable_rank_rel": v / 2,
                "head_dim": head_dim,
                "length": length,
                **({} if entropy is None else {"entropy": entropy[g]}),
            }
            for s, v in by_seed.items()
            for layer in (0, 1)
        ]
        for g, by_seed in group_value.items()
    }


def test_deficits_compare_each_bidirectional_block_with_the_causal_prefix_never_pooled():
    rank = _rank_rows(
        {
            "causal_decoder/plm/base": {0: 0.50, 1: 0.55, 2: 0.45},
            "noncausal_decoder/plm/base": {0: 0.40, 1: 0.46, 2: 0.35},
            "encoder_decoder/plm/base": {0: 0.9, 1: 0.9, 2: 0.9},
        },
        {
            "causal_decoder/plm/base": "prefix",
            "noncausal_decoder/plm/base": "prefix",
            "encoder_decoder/plm/base": "encoder",
        },
    )
    rows = rank_deficits(rank)
    assert {r["group"] for r in rows} == {
        "noncausal_decoder/plm/base (prefix)",
        "encoder_decoder/plm/base (encoder)",
    }
    nc = [r for r in rows if r["group"].startswith("noncausal")]
    assert np.mean([r["measured"] for r in nc]) == pytest.approx(-0.0966667, abs=1e-6)
    # No entropy measured, and one head width (16 < n = 48): no test, so no verdict.
    assert rank_tests(rank) == []


def test_the_rank_verdict_is_the_interaction_beyond_random_qk_at_matched_entropy():
    """A deficit beyond the random-QK baseline at d_kv 16 < n 48 that is absent at d_kv 64 >=
    n: one paired test over seeds, of the predicted sign; a deficit the same at both widths
    (the argument's prediction fails) is not distinguishable."""
    from scalestudy.decoder_only.attention_rank import random_qk_eff_rank

    n, ent_b, ent_c = 48, 2.5, 2.0
    rng = np.random.default_rng(0)

    def study(effect_small: float, effect_large: float) -> dict:
        rank = {}
        for d_kv, effect in ((16, effect_small), (64, effect_large)):
            base = {
                s: random_qk_eff_rank(n, d_kv, ent_b, False, seed=s)
                - random_qk_eff_rank(n, d_kv, ent_c, True, seed=s)
                for s in range(4)
            }
            causal = {s: 0.5 + 0.02 * rng.standard_normal() for s in range(4)}
            bidi = {s: causal[s] + base[s] + effect + 0.005 * rng.standard_normal() for s in causal}
            groups = {f"causal_decoder/plm/w{d_kv}": causal, f"noncausal_decoder/plm/w{d_kv}": bidi}
            regions = dict.fromkeys(groups, "prefix")
            entropy = {g: ent_c if g.startswith("causal") else ent_b for g in groups}
            rank |= _rank_rows(groups, regions, head_dim=d_kv, length=n, entropy=entropy)
        return rank

    (test,) = rank_tests(study(-0.1, 0.0))
    est = test.est
    assert est.seeds == 4 and est.d == pytest.approx(-0.1, abs=0.02) and est.p < 0.01
    (same,) = rank_tests(study(-0.1, -0.1))
    assert abs(same.est.d) < 0.02 and same.est.p > 0.05


def _sink(n: int, self_mass: float) -> np.ndarray:
    """Causal attention that puts `self_mass` on the query itself and the rest on the first
    key (an attention sink): lower-triangular with a positive diagonal."""
    a = np.eye(n) * self_mass
    a[:, 0] += 1 - self_mass
    a[0, 0] = 1.0
    return a


def test_rank_measures_separate_conditioning_from_rank():
    n, hidden = 12, np.random.default_rng(0).normal(size=(1, 12, 8))
    # Exactly invertible (triangular, positive diagonal) but so ill-conditioned that every
    # numerical cut-off calls it rank-deficient: the conditioning, not the rank, is low.
    m = attention_rank._example(_sink(n, 1e-9)[None, None], hidden, None)
    assert m["attn_triangular_full"][0, 0] == 1.0 and m["attn_full"][0, 0] == 0.0
    assert m["attn_log10_cond"][0, 0] > 8
    # Moderately conditioned: full rank at n * eps32 and at 1e-5, not at the loose 1e-2.
    m = attention_rank._example(_sink(n, 1e-3)[None, None], hidden, None)
    assert m["attn_full"][0, 0] == m["attn_full@1e-5"][0, 0] == 1.0
    assert m["attn_full@1e-2"][0, 0] == 0.0
    # A uniform bidirectional matrix has rank 1, which every measure agrees on.
    m = attention_rank._example(np.full((1, 1, n, n), 1 / n), hidden, None)
    assert m["attn_rank"][0, 0] == 1 and m["attn_triangular_full"][0, 0] == 0.0
    assert m["attn_stable_rank_rel"][0, 0] == pytest.approx(1 / n)
    assert attention_rank.stable_rank(attention_rank.singular_values(np.eye(n))) == pytest.approx(n)


def test_the_order_corpus_second_half_is_the_first_reversed():
    from scalestudy.config.experiment import SyntheticConfig
    from scalestudy.data import order_task

    cfg = SyntheticConfig(n_train_documents=50, n_validation_documents=5)
    docs = order_task.documents(cfg, "train")
    assert docs == order_task.documents(cfg, "train") and len(set(docs)) == 50
    assert not set(docs) & set(order_task.documents(cfg, "validation"))
    for doc in docs:
        first, second = doc.split("|")
        assert (
            second == first[::-1] and order_task.LENGTHS[0] <= len(first) <= order_task.LENGTHS[1]
        )
        assert set(first) <= set(order_task.LETTERS)
    # No validation string is a training string, even though short strings repeat often.
    many = SyntheticConfig(n_train_documents=5000, n_validation_documents=300)
    train = {d.split("|")[0] for d in order_task.documents(many, "train")}
    held_out = {d.split("|")[0] for d in order_task.documents(many, "validation")}
    assert len(train) < 5000 and len(held_out) > 100 and not train & held_out
    # Order carries information that the bag of letters does not: some documents share their
    # letters and differ in their second half.
    bags = {}
    for doc in order_task.documents(SyntheticConfig(n_train_documents=20000), "train"):
        first = doc.split("|")[0]
        bags.setdefault("".join(sorted(first)), set()).add(first[::-1])
    assert any(len(v) > 1 for v in bags.values())


def _group(losses: dict[int, float], name: str = "g", steps: int = 100) -> list[RunRow]:
    return [RunRow(f"{name}{s}", seed=s, loss=x, steps=steps) for s, x in losses.items()]


def test_interaction_is_the_paired_difference_of_differences():
    from scalestudy.decoder_only.experiments import compare_groups
    from scalestudy.study.plan.spec import ComparisonConfig

    spec = ComparisonConfig(
        title="nope", kind="interaction", groups=["c/rope", "c/nope", "n/rope", "n/nope"]
    )
    seed_shift = {0: 0.0, 1: 0.3, 2: -0.2}
    groups = {
        "c/rope": _group({s: 1.0 + x for s, x in seed_shift.items()}),
        "c/nope": _group({s: 1.05 + x for s, x in seed_shift.items()}),
        "n/rope": _group({s: 1.0 + x for s, x in seed_shift.items()}),
        "n/nope": _group({s: 1.40 + x + 0.01 * s for s, x in seed_shift.items()}),
    }
    (test,) = compare_groups(spec, groups)["tests"]
    est = test.est
    assert est.seeds == 3 and est.d == pytest.approx(0.36)
    assert est.d - est.half > 0  # NoPE hurts the non-causal decoder more
    with pytest.raises(Exception, match="four groups"):
        ComparisonConfig(title="x", kind="interaction", groups=["a", "b"])


def test_also_at_separates_optimisation_speed_from_final_loss():
    from scalestudy.decoder_only.experiments import compare_groups
    from scalestudy.study.plan.spec import ComparisonConfig

    spec = ComparisonConfig(title="t", groups=["fast", "slow"], also_at=0.5)
    losses = {0: 1.0, 1: 1.1, 2: 0.9}
    groups = {"fast": _group(losses, "fast"), "slow": _group(losses, "slow")}
    curves = {}
    for name, early in (("fast", 2.0), ("slow", 2.5)):
        for r in groups[name]:
            curves[r.run_id] = {
                25: early + r.loss,
                50: early - 0.5 + r.loss,
                100: r.loss,
            }
    tests = {t.what: t.est for t in compare_groups(spec, groups, curves)["tests"]}
    assert tests["validation loss"].d == pytest.approx(0.0)
    early = tests["validation loss at 50% of training"]
    assert early.d == pytest.approx(0.5) and early.seeds == 3


def test_comparisons_name_what_they_change_and_what_they_hold_equal():
    from scalestudy.decoder_only.claims_report import comparison_section
    from scalestudy.decoder_only.experiments import compare_groups
    from scalestudy.study.plan.spec import ComparisonConfig

    rope, nope = "causal_decoder/plm/rope", "causal_decoder/plm/nope"
    spec = ComparisonConfig(title="t", groups=[rope, nope], metrics=["loss"])

    def rows(name, **counts):
        base = {"params_total": 1000, "flops": 1e9, "document_tokens": 5e3, "steps": 100}
        return [r.replace(**(base | counts)) for r in _group({0: 1.0, 1: 1.2, 2: 0.9}, name)]

    groups = {rope: rows("r"), nope: rows("n", params_total=1500)}
    got = compare_groups(spec, groups)
    assert [t.what for t in got["tests"]] == ["validation loss"]  # metrics: [loss]
    [held] = got["held"]
    assert held["changed"] == ["variant (rope -> nope)"]
    assert held["same"] == ["training FLOPs", "document tokens"]
    assert held["differ"][0] == "total parameters (1.50x)"
    text = "\n".join(comparison_section(2, got, {}, []))
    assert (
        f"- {nope} against {rope}: changes variant (rope -> nope); held equal: training FLOPs, "
        "document tokens; not equal: total parameters (1.50x), positions (unknown)"
    ) in text
    with pytest.raises(Exception, match="metrics"):
        ComparisonConfig(title="t", groups=[rope, nope], metrics=[])


def test_order_floor_is_a_distribution_and_matches_its_expectation():
    from scalestudy.config.experiment import ExperimentConfig
    from scalestudy.data import order_task
    from scalestudy.decoder_only import order_floor

    lo, hi = order_task.LENGTHS
    # Before the bar, the ideal next-token probabilities (bar, or one of the letters) sum to 1.
    for j in range(hi + 1):
        bar = math.exp(-order_floor.token_loss(j, j)) if j >= lo else 0.0
        letter = math.exp(-order_floor.token_loss(j, j + 1)) if j < hi else 0.0
        assert bar + len(order_task.LETTERS) * letter == pytest.approx(1.0)
    # The expected floor, enumerated over string lengths and `fit` split points, is what the
    # pipeline's batches give on average (about 19,000 documents: sampling error about 0.002).
    cfg = ExperimentConfig.model_validate(
        {
            "data": {"source": "order", "synthetic": {"n_validation_documents": 20000}},
            "objective": {"name": "plm", "inputs_length": 16, "targets_length": 16}
            | {"plm_split": "fit", "pieces": "per_document"},
            "train": {"batch_size": 32, "eval_batches": 300},
        }
    )
    total = count = 0.0
    for k in range(lo, hi + 1):
        n = 2 * k + 2  # letters, bar, reversed letters, EOS
        splits = range(max(1, n - 16), min(n - 1, 16) + 1)
        for s in splits:
            total += sum(order_floor.token_loss(j, k) for j in range(s, n)) / len(splits)
            count += (n - s) / len(splits)
    assert order_floor.validation_floor(cfg) == pytest.approx(total / count, abs=0.005)
    assert 0.3 < total / count < math.log(len(order_task.LETTERS)) / 2


def test_not_distinguishable_beside_an_interval_excluding_zero_says_why():
    est = stats.Estimate(d=0.03, half=0.01, p=None, seeds=3, examples=800)
    line = stats.verdict("a", "b", est, "probe accuracy", False, 0.2)
    assert "not distinguishable" in line and "(95%, unadjusted)" in line
    assert "the unadjusted interval excludes 0, the Holm-adjusted p does not reject" in line
    wide = stats.verdict("a", "b", replace(est, half=0.05), "probe accuracy", False, 0.2)
    assert "excludes 0" not in wide
