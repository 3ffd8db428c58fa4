"""`graphpar.proto.convert` for static tools: the old path of `graphpar.caffe2.proto.convert` (graphpar/_moved.py)."""

from graphpar.caffe2.proto.convert import *  # noqa: F403
