"""`graphpar.feeds` for static tools: the old path of `graphpar.parallel.feeds` (graphpar/_moved.py)."""

from graphpar.parallel.feeds import *  # noqa: F403
