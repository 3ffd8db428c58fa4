"""The IR, scopes, the Net builder, graph views and autodiff (Caffe2's `core`).

Core imports neither the operator library nor Caffe2's layer: the package root provides the operators,
the protobuf conversion and Caffe2's execution plans (`graphpar._providers`); `core.Plan` and
`core.ExecutionStep` are those of `graphpar.caffe2.plan`.
"""

from typing import Any

from graphpar import _providers
from graphpar.core.ir import (
    CPU,
    CUDA,
    Argument,
    BlobReference,
    DataType,
    DeviceOption,
    DeviceType,
    GradientSlice,
    NetDef,
    OperatorDef,
    device_option_equal,
)
from graphpar.core.ir import same_device as device_equal
from graphpar.core.net import CreateOperator, Net
from graphpar.core.scope import (
    CurrentDeviceScope,
    CurrentNameScope,
    DeviceScope,
    NameScope,
    ScopedBlobReference,
    ScopedName,
)

__all__ = [
    "CPU", "CUDA", "Argument", "BlobReference", "DataType", "InferBlobDevices", "IsGPUDeviceType", "IsOperator",
    "IsOperatorWithEngine", "device_equal", "get_net_name", "output_to_list", "CreateOperator", "CurrentDeviceScope", "CurrentNameScope",
    "DeviceOption", "DeviceScope", "DeviceType", "GradientSlice", "NameScope", "Net", "NetDef",
    "OperatorDef", "ScopedBlobReference", "ScopedName", "device_option_equal", "ExecutionStep", "Plan",
    "InjectCrossDeviceCopies",
]


def __getattr__(name: str) -> Any:
    """`core.Plan` and `core.ExecutionStep` (Caffe2's execution plans, provided by the package root), and
    `core._REGISTERED_OPERATORS`, read when asked for (registering loads the operator library)."""
    if name in ("Plan", "ExecutionStep"):
        return getattr(_providers.caffe2_plans(), name)
    if name == "_REGISTERED_OPERATORS":  # Caffe2's set of registered op types, read by its tests
        from graphpar.core.schema import registered_types

        return frozenset(registered_types())
    raise AttributeError(f"module 'graphpar.core' has no attribute {name!r}")


def IsOperator(op_type: str) -> bool:  # noqa: N802 - Caffe2 name
    """Whether `op_type` is a registered operator."""
    from graphpar.core.schema import get_schema

    try:
        get_schema(op_type)
    except AttributeError:
        return False
    return True


ENGINES = frozenset({"", "DEFAULT", "CUDNN", "MKLDNN", "IDEEP", "NNPACK", "EIGEN", "CUDA", "NCCL"})


def IsOperatorWithEngine(op_type: str, engine: str) -> bool:  # noqa: N802 - Caffe2 name
    """Whether `op_type` is registered and `engine` is one of Caffe2's (ENGINES). Engines are hints
    graphpar accepts for every op: PyTorch picks the kernels."""
    return engine in ENGINES and IsOperator(op_type)


def IsGPUDeviceType(device_type: int) -> bool:  # noqa: N802 - Caffe2 name
    """Whether `device_type` is the GPU type (CUDA; graphpar has no HIP devices)."""
    return device_type == CUDA


def InferBlobDevices(net: Net | NetDef) -> dict[str, DeviceOption]:  # noqa: N802 - Caffe2 name
    """{blob: its device}: that of the first op reading or writing it (`core.graph.blob_devices`)."""
    from graphpar.core.graph import blob_devices

    return blob_devices(net.Proto() if isinstance(net, Net) else net)


def InjectCrossDeviceCopies(net: Net, blob_to_device: dict | None = None, blob_remap: dict | None = None,  # noqa: N802
                            placeHolderOps: list | None = None) -> tuple[Net, dict[str, DeviceOption]]:  # noqa: N803
    """Caffe2's pass that adds the copies a net's cross-device reads need. For a net whose ops all run on
    CPU it adds none, as Caffe2: it returns a copy of the net and {blob: device} (`blob_to_device`
    updated). graphpar records cross-device copies explicitly (and `Parallelize` places every blob), so
    a net with ops on other devices raises NotImplementedError. `blob_remap`, `placeHolderOps`:
    accepted (placeholder ops are kept as they are)."""
    netdef = net.Proto()
    devices = [netdef.op_device(op) for op in netdef.ops]
    if any(d.device_type != CPU for d in devices):
        raise NotImplementedError("InjectCrossDeviceCopies: only all-CPU nets are supported; record the "
                                  "Copy / CopyCPUToGPU ops explicitly (Parallelize places blobs itself)")
    mapping = dict(blob_to_device or {})
    for op, device in zip(netdef.ops, devices):
        mapping.update(dict.fromkeys([*op.inputs, *op.outputs], device))
    return net.Clone(f"{net.Name()}_cross_device"), mapping


def get_net_name(netlike: Any) -> str:
    """The name of a Net, NetDef or str."""
    if isinstance(netlike, str):
        return netlike
    return netlike.Name() if isinstance(netlike, Net) else netlike.name


def output_to_list(op_output: Any) -> list:
    """A recorded op's return value (None, one BlobReference or a tuple) as a list."""
    if op_output is None:
        return []
    return list(op_output) if isinstance(op_output, (list, tuple)) else [op_output]
