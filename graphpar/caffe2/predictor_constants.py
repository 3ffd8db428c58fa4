"""Caffe2's `predictor_constants.predictor_constants`: the keys of an exported predictor's nets and blobs."""

from __future__ import annotations

from types import SimpleNamespace

predictor_constants = SimpleNamespace(
    META_NET_DEF="!!META_NET_DEF",
    PREDICTOR_DBREADER="!!PREDICTOR_DBREADER",
    PARAMETERS_BLOB_TYPE="PARAMETERS_BLOB_TYPE",
    INPUTS_BLOB_TYPE="INPUTS_BLOB_TYPE",
    OUTPUTS_BLOB_TYPE="OUTPUTS_BLOB_TYPE",
    GLOBAL_INIT_NET_TYPE="GLOBAL_INIT_NET_TYPE",
    PREDICT_INIT_NET_TYPE="PREDICT_INIT_NET_TYPE",
    PREDICT_NET_TYPE="PREDICT_NET_TYPE",
    SINGLE_PREDICTOR="SINGLE_PREDICTOR",
    MULTI_PREDICTOR="MULTI_PREDICTOR",
    TRAIN_INIT_PLAN_TYPE="TRAIN_INIT_PLAN_TYPE",
    TRAIN_PLAN_TYPE="TRAIN_PLAN_TYPE",
)
