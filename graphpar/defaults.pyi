"""`graphpar.defaults` for static tools: the old path of `graphpar.training.defaults` (graphpar/_moved.py)."""

from graphpar.training.defaults import *  # noqa: F403
