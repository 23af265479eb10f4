"""Model.intermediates and the attention-rank / collapse measures."""

from __future__ import annotations

import functools
import json

import jax
import numpy as np
import pytest

from scalestudy.cli.main import main
from scalestudy.config.experiment import ExperimentConfig, ModelConfig
from scalestudy.decoder_only.attention_rank import (
    effective_rank,
    jit_intermediates,
    mean_pairwise_cosine,
    measure_params,
    measure_run,
    numerical_rank,
    singular_values,
)
from scalestudy.models import masks
from scalestudy.models.api import build_model

VOCAB, L, S, PREFIX = 64, 16, 12, 6


def _model_cfg(arch: str, **kw) -> ModelConfig:
    base = dict(arch=arch, vocab_size=VOCAB, d_model=32, n_heads=4, d_ff=64, dtype="float32")
    return ModelConfig(**{**base, **kw})


def _batch(rows: int = 3) -> dict[str, np.ndarray]:
    """Row 0: one segment; row 1: two packed segments; row 2: one segment then padding."""
    rng = np.random.default_rng(0)
    segments = np.ones((rows, L), np.int32)
    segments[1, 10:] = 2
    segments[2, 12:] = 0
    positions = np.tile(np.arange(L, dtype=np.int32), (rows, 1))
    positions[1, 10:] -= 10
    targets = rng.integers(1, VOCAB, (rows, L)).astype(np.int32) * (segments > 0)
    inputs = np.concatenate([np.zeros((rows, 1), np.int32), targets[:, :-1]], axis=1)
    inputs = np.where(positions == 0, 0, inputs)
    prefix = ((positions < PREFIX) & (segments > 0)).astype(np.int32)
    enc_segments = np.ones((rows, S), np.int32)
    enc_segments[2, 9:] = 0
    return {
        "decoder_input_tokens": inputs,
        "decoder_target_tokens": targets,
        "decoder_loss_weights": (segments > 0).astype(np.int32),
        "decoder_segment_ids": segments,
        "decoder_positions": positions,
        "decoder_causal_attention": prefix,
        "encoder_input_tokens": rng.integers(1, VOCAB, (rows, S)).astype(np.int32) * enc_segments,
        "encoder_segment_ids": enc_segments,
        "encoder_positions": np.tile(np.arange(S, dtype=np.int32), (rows, 1)),
    }


@functools.cache
def _compiled(cfg: ModelConfig):
    model = build_model(cfg)
    return model, jax.jit(model.init)(jax.random.key(0)), jit_intermediates(model)


def _expected_mask(arch: str, stack: str, batch: dict) -> np.ndarray:
    """[B, Q, K] who may attend to whom, from the mask builders the model uses."""
    if stack == "encoder":
        mask = masks.encoder_self(batch["encoder_segment_ids"])
    elif arch == "noncausal_decoder":
        mask = masks.decoder_self(batch["decoder_segment_ids"], batch["decoder_causal_attention"])
    else:
        mask = masks.decoder_self(batch["decoder_segment_ids"])
    return np.asarray(mask)[:, 0]


# One encoder-decoder config (unscanned, no position bias) serves every enc-dec test, so it
# compiles once; the decoder-only ones cover the scanned path.
ENCDEC_KW = {"scan_layers": False, "position": "none"}


