"""Analyses that read a run directory and draw what its model does (`experts.py`: which
experts of a mixture-of-experts run the tokens go to)."""
