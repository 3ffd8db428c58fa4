"""`graphpar.evaluation` for static tools: the old path of `graphpar.training.evaluation` (graphpar/_moved.py)."""

from graphpar.training.evaluation import *  # noqa: F403
