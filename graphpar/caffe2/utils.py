"""Caffe2's `caffe2.python.utils`: the names scripts and optimizers import from it.

Conversions between numpy arrays and Caffe2's `TensorProto` and `Argument` messages need protobuf
(`pip install graphpar[caffe2]`); they work on `graphpar.caffe2.proto.caffe2_pb2`'s messages. Ops and
arguments also come as graphpar's own (`core.OperatorDef`, `op.arg`), which `OpAlmostEqual` and
`ArgsToDict` take too.
"""

from __future__ import annotations

import functools
import logging
import pdb
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from graphpar.core.ir import CPU, DeviceOption, OperatorDef
from graphpar.core.naming import OPTIMIZER_ITERATION
from graphpar.core.scope import DeviceScope
from graphpar.runtime import workspace

log = logging.getLogger(__name__)

OPTIMIZER_ITERATION_NAME = OPTIMIZER_ITERATION  # "optimizer_iteration"
ITERATION_MUTEX_NAME = "iteration_mutex"

# TensorProto.DataType code -> (numpy dtype, the TensorProto field that holds the values), as Caffe2's
_TENSOR_TYPES = {1: (np.float32, "float_data"), 13: (np.float64, "double_data"), 2: (np.int32, "int32_data"),
                 9: (np.int16, "int32_data"), 11: (np.uint16, "int32_data"), 7: (np.int8, "int32_data"),
                 6: (np.uint8, "int32_data"), 10: (np.int64, "int64_data"), 5: (np.bool_, "int32_data")}
_NUMPY_TYPES = {np.dtype(dtype): code for code, (dtype, _) in _TENSOR_TYPES.items()}


def _pb2() -> Any:
    from graphpar.caffe2.proto import caffe2_pb2

    return caffe2_pb2


def Caffe2TensorToNumpyArray(tensor: Any) -> np.ndarray:  # noqa: N802 - Caffe2 name
    """A `TensorProto`'s values as a numpy array of its dims (Caffe2's types, and int64 and bool).

    Raises:
        RuntimeError: another data type (as Caffe2).
    """
    if tensor.data_type not in _TENSOR_TYPES:
        raise RuntimeError(f"Tensor data type not supported yet: {tensor.data_type}")
    dtype, field = _TENSOR_TYPES[tensor.data_type]
    return np.asarray(getattr(tensor, field), dtype=dtype).reshape(tuple(tensor.dims))


def NumpyArrayToCaffe2Tensor(arr: np.ndarray, name: str | None = None) -> Any:  # noqa: N802 - Caffe2 name
    """A `caffe2_pb2.TensorProto` holding `arr` (float32/64, int8/16/32/64, uint8/16, bool).

    Raises:
        RuntimeError: another dtype (as Caffe2).
    """
    arr = np.asarray(arr)
    code = _NUMPY_TYPES.get(arr.dtype)
    if code is None:
        raise RuntimeError(f"Numpy data type not supported yet: {arr.dtype}")
    tensor = _pb2().TensorProto()
    tensor.dims.extend(arr.shape)
    if name:
        tensor.name = name
    tensor.data_type = code
    getattr(tensor, _TENSOR_TYPES[code][1]).extend(arr.reshape(-1).tolist())
    return tensor


def CaffeBlobToNumpyArray(blob: Any) -> np.ndarray:  # noqa: N802 - Caffe2 name
    """A (legacy) Caffe `BlobProto`'s data as a float32 array of its shape."""
    if getattr(blob, "num", 0):
        return np.asarray(blob.data, dtype=np.float32).reshape(blob.num, blob.channels, blob.height, blob.width)
    return np.asarray(blob.data, dtype=np.float32).reshape(tuple(blob.shape.dim))


def MakeArgument(key: str, value: Any) -> Any:  # noqa: N802 - Caffe2 name
    """A `caffe2_pb2.Argument` named `key` holding `value` in the field its type selects (Caffe2's rules:
    float -> f, int and bool -> i, bytes and str -> s, a NetDef -> n, a message -> its bytes, and lists
    of those -> floats, ints, strings, nets).

    Raises:
        ValueError: a value of another type, or a list mixing types.
    """
    pb2 = _pb2()
    argument = pb2.Argument()
    argument.name = key
    if isinstance(value, np.ndarray):
        value = value.reshape(-1).tolist()
    elif isinstance(value, np.generic):
        value = value.item()
    if type(value) is float:
        argument.f = value
    elif type(value) in (int, bool):
        argument.i = int(value)
    elif isinstance(value, (bytes, str)):
        argument.s = value.encode("utf-8") if isinstance(value, str) else value
    elif isinstance(value, pb2.NetDef):
        argument.n.CopyFrom(value)
    elif hasattr(value, "SerializeToString") and hasattr(value, "DESCRIPTOR"):
        argument.s = value.SerializeToString()
    elif isinstance(value, Iterable):
        _extend(argument, key, list(value), pb2)
    else:
        raise ValueError(f"Unknown argument type: key={key} value={value!r}, value type={type(value)}")
    return argument


