"""The IR: devices, blob references, operators and nets as plain, mutable data.

Passes edit `OperatorDef`s and `NetDef`s in place; nothing here knows schemas, kernels or workspaces.
`NetDef.validate()` checks the structure every pass must keep (the analogue of torch.fx's `lint`);
`core.schema.validate_net` adds the schema checks.
"""

from __future__ import annotations

import copy
from collections import namedtuple
from dataclasses import FrozenInstanceError, dataclass, field
from enum import IntEnum
from typing import Any

from graphpar import _providers


class DeviceType(IntEnum):
    """Where an operator runs: CPU or a CUDA device."""

    CPU = 0
    CUDA = 1


CPU = DeviceType.CPU
CUDA = DeviceType.CUDA


class DataType(IntEnum):
    """Caffe2's TensorProto.DataType codes that have a torch dtype (`dtype` arguments take them)."""

    FLOAT = 1
    INT32 = 2
    BYTE = 3
    BOOL = 5
    UINT8 = 6
    INT8 = 7
    INT16 = 9
    INT64 = 10
    FLOAT16 = 12
    DOUBLE = 13


@dataclass(unsafe_hash=True)
class DeviceOption:
    """A device placement: type (CPU or CUDA) and index, fixed once made, and hashable by them, so ops
    may share one and tables may be keyed by it. `node_name` (Caffe2's field, which placement ignores)
    may be assigned as on a protobuf message: `option.node_name = "trainer_1"`.

    Raises TypeError for a device type other than CPU/CUDA (or 0/1), a device id that is not a
    non-negative int, or a node name that is not a str; FrozenInstanceError (an AttributeError) for an
    assignment to device_type or device_id (build a new DeviceOption: ops may share this one).
    """

    device_type: DeviceType = CPU
    device_id: int = 0
    node_name: str = field(default="", compare=False)  # Caffe2's field; placement ignores it

    def __post_init__(self) -> None:
        if (not isinstance(self.device_type, int) or isinstance(self.device_type, bool)
                or int(self.device_type) not in (0, 1)):
            raise TypeError(f"device_type must be graphpar.core.CPU or CUDA, got {self.device_type!r}")
        if not isinstance(self.device_id, int) or isinstance(self.device_id, bool) or self.device_id < 0:
            raise TypeError(f"device_id must be a non-negative int, got {self.device_id!r}")
        object.__setattr__(self, "device_type", DeviceType(self.device_type))

    def __setattr__(self, name: str, value: Any) -> None:
        if name != "node_name" and name in self.__dict__:
            raise FrozenInstanceError(f"cannot assign to DeviceOption.{name}: the device of an option is fixed "
                                      f"(ops may share it and placement tables are keyed by it); make a new one, "
                                      f"e.g. DeviceOption({self.device_type.name}, {self.device_id})")
        if name == "node_name" and not isinstance(value, str):
            raise TypeError(f"DeviceOption.node_name must be a str, got {value!r}")
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        node = f", node_name={self.node_name!r}" if self.node_name else ""
        return f"DeviceOption({self.device_type.name}, {self.device_id}{node})"

    @property
    def cuda_gpu_id(self) -> int:
        """Caffe2's older name of `device_id`."""
        return self.device_id


def as_device_option(option: Any) -> Any:
    """A caffe2_pb2.DeviceOption (a protobuf message) as a DeviceOption; anything else unchanged."""
    if not hasattr(option, "DESCRIPTOR"):
        return option
    device_id = option.device_id if hasattr(option, "device_id") else option.cuda_gpu_id
    return DeviceOption(option.device_type, device_id, node_name=option.node_name)


def same_device(a: DeviceOption | None, b: DeviceOption | None) -> bool:
    """Whether two ops run on the same device (an unset option means CPU 0; CPU ids count)."""
    return (a or DeviceOption()) == (b or DeviceOption())


def device_option_equal(a: DeviceOption | None, b: DeviceOption | None, ignore_node_name: bool = True,
                        ignore_random_seed: bool = True) -> bool:
    """Caffe2's comparison: an unset option means CPU; CPU options are all equal whatever their id;
    node names count only with `ignore_node_name=False`. (graphpar's options have no random seed.)"""
    a, b = a or DeviceOption(), b or DeviceOption()
    if not ignore_node_name and a.node_name != b.node_name:
        return False
    if a.device_type == CPU or b.device_type == CPU:
        return a.device_type == b.device_type
    return a.device_id == b.device_id


