"""`graphpar.workspace` for static tools: the old path of `graphpar.runtime.workspace` (graphpar/_moved.py)."""

from graphpar.runtime.workspace import *  # noqa: F403
from graphpar.runtime.workspace import __getattr__ as __getattr__