def _extend(argument: Any, key: str, values: list, pb2: Any) -> None:
    """The repeated field of `argument` that a list of `values` fills."""
    values = [v.item() if isinstance(v, np.generic) else v for v in values]
    if all(type(v) is float for v in values):
        argument.floats.extend(values)
    elif all(type(v) in (int, bool) for v in values):
        argument.ints.extend(int(v) for v in values)
    elif all(isinstance(v, (bytes, str)) for v in values):
        argument.strings.extend(v.encode("utf-8") if isinstance(v, str) else v for v in values)
    elif all(isinstance(v, pb2.NetDef) for v in values):
        argument.nets.extend(values)
    elif all(hasattr(v, "SerializeToString") for v in values):
        argument.strings.extend(v.SerializeToString() for v in values)
    else:
        raise ValueError(f"Unknown iterable argument type: key={key} value={values!r}, value type="
                         f"{set(type(v) for v in values)}")


def ArgsToDict(args: Iterable[Any]) -> dict[str, Any]:  # noqa: N802 - Caffe2 name
    """{name: value} of a list of arguments (`caffe2_pb2.Argument`s, or graphpar's `op.arg`); an argument
    without a name is skipped, one without a value maps to None."""
    result: dict[str, Any] = {}
    for arg in args:
        if not arg.name:
            continue
        if not hasattr(arg, "DESCRIPTOR"):  # graphpar's view of op.args
            result[arg.name] = arg.value
            continue
        result[arg.name] = None
        for field in arg.DESCRIPTOR.fields:
            value = getattr(arg, field.name)
            if field.name != "name" and (len(value) > 0 if _repeated(field) else arg.HasField(field.name)):
                result[arg.name] = value
                break
    return result


def _repeated(field: Any) -> bool:
    """Whether a protobuf field is repeated (`is_repeated` in protobuf >= 5, `label` before)."""
    repeated = getattr(field, "is_repeated", None)
    return bool(repeated) if repeated is not None else field.label == field.LABEL_REPEATED


def OpAlmostEqual(op_a: Any, op_b: Any, ignore_fields: str | list[str] | None = None) -> bool:  # noqa: N802
    """Whether two ops (graphpar's or `caffe2_pb2` messages) are equal but for the `ignore_fields`
    (Caffe2's field names: 'name', 'device_option', 'arg', 'engine', ...). Where a graphpar op was
    recorded (its `debug_info`) is not part of the op."""
    fields = [ignore_fields] if isinstance(ignore_fields, str) else list(ignore_fields or [])
    from graphpar.caffe2.proto.convert import to_proto

    def cleaned(op: Any) -> Any:
        message = _pb2().OperatorDef()
        message.CopyFrom(to_proto(op) if isinstance(op, OperatorDef) else op)
        if isinstance(op, OperatorDef):
            message.ClearField("debug_info")
        for field in fields:
            message.ClearField(field)
        return message

    return bool(cleaned(op_a) == cleaned(op_b))


def BuildUniqueMutexIter(init_net: Any, net: Any, iter: str | None = None,  # noqa: N802, A002 - Caffe2's names
                         iter_mutex: str | None = None, iter_val: int = 0) -> Any:
    """The iteration counter `iter` (default `optimizer_iteration`): on first use, an int64 [1] blob
    `iter_val` and a mutex in `init_net`, and an `AtomicIter` of it in `net`, all on the CPU (Caffe2's).
    Returns the counter's BlobReference."""
    name = iter if iter is not None else OPTIMIZER_ITERATION_NAME
    if init_net.BlobIsDefined(name):
        return init_net.GetBlobRef(name)
    with DeviceScope(DeviceOption(CPU)):
        iteration = init_net.ConstantFill([], name, shape=[1], value=iter_val, dtype="int64")
        mutex = init_net.CreateMutex([], [iter_mutex if iter_mutex is not None else ITERATION_MUTEX_NAME])
        net.AtomicIter([mutex, iteration], [iteration])
    return iteration


def ResetBlobs(blobs: Iterable[str]) -> None:  # noqa: N802 - Caffe2 name
    """Free the contents of `blobs` in the current workspace: each then exists and holds nothing (Caffe2's
    `Free` op; a net may read it once it is fed again).

    Raises:
        MissingBlobError: a blob does not exist (the others are then left as they were).
    """
    ws = workspace.get_workspace()
    names = [str(b) for b in blobs]
    for name in names:
        if not ws.has_blob(name):
            ws.fetch_tensor(name)  # raises MissingBlobError naming it
    for name in names:
        ws.remove_blob(name)
        ws.create_blob(name)


