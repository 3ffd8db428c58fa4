"""`graphpar.predictor.predictor_py_utils` for static tools: the old path of `graphpar.caffe2.predictor.predictor_py_utils` (graphpar/_moved.py)."""

from graphpar.caffe2.predictor.predictor_py_utils import *  # noqa: F403
