"""`graphpar.core.plan` for static tools: the old path of `graphpar.caffe2.plan` (graphpar/_moved.py)."""

from graphpar.caffe2.plan import *  # noqa: F403
