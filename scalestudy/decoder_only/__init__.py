"""The "why decoder-only" wing: attention rank and representation collapse, inference cost with
and without a cache, and comparisons of a study's variants, reported in `decoder_only.md`.

It sits above `study/` in the flow of imports: it reads a finished study's registry and runs.
"""
