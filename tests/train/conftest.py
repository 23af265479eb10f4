"""Tiny configs shared by the train tests (equal shapes let tests reuse compiled programs)."""

import os

import pytest

from scalestudy.config import ExperimentConfig, load_config

ARCH_CELL = {"causal_decoder": "flm", "noncausal_decoder": "plm", "encoder_decoder": "mlm"}

TINY = [
    "model.d_model=32",
    "model.d_ff=64",
    "model.n_heads=2",
    "model.n_layers=2",
    "model.rel_max_distance=32",
    "model.dropout=0.1",  # exact resume must reproduce the dropout masks too
    "objective.inputs_length=24",
    "objective.targets_length=8",
    "data.synthetic.n_train_documents=300",
    "data.synthetic.n_validation_documents=40",
    "train.batch_size=16",
    "train.steps=40",  # resume tests stop early (stop_after_steps); overfitting uses all 40
    "train.log_every=1",
    "train.checkpoint_every=4",
    "train.eval_batches=1",
    "train.progress=false",
    "optim.schedule=wsd",
    "optim.learning_rate=0.01",
    "optim.warmup_steps=2",
    "optim.cooldown_steps=4",
]


def tiny(
    arch: str = "causal_decoder", objective: str | None = None, *more: str
) -> ExperimentConfig:
    """A tiny experiment config; `more` are extra dotted overrides."""
    objective = objective or ARCH_CELL[arch]
    return load_config(None, [*TINY, f"model.arch={arch}", f"objective.name={objective}", *more])


@pytest.fixture(scope="session")
def tiny_cfg():
    return tiny


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    """A private persistent compilation cache, shared with subprocesses the tests start."""
    os.environ.setdefault("SCALESTUDY_JAX_CACHE", str(tmp_path_factory.mktemp("jax_cache")))
