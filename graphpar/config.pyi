"""`graphpar.config` for static tools: the old path of `graphpar.training.config` (graphpar/_moved.py)."""

from graphpar.training.config import *  # noqa: F403
