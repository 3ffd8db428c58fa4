"""`graphpar.distributed` for static tools: the old path of `graphpar.platform.distributed` (graphpar/_moved.py)."""

from graphpar.platform.distributed import *  # noqa: F403