GradientSlice = namedtuple("GradientSlice", ["indices", "values"])
GradientSlice.__doc__ = "A sparse gradient: rows `indices` of a parameter receive `values`."


class BlobReference(str):
    """A blob name (a `str` subclass: it hashes and compares as its name) that may know its net.

    `ref.Relu([], "y")` is sugar for `net.Relu([ref], "y")`.
    """

    __slots__ = ("_net",)
    _net: Any  # the Net it was recorded in, if any

    def __new__(cls, name: str, net: Any = None) -> BlobReference:
        if not isinstance(name, str):
            raise TypeError(f"a blob name must be a str, got {type(name).__name__}: {name!r}")
        self = super().__new__(cls, name)
        self._net = net
        return self

    def __repr__(self) -> str:
        return f"BlobReference({str.__repr__(self)})"

    def __add__(self, other: str) -> BlobReference:
        return BlobReference(str(self) + str(other), self._net)

    def __radd__(self, other: str) -> BlobReference:
        return BlobReference(str(other) + str(self), self._net)

    def Net(self) -> Any:  # noqa: N802 - Caffe2 name
        """The Net this reference was created by (None for a plain reference)."""
        return self._net

    def GetNameScope(self) -> str:  # noqa: N802
        """Everything up to and including the last '/' ('gpu_1/' for 'gpu_1/fc_w'), or ''."""
        cut = self.rfind("/")
        return str(self[: cut + 1]) if cut >= 0 else ""

    def GetUnscopedName(self) -> str:  # noqa: N802
        """The part after the last '/' ('fc_w' for 'gpu_1/fc_w')."""
        return str(self[self.rfind("/") + 1 :])

    def __getattr__(self, op_type: str) -> Any:
        """`ref.SomeOp` for a registered SomeOp on a reference bound to a net.

        Raises AttributeError otherwise; an unknown op type raises UnknownOperatorError (an
        AttributeError) naming close matches, so `hasattr(ref, "tolist")` is False.
        """
        if op_type.startswith("_") or self._net is None:
            raise AttributeError(f"{type(self).__name__} {str(self)!r} has no attribute {op_type!r}"
                                 + ("" if op_type.startswith("_") else " (it is bound to no Net)"))
        record = self._net._op_method(op_type)  # the Net checks the op type

        def make(inputs: Any = None, *args: Any, **kwargs: Any) -> Any:
            inputs = [] if inputs is None else ([inputs] if isinstance(inputs, str) else list(inputs))
            return record([self, *inputs], *args, **kwargs)

        return make


_SCALAR_ARGS = frozenset({int, float, bool, str, type(None)})


def _copy_arg(value: Any) -> Any:
    """An argument value a copied op may edit freely: lists are copied, NetDefs deep-copied."""
    if type(value) is list:
        return list(value)
    return copy.deepcopy(value) if isinstance(value, NetDef) else value


@dataclass(frozen=True)
class Argument:
    """A read-only view of one op argument under Caffe2's `Argument` field names (`op.arg`)."""

    name: str
    value: Any

    def _typed(self, kinds: tuple[type, ...], many: bool) -> Any:
        items = self.value if isinstance(self.value, (list, tuple)) else None
        if many:
            return list(items) if items is not None and all(isinstance(v, kinds) for v in items) else []
        return self.value if items is None and isinstance(self.value, kinds) else None

    f = property(lambda self: self._typed((float,), False), doc="The float value, else None.")
    i = property(lambda self: self._typed((int,), False), doc="The int (or bool) value, else None.")
    s = property(lambda self: _as_bytes(self._typed((str, bytes), False)),
                 doc="The string value as bytes (as Caffe2's protobuf field), else None.")
    n = property(lambda self: self._typed((NetDef,), False), doc="The NetDef value, else None.")
    floats = property(lambda self: self._typed((float,), True), doc="A list of floats, else [].")
    ints = property(lambda self: self._typed((int,), True), doc="A list of ints, else [].")
    strings = property(lambda self: [_as_bytes(v) for v in self._typed((str, bytes), True)],
                       doc="A list of strings as bytes, else [].")
    nets = property(lambda self: self._typed((NetDef,), True), doc="A list of NetDefs, else [].")

    def HasField(self, field_name: str) -> bool:  # noqa: N802 - protobuf's name
        """Whether the singular field `field_name` ('f', 'i', 's', 'n') holds the value."""
        return getattr(self, field_name) is not None