@pytest.mark.parametrize("arch", ["causal_decoder", "noncausal_decoder", "encoder_decoder"])
def test_intermediates_reproduce_the_forward_pass(arch):
    cfg = _model_cfg(arch, **ENCDEC_KW) if arch == "encoder_decoder" else _model_cfg(arch)
    model, params, intermediates = _compiled(cfg)
    batch = _batch()
    out = jax.device_get(intermediates(params, batch))
    assert set(out) == ({"encoder", "decoder"} if arch == "encoder_decoder" else {"decoder"})
    for stack, inter in out.items():
        attn, hidden = inter["attention"], inter["hidden"]
        rows, length = batch[f"{stack}_segment_ids"].shape
        assert attn.dtype == np.float32 and attn.shape == (2, rows, 4, length, length)
        assert hidden.shape == (3, rows, length, 32)
        real = batch[f"{stack}_segment_ids"] > 0
        # Padding queries see nothing (a uniform row, ignored); real ones only their keys.
        hidden_keys = ~_expected_mask(arch, stack, batch) & real[:, :, None]
        assert np.all(attn[np.broadcast_to(hidden_keys[None, :, None], attn.shape)] == 0)
        sums = attn.sum(-1)[:, real[:, None].repeat(4, 1)]
        np.testing.assert_allclose(sums, 1.0, atol=1e-5)
        # The residual stream starts at the token embeddings.
        table = np.asarray(params["embed"]["table"])
        np.testing.assert_allclose(hidden[0], table[batch[f"{stack}_input_tokens"]], atol=1e-6)
    # The last hidden state, projected by the output matrix, gives the model's logits.
    logits = np.einsum("BLD,DV->BLV", out["decoder"]["hidden"][-1], np.asarray(params["logits"]))
    np.testing.assert_allclose(logits, jax.jit(model.apply)(params, batch), atol=1e-4)


# ----------------------------------------------------------------------------- measures


def test_rank_measures_on_constructed_matrices():
    rng = np.random.default_rng(1)
    q, _ = np.linalg.qr(rng.normal(size=(8, 8)))
    spectrum = np.array([4.0, 2.0, 1.0, 0.5, 1e-3, 1e-9, 0.0, 0.0])
    m = q @ np.diag(spectrum) @ q.T
    s = singular_values(m)
    np.testing.assert_allclose(s, spectrum, atol=1e-12)
    assert numerical_rank(s) == 5  # 1e-9 < 8 * eps32 * 4
    assert numerical_rank(s, rtol=1e-12) == 6
    p = spectrum / spectrum.sum()
    p = p[p > 0]
    np.testing.assert_allclose(effective_rank(s), np.exp(-(p * np.log(p)).sum()), rtol=1e-9)
    assert effective_rank(singular_values(np.eye(6))) == pytest.approx(6.0)
    rank_one = np.outer(rng.random(7), rng.random(7))
    assert numerical_rank(singular_values(rank_one)) == 1
    assert effective_rank(singular_values(rank_one)) == pytest.approx(1.0, abs=1e-6)
    assert effective_rank(np.zeros(3)) == 0.0


def test_collapse_metric_is_one_for_identical_tokens_and_low_for_random():
    rng = np.random.default_rng(2)
    same = np.tile(rng.normal(size=(1, 1, 32)), (1, 20, 1))
    assert mean_pairwise_cosine(same)[0] == pytest.approx(1.0)
    assert effective_rank(singular_values(same))[0] == pytest.approx(1.0, abs=1e-6)
    noise = rng.normal(size=(1, 20, 32))
    assert abs(mean_pairwise_cosine(noise)[0]) < 0.1
    assert effective_rank(singular_values(noise))[0] > 10
    # Hand-computed: three unit vectors at pairwise cosines 1, 0, 0.
    x = np.array([[[1.0, 0.0], [2.0, 0.0], [0.0, 3.0]]])
    assert mean_pairwise_cosine(x)[0] == pytest.approx(1 / 3)


# ----------------------------------------------------------------------------- the models


def _exp_cfg(arch: str, **kw) -> ExperimentConfig:
    objective = {"name": "flm" if arch == "causal_decoder" else "plm"}
    return ExperimentConfig(model=_model_cfg(arch, **kw), objective=objective)


def _zero_keys(params: dict) -> dict:
    """Every self-attention key projection set to 0: all logits of a row are equal."""

    def zero(path, leaf):
        names = [getattr(p, "key", None) for p in path]
        return np.zeros_like(leaf) if "self_attn" in names and names[-1] == "k" else leaf

    return jax.tree_util.tree_map_with_path(zero, params)


