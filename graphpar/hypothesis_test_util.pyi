"""`graphpar.hypothesis_test_util` for static tools: the old path of `graphpar.caffe2.hypothesis_test_util` (graphpar/_moved.py)."""

from graphpar.caffe2.hypothesis_test_util import *  # noqa: F403
