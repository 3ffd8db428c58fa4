"""Caffe2's `predictor` package: export a predict net with its parameters to one file, and load it."""
