"""Caffe2's `predictor_py_utils`: read the nets and blob lists of a MetaNetDef."""

from __future__ import annotations

from graphpar.caffe2.predictor.predictor_exporter import MetaNetDef
from graphpar.core.ir import NetDef


def GetNet(meta_net_def: MetaNetDef, key: str) -> NetDef:  # noqa: N802 - Caffe2's name
    """The net stored under `key` (e.g. predictor_constants.PREDICT_NET_TYPE).

    Raises:
        KeyError: no net has that key.
    """
    for entry in meta_net_def.nets:
        if entry.key == key:
            return entry.value
    raise KeyError(f"GetNet: the MetaNetDef has no net {key!r}; it has {[e.key for e in meta_net_def.nets]}")


def GetBlobs(meta_net_def: MetaNetDef, key: str) -> list[str]:  # noqa: N802 - Caffe2's name
    """The blob names stored under `key` (e.g. predictor_constants.PARAMETERS_BLOB_TYPE); [] if none."""
    return next((list(entry.value) for entry in meta_net_def.blobs if entry.key == key), [])
