"""`graphpar.visualize` for static tools: the old path of `graphpar.runtime.visualize` (graphpar/_moved.py)."""

from graphpar.runtime.visualize import *  # noqa: F403
