"""`graphpar.comm` for static tools: the old path of `graphpar.parallel.comm` (graphpar/_moved.py)."""

from graphpar.parallel.comm import *  # noqa: F403
