"""Shared configs for the data tests."""

import pytest

from scalestudy.config.experiment import ExperimentConfig


@pytest.fixture
def seqio_encdec_plm_cfg() -> ExperimentConfig:
    """A small encoder-decoder prefix-LM stream through the synthetic seqio Task."""
    return ExperimentConfig(
        model={"arch": "encoder_decoder"},
        objective={"name": "plm", "inputs_length": 24, "targets_length": 8},
        data={
            "source": "seqio",
            "seqio_task": "scalestudy.synthetic.plm",
            "synthetic": {"n_train_documents": 300, "n_validation_documents": 30},
        },
        train={"batch_size": 8},
    )
