"""`graphpar.predictor` for static tools: the old path of `graphpar.caffe2.predictor` (graphpar/_moved.py)."""

from graphpar.caffe2.predictor import *  # noqa: F403
