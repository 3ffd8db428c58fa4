"""`graphpar.loaders` for static tools: the old path of `graphpar.training.loaders` (graphpar/_moved.py)."""

from graphpar.training.loaders import *  # noqa: F403
