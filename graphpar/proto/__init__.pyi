"""`graphpar.proto` for static tools: the old path of `graphpar.caffe2.proto` (graphpar/_moved.py)."""

from graphpar.caffe2.proto import *  # noqa: F403
