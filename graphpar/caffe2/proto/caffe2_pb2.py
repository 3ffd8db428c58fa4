"""Caffe2's `caffe2.proto` messages, built at import time with the protobuf package (no protoc step).

The messages a Caffe2 script or model file uses: `TensorProto` (with its `DataType` codes),
`TensorProtos`, `Argument`, `DeviceOption`, `OperatorDef`, `NetDef`, `ExecutionStep`, `PlanDef` and
`BlobProto`, with Caffe2's
field names and numbers, so `.pb` files Caffe2 wrote (model zoo `init_net.pb` / `predict_net.pb`)
parse here and files written here load in Caffe2. Fields graphpar has no use for (quantized
tensors, partition info) are left out; parsing a file that has them keeps them
as unknown fields. Device type constants: CPU, CUDA, MKLDNN, OPENGL, OPENCL, IDEEP, HIP.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto
_OPT, _REP, _REQ = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED, _F.LABEL_REQUIRED
_SCALARS = {"string": _F.TYPE_STRING, "bytes": _F.TYPE_BYTES, "float": _F.TYPE_FLOAT, "double": _F.TYPE_DOUBLE,
            "int32": _F.TYPE_INT32, "int64": _F.TYPE_INT64, "uint32": _F.TYPE_UINT32, "bool": _F.TYPE_BOOL}

# message -> [(label, type, name, number[, default])]; a type that is not a scalar names a message
# (or, for "TensorProto.DataType", the enum).
_MESSAGES: dict[str, list[tuple[Any, ...]]] = {
    "TensorProto": [
        (_REP, "int64", "dims", 1), (_OPT, "TensorProto.DataType", "data_type", 2, "FLOAT"),
        (_REP, "float", "float_data", 3), (_REP, "int32", "int32_data", 4), (_OPT, "bytes", "byte_data", 5),
        (_REP, "bytes", "string_data", 6), (_REP, "double", "double_data", 9), (_REP, "int64", "int64_data", 10),
        (_OPT, "string", "name", 7), (_OPT, "DeviceOption", "device_detail", 8),
        (_OPT, "TensorProto.Segment", "segment", 11),
    ],
    "TensorProtos": [(_REP, "TensorProto", "protos", 1)],
    "Argument": [
        (_OPT, "string", "name", 1), (_OPT, "float", "f", 2), (_OPT, "int64", "i", 3), (_OPT, "bytes", "s", 4),
        (_OPT, "NetDef", "n", 8), (_REP, "float", "floats", 5), (_REP, "int64", "ints", 6),
        (_REP, "bytes", "strings", 7), (_REP, "NetDef", "nets", 9),
    ],
    "DeviceOption": [
        (_OPT, "int32", "device_type", 1, "0"), (_OPT, "int32", "device_id", 2), (_OPT, "uint32", "random_seed", 3),
        (_OPT, "string", "node_name", 4), (_OPT, "int32", "numa_node_id", 5), (_REP, "string", "extra_info", 6),
    ],
    "OperatorDef": [
        (_REP, "string", "input", 1), (_REP, "string", "output", 2), (_OPT, "string", "name", 3),
        (_OPT, "string", "type", 4), (_REP, "Argument", "arg", 5), (_OPT, "DeviceOption", "device_option", 6),
        (_OPT, "string", "engine", 7), (_REP, "string", "control_input", 8),
        (_OPT, "bool", "is_gradient_op", 9, "false"), (_OPT, "string", "debug_info", 10),
    ],
    "NetDef": [
        (_OPT, "string", "name", 1), (_REP, "OperatorDef", "op", 2), (_OPT, "string", "type", 3),
        (_OPT, "int32", "num_workers", 4), (_OPT, "DeviceOption", "device_option", 5),
        (_REP, "Argument", "arg", 6), (_REP, "string", "external_input", 7),
        (_REP, "string", "external_output", 8),
    ],
    "ExecutionStep": [
        (_OPT, "string", "name", 1), (_REP, "ExecutionStep", "substep", 2), (_REP, "string", "network", 3),
        (_OPT, "int64", "num_iter", 4), (_OPT, "string", "criteria_network", 5),
        (_OPT, "bool", "concurrent_substeps", 6), (_OPT, "string", "report_net", 7),
        (_OPT, "int32", "report_interval", 8), (_OPT, "string", "should_stop_blob", 9),
        (_OPT, "bool", "only_once", 10), (_OPT, "int64", "run_every_ms", 11),
        (_OPT, "bool", "create_workspace", 12), (_OPT, "int32", "num_concurrent_instances", 13),
    ],
    "PlanDef": [
        (_OPT, "string", "name", 1), (_REP, "NetDef", "network", 2), (_REP, "ExecutionStep", "execution_step", 3),
    ],
    "BlobProto": [
        (_OPT, "string", "name", 1), (_OPT, "string", "type", 2), (_OPT, "TensorProto", "tensor", 3),
        (_OPT, "bytes", "content", 4),
    ],
}
_DATA_TYPES = {"UNDEFINED": 0, "FLOAT": 1, "INT32": 2, "BYTE": 3, "STRING": 4, "BOOL": 5, "UINT8": 6, "INT8": 7,
               "UINT16": 8, "INT16": 9, "INT64": 10, "FLOAT16": 12, "DOUBLE": 13}
_DEVICE_TYPES = {"CPU": 0, "CUDA": 1, "MKLDNN": 2, "OPENGL": 3, "OPENCL": 4, "IDEEP": 5, "HIP": 6}


def _add_fields(message: descriptor_pb2.DescriptorProto, fields: list[tuple]) -> None:
    for label, kind, name, number, *default in fields:
        field = message.field.add(name=name, number=number, label=label)
        if kind in _SCALARS:
            field.type = _SCALARS[kind]
        elif kind == "TensorProto.DataType":
            field.type, field.type_name = _F.TYPE_ENUM, ".caffe2.TensorProto.DataType"
        else:
            field.type, field.type_name = _F.TYPE_MESSAGE, f".caffe2.{kind}"
        if default:
            field.default_value = default[0]


def _file() -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto(name="graphpar/caffe2.proto", package="caffe2", syntax="proto2")
    for name, fields in _MESSAGES.items():
        message = proto.message_type.add(name=name)
        _add_fields(message, fields)
        if name == "TensorProto":
            enum = message.enum_type.add(name="DataType")
            for value_name, number in _DATA_TYPES.items():
                enum.value.add(name=value_name, number=number)
            segment = message.nested_type.add(name="Segment")
            _add_fields(segment, [(_REQ, "int64", "begin", 1), (_REQ, "int64", "end", 2)])
    device_enum = proto.enum_type.add(name="DeviceTypeProto")
    for value_name, number in _DEVICE_TYPES.items():
        device_enum.value.add(name=f"PROTO_{value_name}", number=number)
    return proto


_POOL = descriptor_pool.DescriptorPool()  # a private pool: no clash with a real caffe2 install
_POOL.AddSerializedFile(_file().SerializeToString())
_CLASSES = message_factory.GetMessageClassesForFiles(["graphpar/caffe2.proto"], _POOL)

TensorProto = _CLASSES["caffe2.TensorProto"]
TensorProtos = _CLASSES["caffe2.TensorProtos"]
Argument = _CLASSES["caffe2.Argument"]
DeviceOption = _CLASSES["caffe2.DeviceOption"]
OperatorDef = _CLASSES["caffe2.OperatorDef"]
NetDef = _CLASSES["caffe2.NetDef"]
BlobProto = _CLASSES["caffe2.BlobProto"]
ExecutionStep = _CLASSES["caffe2.ExecutionStep"]
PlanDef = _CLASSES["caffe2.PlanDef"]

CPU, CUDA, MKLDNN, OPENGL, OPENCL, IDEEP, HIP = (_DEVICE_TYPES[k] for k in
                                                ("CPU", "CUDA", "MKLDNN", "OPENGL", "OPENCL", "IDEEP", "HIP"))
PROTO_CPU, PROTO_CUDA = CPU, CUDA
