"""`graphpar.data_parallel_model` for static tools: the old path of `graphpar.parallel.data_parallel_model` (graphpar/_moved.py)."""

from graphpar.parallel.data_parallel_model import *  # noqa: F403
