"""Test support shared by the tests and the benchmarks; not part of the distribution.

Fault injectors (`chaos`), simulated node agents (`simagents`) and the
golden-dump generator (`make_golden`) live here, outside `hangwatch/`, so the
wheel never ships them. Tests import them as `tests.support...` (pytest runs
with the repository root on sys.path); a benchmark run as
`python benchmarks/X.py` puts the repository root on sys.path first.
"""
