"""The IR: devices, blob references, operators and nets as plain, mutable data.

Passes edit `OperatorDef`s and `NetDef`s in place; nothing here knows schemas, kernels or workspaces.
`NetDef.validate()` checks the structure every pass must keep (the analogue of torch.fx's `lint`);
`core.schema.validate_net` adds the schema checks.
"""

from __future__ import annotations

import copy
from collections import namedtuple
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any


class DeviceType(IntEnum):
    """Where an operator runs: CPU or a CUDA device."""

    CPU = 0
    CUDA = 1


CPU = DeviceType.CPU
CUDA = DeviceType.CUDA


@dataclass(frozen=True)
class DeviceOption:
    """A device placement: type (CPU or CUDA) and index. Immutable and hashable, so ops may share one.

    Raises TypeError for a device type other than CPU/CUDA (or 0/1) or a device id that is not a
    non-negative int.
    """

    device_type: DeviceType = CPU
    device_id: int = 0

    def __post_init__(self) -> None:
        if (not isinstance(self.device_type, int) or isinstance(self.device_type, bool)
                or int(self.device_type) not in (0, 1)):
            raise TypeError(f"device_type must be graphpar.core.CPU or CUDA, got {self.device_type!r}")
        if not isinstance(self.device_id, int) or isinstance(self.device_id, bool) or self.device_id < 0:
            raise TypeError(f"device_id must be a non-negative int, got {self.device_id!r}")
        object.__setattr__(self, "device_type", DeviceType(self.device_type))

    def __repr__(self) -> str:
        return f"DeviceOption({self.device_type.name}, {self.device_id})"


def device_option_equal(a: DeviceOption | None, b: DeviceOption | None) -> bool:
    """Caffe2's comparison: an unset option means CPU 0."""
    return (a or DeviceOption()) == (b or DeviceOption())


GradientSlice = namedtuple("GradientSlice", ["indices", "values"])
GradientSlice.__doc__ = "A sparse gradient: rows `indices` of a parameter receive `values`."


class BlobReference(str):
    """A blob name (a `str` subclass: it hashes and compares as its name) that may know its net.

    `ref.Relu([], "y")` is sugar for `net.Relu([ref], "y")`.
    """

    __slots__ = ("_net",)

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


@dataclass(eq=False)
class OperatorDef:
    """One recorded operator. `source` is where it was recorded (file:line), for error messages."""

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

    def copy(self) -> OperatorDef:
        """A copy whose lists and args can be edited without touching this op (list args are copied,
        NetDef args deep-copied)."""
        args = {k: v if type(v) in _SCALAR_ARGS else _copy_arg(v) for k, v in self.args.items()}
        return OperatorDef(self.type, list(self.inputs), list(self.outputs), args, self.device_option,
                           self.name, self.engine, list(self.control_inputs), self.is_gradient_op, self.source)

    def __repr__(self) -> str:
        extra = f", args={self.args}" if self.args else ""
        dev = f", device={self.device_option}" if self.device_option is not None else ""
        return f"{self.type}({self.inputs} -> {self.outputs}{extra}{dev})"


@dataclass(eq=False)
class NetDef:
    """An ordered list of operators (program order is the semantics) plus the net's metadata."""

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

    def __repr__(self) -> str:
        body = "\n".join(f"  {i}: {op!r}" for i, op in enumerate(self.ops))
        return f"NetDef({self.name!r}, type={self.type!r}, {len(self.ops)} ops)\n{body}"
