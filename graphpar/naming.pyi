"""`graphpar.naming` for static tools: the old path of `graphpar.core.naming` (graphpar/_moved.py)."""

from graphpar.core.naming import *  # noqa: F403
