"""`graphpar.resume` for static tools: the old path of `graphpar.runtime.resume` (graphpar/_moved.py)."""

from graphpar.runtime.resume import *  # noqa: F403
