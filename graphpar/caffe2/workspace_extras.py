"""The Caffe2 functions of `graphpar.workspace` that are not about the workspace itself (it
re-exports them): aliases and loops over its functions, protobuf strings, `Predictor` (runs a model-zoo
`init_net` / `predict_net` pair), and the process shims `GlobalInit` and `C`."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from graphpar.core.ir import OperatorDef
from graphpar.core.scope import CurrentNameScope
from graphpar.platform.devices import num_cuda_devices
from graphpar.runtime.workspace import (
    FetchBlob,
    GpuDeviceType,
    RunOperatorOnce,
    Workspace,
    _as_netdef,
    get_workspace,
)


def NumGpuDevices() -> int:  # noqa: N802
    """Caffe2's name for NumCudaDevices."""
    return num_cuda_devices()


def IsGPUDeviceType(device_type: int) -> bool:  # noqa: N802
    """Whether `device_type` is the GPU type (CUDA)."""
    return device_type == GpuDeviceType


def FetchTorch(name: str) -> torch.Tensor:  # noqa: N802
    """Caffe2's name for FetchTensor: the live torch tensor of blob `name`."""
    return get_workspace().fetch_tensor(name)


def FetchBlobs(names: list[str]) -> list[np.ndarray]:  # noqa: N802
    """FetchBlob for each name, in order."""
    return [FetchBlob(name) for name in names]


def RunOperatorsOnce(ops: list[OperatorDef]) -> bool:  # noqa: N802
    """RunOperatorOnce for each op, in order; returns True."""
    for op in ops:
        RunOperatorOnce(op)
    return True


def StringifyBlobName(name: str) -> str:  # noqa: N802
    """The blob name as a str (BlobReference or str)."""
    return str(name)


def StringifyNetName(net: Any) -> str:  # noqa: N802
    """The name of a Net, NetDef or str."""
    return net if isinstance(net, str) else _as_netdef(net).name


def GetNameScope() -> str:  # noqa: N802
    """The current NameScope ('gpu_0/' inside NameScope('gpu_0'))."""
    return CurrentNameScope()


def StringifyProto(obj: Any) -> str | bytes:  # noqa: N802
    """A str or bytes as is; a Net, NetDef or OperatorDef (or a caffe2_pb2 message) serialized in Caffe2's
    wire format, as Caffe2's `SerializeToString()` (needs protobuf)."""
    if isinstance(obj, (str, bytes)):
        return obj
    if hasattr(obj, "Proto"):
        obj = obj.Proto()
    if not hasattr(obj, "SerializeToString"):
        raise ValueError(f"Unexpected argument to StringifyProto of type {type(obj).__name__}")
    return obj.SerializeToString()


class Predictor:
    """Caffe2's `workspace.Predictor(init_net, predict_net)`: a private workspace where `init_net` has run;
    `run(inputs)` feeds the predict net's external inputs that the init net did not create (a list in
    their order, or a {name: value} dict), runs it and returns its external outputs as numpy arrays.
    Either net may be a Net, NetDef, caffe2_pb2.NetDef or its serialized bytes."""

    _count = 0

    def __init__(self, init_net: Any, predict_net: Any) -> None:
        Predictor._count += 1
        self._ws = Workspace(f"Predictor#{Predictor._count}")
        self._net = _as_netdef(predict_net)
        self._ws.run_net_once(_as_netdef(init_net))
        self.input_names = [b for b in self._net.external_inputs if not self._ws.has_blob(b)]
        self.output_names = list(self._net.external_outputs)

    def run(self, inputs: list | dict) -> list[np.ndarray]:
        """The external outputs after one run on `inputs`. Raises ValueError for a wrong input count."""
        if not isinstance(inputs, dict):
            if len(inputs) != len(self.input_names):
                raise ValueError(f"Predictor.run: expected {len(self.input_names)} inputs "
                                 f"{self.input_names}, got {len(inputs)}")
            inputs = dict(zip(self.input_names, inputs))
        for name, value in inputs.items():
            self._ws.feed_blob(name, value)
        self._ws.run_net_once(self._net)
        return [self._ws.fetch_blob(name) for name in self.output_names]


def RunOperatorMultiple(op: OperatorDef, num_runs: int) -> bool:  # noqa: N802
    """Run one OperatorDef `num_runs` times; returns True."""
    for _ in range(num_runs):
        RunOperatorOnce(op)
    return True


# Caffe2's C++ binding module, as far as its Python tests read it (build flags). graphpar has no C++
# Workspace/Blob/Tensor objects: use this module's functions (docs/caffe2_tests.md).
C = SimpleNamespace(use_mkldnn=False, use_ideep=False, has_mkldnn=False, is_asan=False)


def GlobalInit(args: list[str]) -> bool:  # noqa: N802
    """Accept Caffe2's process flags (`--caffe2_log_level=...`); graphpar has none, so they are logged."""
    if args[1:]:
        logging.getLogger(__name__).info("GlobalInit: Caffe2 flags have no effect here: %s", args[1:])
    return True
