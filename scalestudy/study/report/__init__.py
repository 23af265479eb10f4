"""A study's report: the page, its sections, fits and verdicts."""