def GetGPUMemoryUsageStats() -> dict[str, Any]:  # noqa: N802 - Caffe2 name
    """Per GPU the bytes allocated now and at most so far (torch's allocator, which graphpar's tensors
    use), and their sums: {'total_by_gpu', 'max_by_gpu', 'total', 'max_total'}; empty arrays without GPUs."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    total = np.array([torch.cuda.memory_allocated(d) for d in range(count)], dtype=np.int64)
    peak = np.array([torch.cuda.max_memory_allocated(d) for d in range(count)], dtype=np.int64)
    return {"total_by_gpu": total, "max_by_gpu": peak, "total": int(total.sum()), "max_total": int(peak.sum())}


def raiseIfNotEqual(a: Any, b: Any, msg: str) -> None:  # noqa: N802 - Caffe2 name
    """Raise Exception(f"{msg}. {a} != {b}") unless a == b."""
    if a != b:
        raise Exception(f"{msg}. {a} != {b}")  # noqa: TRY002 - Caffe2's type


class DebugMode:
    """`DebugMode.run(main)`: an exception other than KeyboardInterrupt drops into the post-mortem debugger."""

    @classmethod
    def run(cls, func: Callable[[], Any]) -> Any:
        try:
            return func()
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - the point of it
            log.error("Entering the interactive debugger (bt: the stack, help: the commands): %s", exc)
            pdb.post_mortem()
            sys.exit(1)


def debug(f: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate `f` with DebugMode."""
    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return DebugMode.run(lambda: f(*args, **kwargs))
    return wrapper


def EnumClassKeyVals(cls: type) -> dict[str, str]:  # noqa: N802 - Caffe2 name
    """{KEY: value} of a class's upper-case str attributes.

    Raises:
        TypeError: `cls` is not a class. ValueError: two keys share a value.
    """
    if not isinstance(cls, type):
        raise TypeError(f"EnumClassKeyVals needs a class, got {cls!r}")
    enum: dict[str, str] = {}
    for key in dir(cls):
        value = getattr(cls, key)
        if key == key.upper() and isinstance(value, str):
            if value in enum.values():
                raise ValueError(f"Failed to resolve {cls} as Enum: duplicate entries for {value!r}")
            enum[key] = value
    return enum


def NHWC2NCHW(tensor: np.ndarray) -> np.ndarray:  # noqa: N802 - Caffe2 name
    """The last axis moved to position 1."""
    return tensor.transpose((0, tensor.ndim - 1, *range(1, tensor.ndim - 1)))


def NCHW2NHWC(tensor: np.ndarray) -> np.ndarray:  # noqa: N802 - Caffe2 name
    """Axis 1 moved to the end."""
    return tensor.transpose((0, *range(2, tensor.ndim), 1))


def TryReadProtoWithClass(cls: Any, s: str | bytes) -> Any:  # noqa: N802 - Caffe2 name
    """A message of protobuf class `cls` from text format, else from its binary encoding.

    Raises:
        google.protobuf.message.DecodeError: neither.
    """
    from google.protobuf import text_format

    obj = cls()
    try:
        text_format.Parse(s, obj)
    except (text_format.ParseError, UnicodeDecodeError, TypeError):
        obj.ParseFromString(s if isinstance(s, bytes) else s.encode())
    return obj


def GetContentFromProto(obj: Any, function_map: Mapping[type, Callable[[Any], Any]]) -> Any:  # noqa: N802
    """`function_map[type(obj)](obj)`, or None when no class matches."""
    for cls, func in function_map.items():
        if type(obj) is cls:
            return func(obj)
    return None


def GetContentFromProtoString(s: str | bytes, function_map: Mapping[type, Callable[[Any], Any]]) -> Any:  # noqa: N802
    """The first class of `function_map` that parses `s`, its function applied.

    Raises:
        google.protobuf.message.DecodeError: no class fits.
    """
    from google.protobuf.message import DecodeError

    for cls, func in function_map.items():
        try:
            return func(TryReadProtoWithClass(cls, s))
        except DecodeError:
            continue
    raise DecodeError("Cannot find a fit protobuffer class.")


def ConvertProtoToBinary(proto_class: Any, filename: str, out_filename: str) -> None:  # noqa: N802
    """Write the text-format message of `filename` to `out_filename` in binary."""
    with open(filename) as text:
        proto = TryReadProtoWithClass(proto_class, text.read())
    with open(out_filename, "wb") as out:
        out.write(proto.SerializeToString())