def _as_bytes(value: str | bytes | None) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


def _arguments(args: dict[str, Any]) -> list[Argument]:
    return [Argument(name, value) for name, value in args.items()]


def proto_converter() -> Any:
    """The module converting to and from Caffe2's protobuf messages (`to_proto`, `from_proto`), which
    the package root provides (`graphpar._providers`): the IR does not depend on protobuf."""
    return _providers.proto_converter()


class _MessageLike:
    """What graphpar's ops and nets share with Caffe2's protobuf messages: equality by value over
    `_FIELDS` (so unhashable), `SerializeToString` / `ParseFromString` in Caffe2's wire format (through
    the installed `proto_converter()`, which needs protobuf) and `HasField`."""

    _FIELDS: tuple[str, ...] = ()
    __hash__ = None  # type: ignore[assignment]  # mutable and compared by value

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in self._FIELDS)

    def SerializeToString(self) -> bytes:  # noqa: N802 - protobuf's name
        """Caffe2's wire format (a caffe2_pb2 message of the same name; needs protobuf)."""
        return proto_converter().to_proto(self).SerializeToString()

    def ParseFromString(self, data: bytes) -> None:  # noqa: N802 - protobuf's name
        """Replace the contents with a serialized caffe2_pb2 message of the same name (needs protobuf)."""
        self.__dict__.update(proto_converter().from_proto(data, type(self).__name__).__dict__)

    def HasField(self, field_name: str) -> bool:  # noqa: N802 - protobuf's name
        """Whether the optional field `field_name` (device_option, name, ...) is set."""
        return getattr(self, field_name) not in (None, "", False)


_OP_FIELDS = ("type", "inputs", "outputs", "args", "device_option", "name", "engine", "control_inputs",
              "is_gradient_op")


@dataclass(eq=False)
class OperatorDef(_MessageLike):
    """One recorded operator. `source` is where it was recorded (file:line), for error messages.

    Ops compare by value, as Caffe2's protobuf messages do (`source` excepted: it is where an op was
    recorded, not what it does), and so are unhashable. Caffe2's field names read the same data:
    `input`, `output` and `control_input` are the live lists, `arg` a list of `Argument` views,
    `debug_info` is `source`.
    """

    _FIELDS = _OP_FIELDS

    type: str
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    args: dict[str, Any] = field(default_factory=dict)
    device_option: DeviceOption | None = None
    name: str = ""
    engine: str = ""
    control_inputs: list[str] = field(default_factory=list)
    is_gradient_op: bool = False
    source: str = ""
    function: str = ""  # the function that recorded it (Caffe2's PopulateProtoWithFileName names ops by both)

    def copy(self) -> OperatorDef:
        """A copy whose lists and args can be edited without touching this op (list args are copied,
        NetDef args deep-copied)."""
        args = {k: v if type(v) in _SCALAR_ARGS else _copy_arg(v) for k, v in self.args.items()}
        return OperatorDef(self.type, list(self.inputs), list(self.outputs), args, self.device_option,
                           self.name, self.engine, list(self.control_inputs), self.is_gradient_op, self.source,
                           self.function)

    input = property(lambda self: self.inputs, doc="Caffe2's name of `inputs`.")
    output = property(lambda self: self.outputs, doc="Caffe2's name of `outputs`.")
    control_input = property(lambda self: self.control_inputs, doc="Caffe2's name of `control_inputs`.")
    arg = property(lambda self: _arguments(self.args), doc="The arguments as Caffe2 `Argument` views.")

    @property
    def debug_info(self) -> str:
        """Caffe2's name of `source`."""
        return self.source

    @debug_info.setter
    def debug_info(self, value: str) -> None:
        self.source = value

    def __repr__(self) -> str:
        extra = f", args={self.args}" if self.args else ""
        dev = f", device={self.device_option}" if self.device_option is not None else ""
        return f"{self.type}({self.inputs} -> {self.outputs}{extra}{dev})"


