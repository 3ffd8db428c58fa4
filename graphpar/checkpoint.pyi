"""`graphpar.checkpoint` for static tools: the old path of `graphpar.runtime.checkpoint` (graphpar/_moved.py)."""

from graphpar.runtime.checkpoint import *  # noqa: F403
