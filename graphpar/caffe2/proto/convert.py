"""Conversion between graphpar's IR (`core.ir`) and Caffe2's protobuf messages, both ways.

`to_proto(x)` takes a NetDef, OperatorDef or DeviceOption (or a Net) and returns the `caffe2_pb2`
message; `from_proto(m)` does the reverse, and also accepts serialized bytes with `kind` naming the
message ("NetDef" or "OperatorDef"). Arguments map as Caffe2 stores them: bool/int -> i, float -> f,
str/bytes -> s (strings come back as str when they are UTF-8), lists -> ints/floats/strings, NetDef
-> n, lists of NetDefs -> nets; an empty list becomes `ints` and comes back as []. `source` travels
as `debug_info`. Raises TypeError for an argument value with no Caffe2 encoding.
"""

from __future__ import annotations

from typing import Any

from graphpar.caffe2.proto import caffe2_pb2 as pb
from graphpar.core.ir import DeviceOption, NetDef, OperatorDef


def to_proto(obj: Any) -> Any:
    """The caffe2_pb2 message for a graphpar NetDef, Net, OperatorDef or DeviceOption."""
    if hasattr(obj, "Proto") and not isinstance(obj, (NetDef, OperatorDef)):
        obj = obj.Proto()
    if isinstance(obj, NetDef):
        return _net_to_proto(obj)
    if isinstance(obj, OperatorDef):
        return _op_to_proto(obj)
    if isinstance(obj, DeviceOption):
        return _device_to_proto(obj)
    raise TypeError(f"to_proto takes a NetDef, Net, OperatorDef or DeviceOption, got {type(obj).__name__}")


def from_proto(message: Any, kind: str = "NetDef") -> Any:
    """The graphpar NetDef / OperatorDef / DeviceOption for a caffe2_pb2 message (or its bytes)."""
    if isinstance(message, (bytes, bytearray)):
        if kind not in ("NetDef", "OperatorDef"):
            raise ValueError(f"from_proto: kind must be 'NetDef' or 'OperatorDef', got {kind!r}")
        parsed = getattr(pb, kind)()
        parsed.ParseFromString(bytes(message))
        message = parsed
    if isinstance(message, pb.NetDef):
        return _net_from_proto(message)
    if isinstance(message, pb.OperatorDef):
        return _op_from_proto(message)
    if isinstance(message, pb.DeviceOption):
        return _device_from_proto(message)
    raise TypeError(f"from_proto takes a caffe2_pb2 NetDef, OperatorDef or DeviceOption (or bytes), got "
                    f"{type(message).__name__}")


def is_proto(obj: Any) -> bool:
    """Whether `obj` is one of the caffe2_pb2 messages `from_proto` converts."""
    return isinstance(obj, (pb.NetDef, pb.OperatorDef, pb.DeviceOption))


def _device_to_proto(device: DeviceOption) -> Any:
    return pb.DeviceOption(device_type=int(device.device_type), device_id=device.device_id,
                           **({"node_name": device.node_name} if device.node_name else {}))


def _device_from_proto(message: Any) -> DeviceOption:
    if message.device_type not in (pb.CPU, pb.CUDA):
        raise ValueError(f"device type {message.device_type} is not supported (graphpar runs on CPU=0 and "
                         f"CUDA=1)")
    return DeviceOption(message.device_type, message.device_id, node_name=message.node_name)


def _set_arg(arg: Any, value: Any, where: str) -> None:
    if isinstance(value, NetDef):
        arg.n.CopyFrom(_net_to_proto(value))
    elif isinstance(value, (bool, int)):
        arg.i = int(value)
    elif isinstance(value, float):
        arg.f = value
    elif isinstance(value, (str, bytes)):
        arg.s = value.encode() if isinstance(value, str) else value
    elif isinstance(value, (list, tuple)):
        _set_list_arg(arg, list(value), where)
    else:
        raise TypeError(f"{where}: argument {arg.name!r} = {value!r} has no Caffe2 encoding")


def _set_list_arg(arg: Any, values: list, where: str) -> None:
    if all(isinstance(v, NetDef) for v in values) and values:
        arg.nets.extend(_net_to_proto(v) for v in values)
    elif all(isinstance(v, (bool, int)) for v in values):
        arg.ints.extend(int(v) for v in values)
    elif all(isinstance(v, (bool, int, float)) for v in values):
        arg.floats.extend(float(v) for v in values)
    elif all(isinstance(v, (str, bytes)) for v in values):
        arg.strings.extend(v.encode() if isinstance(v, str) else v for v in values)
    else:
        raise TypeError(f"{where}: argument {arg.name!r} = {values!r} mixes kinds Caffe2 cannot store")


def _text(value: bytes) -> str | bytes:
    try:
        return value.decode()
    except UnicodeDecodeError:
        return value


def _arg_value(arg: Any) -> Any:
    for field in ("f", "i", "s", "n"):
        if arg.HasField(field):
            value = getattr(arg, field)
            return _text(value) if field == "s" else _net_from_proto(value) if field == "n" else value
    if arg.floats:
        return list(arg.floats)
    if arg.strings:
        return [_text(s) for s in arg.strings]
    if arg.nets:
        return [_net_from_proto(n) for n in arg.nets]
    return list(arg.ints)


def _op_to_proto(op: OperatorDef) -> Any:
    optional = {"name": op.name, "engine": op.engine, "is_gradient_op": op.is_gradient_op, "debug_info": op.source}
    message = pb.OperatorDef(type=op.type, input=op.inputs, output=op.outputs, control_input=op.control_inputs,
                             **{k: v for k, v in optional.items() if v})
    for name, value in op.args.items():
        _set_arg(message.arg.add(name=name), value, f"operator {op.type}")
    if op.device_option is not None:
        message.device_option.CopyFrom(_device_to_proto(op.device_option))
    return message


def _op_from_proto(message: Any) -> OperatorDef:
    return OperatorDef(message.type, list(message.input), list(message.output),
                       {arg.name: _arg_value(arg) for arg in message.arg},
                       _device_from_proto(message.device_option) if message.HasField("device_option") else None,
                       message.name, message.engine, list(message.control_input), message.is_gradient_op,
                       message.debug_info)


def _net_to_proto(net: NetDef) -> Any:
    message = pb.NetDef(name=net.name, type=net.type, num_workers=net.num_workers,
                        op=[_op_to_proto(op) for op in net.ops], external_input=net.external_inputs,
                        external_output=net.external_outputs)
    for name, value in net.args.items():
        _set_arg(message.arg.add(name=name), value, f"net {net.name!r}")
    if net.device_option is not None:
        message.device_option.CopyFrom(_device_to_proto(net.device_option))
    return message


def _net_from_proto(message: Any) -> NetDef:
    return NetDef(message.name, [_op_from_proto(op) for op in message.op], list(message.external_input),
                  list(message.external_output), message.type or "simple", max(message.num_workers, 1),
                  _device_from_proto(message.device_option) if message.HasField("device_option") else None,
                  {arg.name: _arg_value(arg) for arg in message.arg})
