"""`graphpar.proto.caffe2_pb2` for static tools: the old path of `graphpar.caffe2.proto.caffe2_pb2` (graphpar/_moved.py)."""

from graphpar.caffe2.proto.caffe2_pb2 import *  # noqa: F403
