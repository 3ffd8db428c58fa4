"""`graphpar.data` for static tools: the old path of `graphpar.training.data` (graphpar/_moved.py)."""

from graphpar.training.data import *  # noqa: F403
