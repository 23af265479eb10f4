"""Every example experiment config loads, and its objective fits its lengths."""

from pathlib import Path

import pytest

from scalestudy.config.experiment import load_config
from scalestudy.data.objectives import Objective

FILES = sorted((Path(__file__).resolve().parents[2] / "configs" / "experiments").glob("*.yaml"))


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_experiment_config_is_valid(path):
    cfg = load_config(path)
    obj = Objective(cfg.objective, cfg.model.vocab_size, cfg.data.extra_ids, cfg.data.seed)
    assert obj.piece_length >= 2
