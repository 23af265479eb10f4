"""Benchmarks: the data pipelines, the train step, the peer trainer, rank-classification
evaluation, each a `bench` function behind `scalestudy bench <what>`. They measure the rooms
below them and are imported by nothing but the CLI."""
