"""`graphpar.engine` for static tools: the old path of `graphpar.training.engine` (graphpar/_moved.py)."""

from graphpar.training.engine import *  # noqa: F403
