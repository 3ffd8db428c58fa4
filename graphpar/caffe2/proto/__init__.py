"""Caffe2's protobuf messages (`caffe2_pb2`) and conversion to and from graphpar's IR (`convert`).

Needs the optional `protobuf` package (`pip install graphpar[caffe2]`); the rest of graphpar does not.
"""
