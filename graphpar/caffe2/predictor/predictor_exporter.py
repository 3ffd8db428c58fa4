"""Caffe2's `predictor_exporter`: a predict net, its parameters and how to initialise them, in one file.

`save_to_db` writes a graphpar checkpoint (`graphpar.checkpoint`: safetensors, checksummed) holding the
parameters, with the MetaNetDef in its metadata: the predict net (`PREDICT_NET_TYPE`), a global init net
that `Load`s the parameters from the file (`GLOBAL_INIT_NET_TYPE`), a predict init net that fills the
inputs whose shapes were given (`PREDICT_INIT_NET_TYPE`), and the parameter, input and output names.
`load_from_db` reads it back, and `prepare_prediction_net` runs its init nets in the current workspace
and returns the predict net, created and ready to run. `db_type` is accepted for Caffe2's scripts: the
format is always graphpar's. The nets are stored in Caffe2's wire format, so these functions need
protobuf (`graphpar[caffe2]`).

The parameters are read from the workspace by name; an unscoped name the workspace lacks (the names
`data_parallel_model.ExtractPredictorNet` gives a trained model's params) from the first replica's blob
(`conv1_w` from `gpu_0/conv1_w`), as `checkpoint.save` does. docs/inference.md walks through it.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from graphpar.caffe2.predictor_constants import predictor_constants as pc
from graphpar.core.ir import DeviceOption, NetDef, OperatorDef
from graphpar.core.net import Net
from graphpar.runtime import checkpoint, workspace


@dataclass
class Entry:
    """One `key` -> `value` pair of a MetaNetDef (Caffe2's NetsMap / BlobsMap)."""

    key: str
    value: Any


@dataclass
class MetaNetDef:
    """Caffe2's MetaNetDef: `nets` (key -> NetDef) and `blobs` (key -> blob names)."""

    nets: list[Entry] = field(default_factory=list)
    blobs: list[Entry] = field(default_factory=list)


def _netdef(net: Any) -> NetDef | None:
    return net.Proto() if hasattr(net, "Proto") and not isinstance(net, NetDef) else net


@dataclass
class PredictorExportMeta:
    """What to export (Caffe2's PredictorExportMeta): the predict net, the parameter blobs it reads,
    its inputs and outputs, optional input `shapes` ({blob: shape}) and extra init nets.

    Raises:
        TypeError: parameters, inputs or outputs not lists of blob names.
    """

    predict_net: Any
    parameters: Iterable[str]
    inputs: Iterable[str]
    outputs: Iterable[str]
    shapes: Mapping[str, Iterable[int]] | None = None
    name: str = ""
    extra_init_net: Any = None
    global_init_net: Any = None
    net_type: str | None = None
    num_workers: int | None = None
    trainer_prefix: str | None = None

    def __post_init__(self) -> None:
        self.predict_net = _netdef(self.predict_net)
        for what in ("parameters", "inputs", "outputs"):
            value = getattr(self, what)
            if isinstance(value, str):
                raise TypeError(f"PredictorExportMeta: {what} must be a list of blob names, not the string {value!r}")
            setattr(self, what, sorted(str(b) for b in value) if what == "parameters" else [str(b) for b in value])
        self.shapes = {str(k): [int(d) for d in v] for k, v in (self.shapes or {}).items()}


def get_meta_net_def(meta: PredictorExportMeta, db_destination: str) -> MetaNetDef:
    """The MetaNetDef of `meta` whose global init net loads the parameters from `db_destination`."""
    load = OperatorDef("Load", [], list(meta.parameters), {"db": os.path.abspath(db_destination),
                                                             "absolute_path": True})
    extra_global = _netdef(meta.global_init_net)
    global_init = NetDef("global_init_net", [*(extra_global.ops if extra_global else []), load])
    fills = [OperatorDef("ConstantFill", [], [name], {"shape": list(shape), "value": 0.0})
             for name, shape in (meta.shapes or {}).items() if name in meta.inputs]
    extra = _netdef(meta.extra_init_net)
    predict_init = NetDef("predict_init_net", [*(extra.ops if extra else []), *fills])
    predict = meta.predict_net
    if meta.net_type is not None:
        predict.type = meta.net_type
    if meta.num_workers is not None:
        predict.num_workers = meta.num_workers
    nets = [Entry(pc.GLOBAL_INIT_NET_TYPE, global_init), Entry(pc.PREDICT_INIT_NET_TYPE, predict_init),
            Entry(pc.PREDICT_NET_TYPE, predict)]
    blobs = [Entry(pc.PARAMETERS_BLOB_TYPE, list(meta.parameters)), Entry(pc.INPUTS_BLOB_TYPE, list(meta.inputs)),
             Entry(pc.OUTPUTS_BLOB_TYPE, list(meta.outputs))]
    return MetaNetDef(nets, blobs)


def save_to_db(db_type: str, db_destination: str, predictor_export_meta: PredictorExportMeta,
               use_ideep: bool = False, *args: Any, **kwargs: Any) -> None:
    """Write the parameters of the current workspace and the MetaNetDef to `db_destination`, atomically.

    Raises:
        CheckpointError: a parameter blob does not exist, under its name or (unscoped) in the first
            replica (nothing is written).
    """
    meta = get_meta_net_def(predictor_export_meta, db_destination)
    encoded = {"nets": {e.key: base64.b64encode(e.value.SerializeToString()).decode() for e in meta.nets},
               "blobs": {e.key: e.value for e in meta.blobs}, "db_type": db_type}
    checkpoint.save(db_destination, predictor_export_meta.parameters, metadata={pc.META_NET_DEF: encoded})


def load_from_db(filename: str, db_type: str, device_option: DeviceOption | None = None, *args: Any,
                 **kwargs: Any) -> MetaNetDef:
    """The MetaNetDef saved in `filename` by `save_to_db` (the global init net loads from `filename`); with
    `device_option`, every op of every net is placed there.

    Raises:
        CheckpointError: not a checkpoint, or one without an exported predictor.
    """
    stored = checkpoint.read_metadata(filename).get("metadata", {}).get(pc.META_NET_DEF)
    if stored is None:
        raise checkpoint.CheckpointError(f"load_from_db: {filename!r} is a checkpoint without an exported "
                                         f"predictor (write it with predictor_exporter.save_to_db)")
    nets = []
    for key, data in stored["nets"].items():
        net = NetDef()
        net.ParseFromString(base64.b64decode(data))
        for op in net.ops:
            if op.type == "Load":
                op.args["db"] = os.path.abspath(filename)
            if device_option is not None:
                op.device_option = device_option
        nets.append(Entry(key, net))
    return MetaNetDef(nets, [Entry(k, list(v)) for k, v in stored["blobs"].items()])


def prepare_prediction_net(filename: str, db_type: str, device_option: DeviceOption | None = None) -> Net:
    """Caffe2's `prepare_prediction_net`: load the predictor `save_to_db` wrote to `filename` into the
    current workspace (its global init net loads the parameters, its predict init net fills the inputs
    whose shapes were exported) and return its predict net, created: feed the inputs, then
    `workspace.RunNet(net)` and fetch the outputs. With `device_option`, every op runs there.

    Raises:
        CheckpointError: as `load_from_db`. Workspace errors of the runs propagate.
    """
    meta = load_from_db(filename, db_type, device_option)
    nets = {e.key: e.value for e in meta.nets}
    workspace.RunNetOnce(nets[pc.GLOBAL_INIT_NET_TYPE])
    workspace.RunNetOnce(nets[pc.PREDICT_INIT_NET_TYPE])
    predict_net = Net(nets[pc.PREDICT_NET_TYPE])
    workspace.CreateNet(predict_net)
    return predict_net
