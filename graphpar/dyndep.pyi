"""`graphpar.dyndep` for static tools: the old path of `graphpar.caffe2.dyndep` (graphpar/_moved.py)."""

from graphpar.caffe2.dyndep import *  # noqa: F403
