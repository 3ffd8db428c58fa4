"""Benchmarks, each runnable as `python -m benchmarks.NAME`; results land in benchmarks/results/."""
