"""`graphpar.scope` for static tools: the old path of `graphpar.caffe2.scope` (graphpar/_moved.py)."""

from graphpar.caffe2.scope import *  # noqa: F403
