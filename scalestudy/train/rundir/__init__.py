"""The run directory: layout, checkpoints, resume checks, summary, metrics, log."""
