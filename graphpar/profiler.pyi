"""`graphpar.profiler` for static tools: the old path of `graphpar.runtime.profiler` (graphpar/_moved.py)."""

from graphpar.runtime.profiler import *  # noqa: F403
