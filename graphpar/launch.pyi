"""`graphpar.launch` for static tools: the old path of `graphpar.parallel.launch` (graphpar/_moved.py)."""

from graphpar.parallel.launch import *  # noqa: F403
