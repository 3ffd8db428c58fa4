"""`graphpar.feeder` for static tools: the old path of `graphpar.training.feeder` (graphpar/_moved.py)."""

from graphpar.training.feeder import *  # noqa: F403
