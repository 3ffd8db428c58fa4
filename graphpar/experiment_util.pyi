"""`graphpar.experiment_util` for static tools: the old path of `graphpar.caffe2.experiment_util` (graphpar/_moved.py)."""

from graphpar.caffe2.experiment_util import *  # noqa: F403
