"""The IR, scopes, the Net builder, graph views and autodiff (Caffe2's `core`)."""

from graphpar.core.ir import (
    CPU,
    CUDA,
    BlobReference,
    DeviceOption,
    DeviceType,
    GradientSlice,
    NetDef,
    OperatorDef,
    device_option_equal,
)
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
    "CPU", "CUDA", "BlobReference", "CreateOperator", "CurrentDeviceScope", "CurrentNameScope",
    "DeviceOption", "DeviceScope", "DeviceType", "GradientSlice", "NameScope", "Net", "NetDef",
    "OperatorDef", "ScopedBlobReference", "ScopedName", "device_option_equal",
]
