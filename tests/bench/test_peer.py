"""The peer benchmark: an independent minimal trainer at our model's shape."""

import jax
import numpy as np
import pytest

from scalestudy.bench import peer
from scalestudy.config.errors import ConfigError
from scalestudy.config.experiment import load_config
from scalestudy.data import pipeline
from scalestudy.models import counting

SMALL = [
    "model.d_model=32",
    "model.d_ff=64",
    "model.n_heads=2",
    "model.n_layers=2",
    "objective.inputs_length=24",
    "objective.targets_length=8",
    "train.batch_size=8",
    "data.synthetic.n_train_documents=60",
    "data.synthetic.n_validation_documents=10",
    "train.progress=false",
]


@pytest.mark.parametrize(
    "shape",
    [
        ("model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.n_layers=2"),
        ("model.d_model=48", "model.d_ff=80", "model.n_heads=4", "model.n_layers=3"),
    ],
)
def test_peer_counts_the_same_flops_as_our_model(shape):
    cfg = peer.peer_config(load_config(None, [*SMALL, *shape, "objective.inputs_length=40"]))
    m = cfg.model
    params = peer.init_peer(
        jax.random.key(0), vocab=m.vocab_size, d=m.d_model, heads=m.n_heads,
        layers=m.n_layers, d_ff=m.d_ff,
    )  # fmt: skip
    ours = counting.flops(cfg)["flops_per_example"]
    assert peer.peer_flops(params, cfg.objective.decoder_length) == ours
    # Our model's own parameter count agrees with the peer's matrices (tied, no biases).
    n_peer = sum(
        int(np.prod(a.shape)) for a in jax.tree.leaves(params) if getattr(a, "ndim", 0) == 2
    )
    assert n_peer == counting.count_params(m)["total"] - (2 * m.n_layers + 1) * m.d_model


def test_peer_loss_decreases():
    cfg = peer.peer_config(load_config(None, SMALL))
    train_step, state, _ = peer.make_peer(cfg)
    batch = next(pipeline.make_iterator(cfg, "train"))
    batch = {k: batch[k] for k in peer.PEER_FEATURES}
    losses = []
    for _ in range(25):
        state, loss = train_step(state, batch)
        losses.append(float(loss))
    assert np.isfinite(losses).all()
    assert losses[0] == pytest.approx(np.log(cfg.model.vocab_size), rel=0.2)  # near uniform
    assert losses[-1] < losses[0] - 1.0


def test_nanodo_peer_missing_is_one_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "nanodo", None)  # absent even where installed
    cfg = load_config(None, SMALL)
    with pytest.raises(ConfigError, match=r"nanodo is not installed.*google-deepmind/nanodo"):
        peer.bench_peer(cfg, steps=1, which="nanodo")
    with pytest.raises(ConfigError, match=r"--peer 'other'.*minimal, nanodo"):
        peer.bench_peer(cfg, steps=1, which="other")
    from scalestudy.cli.main import main

    assert main(["bench", "peer", "--peer", "nanodo", *SMALL]) == 2


@pytest.mark.slow
def test_bench_peer_reports_both_and_their_ratio():
    out = peer.bench_peer(load_config(None, SMALL), steps=2, rounds=2)
    assert out["flops_per_example_ours"] == out["flops_per_example_peer"]
    # The ratio is of the reported times: equal to theirs up to its own rounding (3 places).
    for ratio, peer_ms, ours_ms in [
        ("ratio_peer_over_ours_step_time", "peer_step_ms", "ours_step_ms"),
        ("ratio_peer_over_ours_cpu_time", "peer_step_cpu_ms", "ours_step_cpu_ms"),
    ]:
        assert out[ratio] == pytest.approx(out[peer_ms] / out[ours_ms], abs=5e-4 + 1e-12)
    first, last = out["peer_loss_first_last"]
    assert last < first


def test_auto_peer_is_nanodo_when_it_imports_else_the_minimal_one(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "nanodo", None)
    assert peer.resolve_peer("auto") == "minimal"
    assert peer.resolve_peer("minimal") == "minimal"
    monkeypatch.delitem(sys.modules, "nanodo")
    peers = pipeline.__file__.rsplit("/scalestudy/", 1)[0] + "/../shared/peers"
    monkeypatch.syspath_prepend(peers)
    try:
        import nanodo.model  # noqa: F401
    except ImportError:
        pytest.skip(f"nanodo not found at {peers} (../shared/peers beside the repo)")
    assert peer.resolve_peer("auto") == "nanodo"
