"""Benchmarks, each runnable as `python -m benchmarks.NAME`; with `--save`, results land in benchmarks/results/."""
