"""`graphpar.brew` for static tools: the old path of `graphpar.model.brew` (graphpar/_moved.py)."""

from graphpar.model.brew import *  # noqa: F403
from graphpar.model.brew import __getattr__ as __getattr__
