"""`graphpar.model_helper` for static tools: the old path of `graphpar.model.model_helper` (graphpar/_moved.py)."""

from graphpar.model.model_helper import *  # noqa: F403
