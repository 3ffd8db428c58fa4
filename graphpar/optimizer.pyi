"""`graphpar.optimizer` for static tools: the old path of `graphpar.model.optimizer` (graphpar/_moved.py)."""

from graphpar.model.optimizer import *  # noqa: F403
