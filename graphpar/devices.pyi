"""`graphpar.devices` for static tools: the old path of `graphpar.platform.devices` (graphpar/_moved.py)."""

from graphpar.platform.devices import *  # noqa: F403