def test_causal_attention_is_triangular_with_positive_diagonal_hence_full_rank():
    cfg = _exp_cfg("causal_decoder")
    model, params, intermediates = _compiled(cfg.model)
    batch = _batch()
    attn = np.asarray(intermediates(params, batch)["decoder"]["attention"])[:, 0]  # one segment
    assert np.all(np.triu(attn, k=1) == 0)
    assert np.all(np.diagonal(attn, axis1=-2, axis2=-1) > 0)
    ranks = measure_params(cfg, model, params, batch)
    assert ranks["decoder/attn_triangular_full"] == 1.0
    assert ranks["decoder/attn_future_mass"] == 0.0
    # Equal logits (no keys, no position bias): uniform causal attention, rows 1/(i+1), whose
    # inverse is bidiagonal: well conditioned, so full numerical rank too.
    cfg = _exp_cfg("causal_decoder", position="none")
    model, params, _ = _compiled(cfg.model)
    ranks = measure_params(cfg, model, _zero_keys(params), batch)
    assert ranks["decoder/length"] == pytest.approx(np.mean([L, 10, 12]))
    assert ranks["decoder/attn_rank"] == pytest.approx(ranks["decoder/length"])
    assert ranks["decoder/attn_rank_frac_full"] == 1.0


def test_bidirectional_attention_with_equal_keys_has_rank_one():
    # Equal keys make every row of a bidirectional stack the same (uniform over the segment),
    # so the attention matrix is rank 1, while the causal decoder stays full rank.
    cfg = _exp_cfg("encoder_decoder", **ENCDEC_KW)
    model, params, _ = _compiled(cfg.model)
    ranks = measure_params(cfg, model, _zero_keys(params), _batch())
    assert ranks["encoder/attn_rank"] == 1.0
    assert ranks["encoder/attn_eff_rank"] == pytest.approx(1.0, abs=1e-5)
    assert ranks["encoder/attn_rank_frac_full"] == 0.0
    assert ranks["decoder/attn_rank_frac_full"] == 1.0
    for i in range(2):
        assert ranks[f"encoder/layer{i}/head3/attn_rank"] == 1.0


def test_noncausal_prefix_block_is_not_triangular():
    cfg = _exp_cfg("noncausal_decoder")
    model, params, intermediates = _compiled(cfg.model)
    batch = _batch()
    attn = np.asarray(intermediates(params, batch)["decoder"]["attention"])[:, 0]
    later = np.triu_indices(PREFIX, k=1)
    prefix_block = attn[..., :PREFIX, :PREFIX]
    assert np.all(prefix_block[..., later[0], later[1]] > 0), "prefix must see later prefix keys"
    assert np.all(np.triu(attn[..., PREFIX:, :], k=PREFIX + 1) == 0), "targets see the future"
    ranks = measure_params(cfg, model, params, batch)
    assert ranks["decoder/attn_triangular_full"] == 0.0
    assert ranks["decoder/attn_future_mass"] > 0.0


def test_attention_rank_without_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert main(["attention-rank", "--workdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no checkpoint" in err and "Traceback" not in err
    assert not (tmp_path / "attention_rank.json").exists()


def test_measure_run_reads_the_checkpoint_and_writes_attention_rank_json(tmp_path):
    from scalestudy.data.pipeline import make_iterator
    from scalestudy.train.rundir.checkpoint import Checkpointer

    cfg = ExperimentConfig(
        model=_model_cfg("causal_decoder", vocab_size=384),
        objective={"name": "flm", "inputs_length": 8, "targets_length": 8},
        data={"synthetic": {"n_train_documents": 20, "n_validation_documents": 20}},
        train={"batch_size": 2},
    )
    model = build_model(cfg.model)
    params = jax.jit(model.init)(jax.random.key(3))
    ckpt = Checkpointer(tmp_path / "checkpoints", async_save=False)
    ckpt.save(7, {"params": params, "step": np.int32(7)}, {}, cfg)
    ckpt.close()

    out = measure_run(tmp_path, n_examples=3)
    assert json.loads((tmp_path / "attention_rank.json").read_text()) == out
    assert out["step"] == 7 and out["decoder/n_examples"] == 3
    # The same numbers as probing the saved parameters on the first 3 validation rows.
    iterator = make_iterator(cfg, "validation")
    rows = [next(iterator) for _ in range(2)]
    batch = {k: np.concatenate([r[k] for r in rows])[:3] for k in rows[0]}
    expected = measure_params(cfg, model, params, batch)
    assert {k: v for k, v in out.items() if k != "step"} == pytest.approx(expected)
