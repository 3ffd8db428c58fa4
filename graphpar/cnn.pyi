"""`graphpar.cnn` for static tools: the old path of `graphpar.caffe2.cnn` (graphpar/_moved.py)."""

from graphpar.caffe2.cnn import *  # noqa: F403
