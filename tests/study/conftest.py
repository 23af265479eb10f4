"""Tiny study specs for the study tests."""

from pathlib import Path

import pytest
import yaml

TINY_BASE = {
    "objective": {"inputs_length": 24, "targets_length": 8},
    "model": {"vocab_size": 384, "dtype": "float32", "n_heads": 2},
    "train": {
        "batch_size": 8,
        "log_every": 2,
        "checkpoint_every": 2,
        "eval_batches": 1,
        "progress": False,
        "async_checkpoint": False,
    },
    "data": {"synthetic": {"n_train_documents": 200, "n_validation_documents": 20}},
    "eval": {"max_examples": 8},
}


def write_spec(path: Path, **changes) -> Path:
    """A tiny study: two cells, two explicit sizes, a handful of steps."""
    spec = {
        "name": "tiny",
        "base": TINY_BASE,
        "cells": [["causal_decoder", "flm"], ["encoder_decoder", "mlm"]],
        "ladder": {
            "sizes": [
                {"name": "xs", "d_model": 16, "n_layers": 2, "d_ff": 32},
                {"name": "s", "d_model": 32, "n_layers": 2, "d_ff": 64},
            ]
        },
        "budget": {"kind": "steps", "steps": 4},
        "tasks": ["synthetic_probes"],
        "fit": {"laws": ["kaplan_n"], "bootstrap": 10},
        **changes,
    }
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture
def tiny_spec(tmp_path: Path) -> Path:
    return write_spec(tmp_path / "tiny.yaml")
