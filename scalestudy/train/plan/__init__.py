"""Ahead-of-time compilation for a target topology, plan search, the roofline."""
