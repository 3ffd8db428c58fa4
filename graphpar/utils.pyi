"""`graphpar.utils` for static tools: the old path of `graphpar.caffe2.utils` (graphpar/_moved.py)."""

from graphpar.caffe2.utils import *  # noqa: F403
