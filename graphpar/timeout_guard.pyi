"""`graphpar.timeout_guard` for static tools: the old path of `graphpar.caffe2.timeout_guard` (graphpar/_moved.py)."""

from graphpar.caffe2.timeout_guard import *  # noqa: F403