_NET_FIELDS = ("name", "ops", "external_inputs", "external_outputs", "type", "num_workers", "device_option",
               "args")


@dataclass(eq=False)
class NetDef(_MessageLike):
    """An ordered list of operators (program order is the semantics) plus the net's metadata.

    Compared by value (so unhashable), like Caffe2's message; `op`, `external_input`,
    `external_output` and `arg` are Caffe2's names of the same data.
    """

    _FIELDS = _NET_FIELDS

    name: str = ""
    ops: list[OperatorDef] = field(default_factory=list)
    external_inputs: list[str] = field(default_factory=list)
    external_outputs: list[str] = field(default_factory=list)
    type: str = "simple"
    num_workers: int = 1
    device_option: DeviceOption | None = None
    args: dict[str, Any] = field(default_factory=dict)

    def copy(self, name: str | None = None) -> NetDef:
        """An independent copy (ops copied one by one: much cheaper than deepcopy on big nets)."""
        return NetDef(self.name if name is None else name, [op.copy() for op in self.ops],
                      list(self.external_inputs), list(self.external_outputs), self.type,
                      self.num_workers, self.device_option,
                      {k: _copy_arg(v) for k, v in self.args.items()})

    def op_device(self, op: OperatorDef) -> DeviceOption:
        """The device an op runs on: its own option, else the net's, else CPU 0."""
        return op.device_option or self.device_option or DeviceOption()

    def validate(self) -> NetDef:
        """Check the structure passes must keep; raise ValueError/TypeError naming the first violation.

        The type and every blob name are non-empty strings, `num_workers` >= 1, device options are
        DeviceOptions, and every declared external output is produced or is an external input.
        Schemas (counts, arguments, in-place pairs) are checked by `core.schema.validate_net`, which
        CreateNet runs. Returns self.
        """
        if not isinstance(self.type, str) or not self.type:
            raise ValueError(f"net {self.name!r}: type must be a non-empty str (an executor such as "
                             f"'simple' or 'dag'), got {self.type!r}")
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ValueError(f"net {self.name!r}: num_workers must be an int >= 1, got {self.num_workers!r}")
        if self.device_option is not None and not isinstance(self.device_option, DeviceOption):
            raise TypeError(f"net {self.name!r}: device_option must be a DeviceOption, got {self.device_option!r}")
        defined = set(self.external_inputs)
        for index, op in enumerate(self.ops):
            where = f"net {self.name!r} op #{index} ({op.type})"
            if not isinstance(op.type, str) or not op.type:
                raise TypeError(f"{where}: the op type must be a non-empty str, got {op.type!r}")
            for blob in (*op.inputs, *op.outputs, *op.control_inputs):
                if not isinstance(blob, str) or not blob:
                    raise TypeError(f"{where}: blob names must be non-empty strings, got {blob!r}")
            if op.device_option is not None and not isinstance(op.device_option, DeviceOption):
                raise TypeError(f"{where}: device_option must be a DeviceOption, got {op.device_option!r}")
            defined.update(op.outputs)
        missing = [b for b in self.external_outputs if b not in defined]
        if missing:
            raise ValueError(f"net {self.name!r}: external outputs {missing} are produced by no op")
        return self

    op = property(lambda self: self.ops, doc="Caffe2's name of `ops`.")
    external_input = property(lambda self: self.external_inputs, doc="Caffe2's name of `external_inputs`.")
    external_output = property(lambda self: self.external_outputs, doc="Caffe2's name of `external_outputs`.")
    arg = property(lambda self: _arguments(self.args), doc="The arguments as Caffe2 `Argument` views.")

    def __repr__(self) -> str:
        body = "\n".join(f"  {i}: {op!r}" for i, op in enumerate(self.ops))
        return f"NetDef({self.name!r}, type={self.type!r}, {len(self.ops)} ops)\n{body}"
