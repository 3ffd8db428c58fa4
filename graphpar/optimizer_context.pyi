"""`graphpar.optimizer_context` for static tools: the old path of `graphpar.model.optimizer_context` (graphpar/_moved.py)."""

from graphpar.model.optimizer_context import *  # noqa: F403
