"""`graphpar.predictor.predictor_exporter` for static tools: the old path of `graphpar.caffe2.predictor.predictor_exporter` (graphpar/_moved.py)."""

from graphpar.caffe2.predictor.predictor_exporter import *  # noqa: F403
