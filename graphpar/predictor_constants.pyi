"""`graphpar.predictor_constants` for static tools: the old path of `graphpar.caffe2.predictor_constants` (graphpar/_moved.py)."""

from graphpar.caffe2.predictor_constants import *  # noqa: F403
