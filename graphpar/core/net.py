"""The Net builder: records operators into a `NetDef`, the way Caffe2's `core.Net` does.

`net.Relu("x", "y")` validates `Relu` against the operator registry, name-scopes plain string names
(a `BlobReference` is taken as is), auto-names missing outputs, records inputs no earlier op produced
as external inputs, stamps the current `DeviceScope` and the user's call site, and appends the op.

Look-up tables (blobs produced, external inputs) keep op creation O(1) on nets of 100k ops, and the
schema check of an op is skipped when an op of the same signature passed it before
(`core.schema.check_operator`): models record many ops alike. `Proto()`
hands out the live `NetDef`; because its caller may edit it, the tables are rebuilt (O(ops)) before
the next op is recorded, as in Caffe2. Code that alternates `Proto()` and op creation on a huge net
should fetch the proto once.

"""

from __future__ import annotations

import os
import sys
import threading
import types
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any, ClassVar, cast

from graphpar.core.dataflow import dataflow
from graphpar.core.ir import (
    CPU,
    CUDA,
    BlobReference,
    DeviceOption,
    GradientSlice,
    NetDef,
    OperatorDef,
    as_device_option,
    proto_converter,
)
from graphpar.core.schema import check_operator, get_schema, is_registered
from graphpar.core.scope import CurrentDeviceScope, CurrentNameScope, ScopedName
from graphpar.errors import PartialCloneError, UnknownOperatorError

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# The model zoo and the examples are builder code like a user's: their frames are call sites.
_USER_CODE_DIRS = tuple(f"{_PACKAGE_DIR}{sub}{os.sep}" for sub in ("models", "examples"))

BlobNames = str | Iterable[str] | None


_is_library_file: dict[str, bool] = {}  # per source file: inside graphpar, and not builder code


def _library_file(filename: str) -> bool:
    """True for graphpar's own files, except the model zoo and examples (cached per file)."""
    known = _is_library_file.get(filename)
    if known is None:
        known = filename.startswith(_PACKAGE_DIR) and not filename.startswith(_USER_CODE_DIRS)
        _is_library_file[filename] = known
    return known


def _call_site() -> tuple[str, str]:
    """('file:line', function name) of the first stack frame outside the graphpar library (the user's
    builder call)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and _library_file(frame.f_code.co_filename):
        frame = frame.f_back
    return (f"{frame.f_code.co_filename}:{frame.f_lineno}", frame.f_code.co_name) if frame is not None else ("", "")


def _names(blobs: BlobNames, what: str, op_type: str, scope: str | None = None) -> list[str]:
    """Blob names as plain strs; with `scope`, plain strs (not BlobReferences) get that prefix."""
    if blobs is None:
        return []
    if type(blobs) is str and blobs:  # the common case, fast
        return [scope + blobs if scope else blobs]
    if isinstance(blobs, str):
        blobs = [blobs]
    elif type(blobs) not in (list, tuple) and not isinstance(blobs, Iterable):
        raise TypeError(f"{op_type}: {what} must be a blob name or a list of them, got "
                        f"{type(blobs).__name__} {blobs!r}")
    names = []
    for blob in blobs:
        if not isinstance(blob, str) or not blob:
            raise TypeError(f"{op_type}: {what} must be non-empty blob names (str or BlobReference), "
                            f"got {type(blob).__name__} {blob!r}")
        if not scope or isinstance(blob, BlobReference):
            names.append(blob if type(blob) is str else str(blob))
        else:
            names.append(scope + blob)
    return names


_SCALARS = frozenset({int, float, bool, str, type(None)})


def _plain_arg(value: Any) -> Any:
    """An argument value as stored in the OperatorDef: Nets become NetDef copies, arrays lists."""
    if type(value) in _SCALARS:  # the common case, fast
        return value
    if isinstance(value, Net):
        return value._net.copy()
    if isinstance(value, str):
        return str(value)
    if type(value) in (list, tuple) and _SCALARS.issuperset(map(type, value)):  # common, fast
        return list(value)
    if hasattr(value, "tolist"):  # numpy arrays and scalars, torch tensors; flattened as Caffe2 did
        return (value.reshape(-1) if getattr(value, "ndim", 0) > 1 else value).tolist()
    if isinstance(value, (list, tuple)):
        return [_plain_arg(v) for v in value]
    return value


def _build_op(op_type: str, inputs: list[str], outputs: list[str], name: str,
              device_option: DeviceOption | None, engine: str, control_inputs: list[str],
              args: dict[str, Any], net_name: str | None, check: bool = True) -> OperatorDef:
    """Validate against the registry (unless `check` is False) and build the OperatorDef (for the net
    named `net_name`, if any: error messages say so); nothing is recorded anywhere."""
    device_option = as_device_option(device_option)
    if device_option is not None and not isinstance(device_option, DeviceOption):
        raise TypeError(f"{_where(op_type, net_name)}: device_option must be a DeviceOption, got "
                        f"{device_option!r}")
    name, engine = name or "", engine or ""  # Caffe2 code passes None for "unset"
    if not isinstance(name, str) or not isinstance(engine, str):
        raise TypeError(f"{_where(op_type, net_name)}: name and engine must be str, got {name!r} and "
                        f"{engine!r}")
    args = {k: v if type(v) in _SCALARS else _plain_arg(v) for k, v in args.items()}
    source, function = _call_site()
    op = OperatorDef(op_type, inputs, outputs, args,
                     device_option if device_option is not None else CurrentDeviceScope(),
                     name, engine, control_inputs, source=source, function=function)
    if check:
        _check(op, net_name)
    return op


def _where(op_type: str, net_name: str | None) -> str:
    """How error messages name an op being built."""
    return f"operator {op_type}" if net_name is None else f"{op_type} in net {net_name!r}"


def _check(op: OperatorDef, net_name: str | None) -> None:
    """The record-time check: as in Caffe2, wrong input/output counts surface at CreateNet/RunNet."""
    check_operator(op, _where(op.type, net_name), counts=False)


def CreateOperator(  # noqa: N802 - Caffe2 name
    type: str,  # noqa: A002 - Caffe2's keyword
    inputs: BlobNames,
    outputs: BlobNames,
    name: str = "",
    device_option: DeviceOption | None = None,
    engine: str = "",
    control_input: BlobNames = None,
    **args: Any,
) -> OperatorDef:
    """Build one OperatorDef, checked against its schema. As in Caffe2, plain str names get the
    current NameScope; BlobReferences are taken as they are.

    Args: the op type; input, output and control-input blob names (a name or a list); an optional
    op name, device option (default: the current DeviceScope) and engine; the op's arguments.
    As in Caffe2, an unregistered type (a placeholder op, or one another library registers) is built
    unchecked; a net holding it fails at CreateNet/RunNet with UnknownOperatorError.

    Raises: TypeError for a wrong or unknown argument of a registered op or a bad blob name or type;
    ValueError for a forbidden in-place pair.
    """
    if not isinstance(type, str):
        _schema(type)  # the TypeError naming it
    scope = CurrentNameScope()
    return _build_op(type, _names(inputs, "inputs", type, scope), _names(outputs, "outputs", type, scope), name,
                     device_option, engine, _names(control_input, "control_input", type, scope), args, None,
                     check=is_registered(type))


def _schema(op_type: str) -> Any:
    if not isinstance(op_type, str):
        raise TypeError(f"an operator type must be a str, got {type(op_type).__name__} {op_type!r}")
    return get_schema(op_type)


_recorders: dict[str, Callable[..., Any]] = {}
on_record: Callable[[OperatorDef], None] | None = None  # set by workspace.StartImmediate (Caffe2's immediate mode)


def _recorder(op_type: str) -> Callable[..., Any]:
    """The (cached) unbound method that records an op of a registered `op_type`."""
    record = _recorders.get(op_type)
    if record is None:
        _schema(op_type)

        def record(net: Net, inputs: BlobNames = None, outputs: BlobNames | int = None, **kwargs: Any) -> Any:
            return net._create_and_add(op_type, inputs, outputs, **kwargs)

        record.__name__ = record.__qualname__ = op_type
        _recorders[op_type] = record
    return record


class Net:
    """A builder that records operators into a live NetDef (Caffe2's `core.Net`).

    `Net(name)` starts an empty net; `Net(netdef)` starts from a copy of `netdef` (with
    `inplace=True`, from `netdef` itself, which the net then edits). Net names are unique per process: a reused name gets `_1`, `_2`, ... appended.

    `net.SomeOp(inputs, outputs=None, name="", device_option=None, engine="", control_input=None,
    **args)` records one op. Inputs, outputs and control inputs are a name or a list of names; plain
    strs get the current name scope, BlobReferences are taken as is. `outputs` may also be None (one
    auto-named output) or an int k (k outputs `<net>/<Op>:<i>`). Returns None, a BlobReference bound
    to this net, or a tuple of them. Raises what `CreateOperator` raises, before the net changes.
    """

    _names_used: ClassVar[set[str]] = set()
    _next_suffix: ClassVar[dict[str, int]] = {}
    _names_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, name_or_netdef: str | NetDef, inplace: bool = False) -> None:
        if hasattr(name_or_netdef, "DESCRIPTOR"):  # a caffe2_pb2.NetDef: converted, so never in place
            netdef = proto_converter().from_proto(name_or_netdef)
        elif isinstance(name_or_netdef, NetDef):
            netdef = name_or_netdef if inplace else name_or_netdef.copy()
        elif isinstance(name_or_netdef, str):
            netdef = NetDef(str(name_or_netdef))
        else:
            raise TypeError(f"Net() takes a name or a NetDef, got {type(name_or_netdef).__name__}")
        self._adopt(netdef)

    def _adopt(self, netdef: NetDef) -> None:
        """Own `netdef` (not copied) under a process-unique name."""
        netdef.name = self._unique_name(netdef.name)
        self._net = netdef
        self._registered: set[str] = set()  # names handed out by NextBlob
        self._auto_next: dict[str, int] = {}  # auto-naming hint: next suffix to try per base name
        self._rebuild_tables()

    @classmethod
    def _unique_name(cls, base: str) -> str:
        with cls._names_lock:
            name, suffix = base, cls._next_suffix.get(base, 1)
            while name in cls._names_used:
                name, suffix = f"{base}_{suffix}", suffix + 1
            cls._next_suffix[base] = suffix
            cls._names_used.add(name)
        return name

    # ---- look-up tables ------------------------------------------------------------------------

    def _rebuild_tables(self) -> None:
        net = self._net
        self._produced: set[str] = set().union(*(op.outputs for op in net.ops))
        self._external: set[str] = set(net.external_inputs)
        self._stale = False
        self._remember_shape()

    def _remember_shape(self) -> None:
        net = self._net
        self._seen = (net.ops, len(net.ops), net.external_inputs, len(net.external_inputs))

    def _ensure_fresh(self) -> None:
        net, seen = self._net, self._seen
        if (self._stale or net.ops is not seen[0] or len(net.ops) != seen[1]
                or net.external_inputs is not seen[2] or len(net.external_inputs) != seen[3]):
            self._rebuild_tables()

    def _append_fresh(self, op: OperatorDef) -> None:
        """Append a built op (tables fresh); its inputs that nothing produced so far become external inputs."""
        produced, external = self._produced, self._external
        for blob in op.inputs:
            if blob not in produced and blob not in external:
                self._net.external_inputs.append(blob)
                external.add(blob)
        self._net.ops.append(op)
        produced.update(op.outputs)
        self._remember_shape()
        if on_record is not None:  # workspace.StartImmediate: run each op as it is recorded
            on_record(op)

    def _CheckLookupTables(self) -> None:  # noqa: N802 - Caffe2's self-check, used by its tests
        """Raise RuntimeError unless the cached lookup tables agree with the NetDef."""
        self._ensure_fresh()
        cached = (set(self._produced), set(self._external))
        self._rebuild_tables()
        if cached != (self._produced, self._external):
            raise RuntimeError(f"net {self._net.name!r}: stale lookup tables")

    # ---- recording operators -------------------------------------------------------------------

    def __getattr__(self, op_type: str) -> Callable[..., Any]:
        """`net.SomeOp` for a registered SomeOp; an unknown type raises UnknownOperatorError."""
        if op_type.startswith("__"):
            raise AttributeError(op_type)
        return self._op_method(op_type)

    def _op_method(self, op_type: str) -> Callable[..., Any]:
        """The bound method recording a registered `op_type` (UnknownOperatorError otherwise)."""
        try:
            return types.MethodType(_recorder(op_type), self)
        except UnknownOperatorError:
            if op_type.startswith("_"):  # private-attribute probes, not misspelt ops
                raise AttributeError(op_type) from None
            raise

    def _create_and_add(self, op_type: str, inputs: BlobNames, outputs: BlobNames | int, *,
                        name: str = "", device_option: DeviceOption | None = None, engine: str = "",
                        control_input: BlobNames = None, **args: Any) -> Any:
        """Record one op (see the class docstring); validation happens before anything changes."""
        self._ensure_fresh()
        scope = CurrentNameScope()
        hint = None
        if outputs is None or (isinstance(outputs, int) and not isinstance(outputs, bool)):
            out_names, hint = self._auto_outputs(op_type, outputs, scope)
        else:
            out_names = _names(cast(BlobNames, outputs), "outputs", op_type, scope)  # checked there
        op = _build_op(op_type, _names(inputs, "inputs", op_type, scope), out_names, name, device_option,
                       engine, _names(control_input, "control_input", op_type, scope), args, self._net.name)
        self._append_fresh(op)
        if hint is not None:
            self._auto_next.update([hint])
        refs = [BlobReference(blob, self) for blob in op.outputs]
        return None if not refs else refs[0] if len(refs) == 1 else tuple(refs)

    def _auto_outputs(self, op_type: str, count: int | None, scope: str) -> tuple[list[str], tuple[str, int]]:
        """`<scope><net>/<Op>` (then `_2`, `_3`, ...), with `:<i>` per output when a count is given.

        Also returns the (base name, next suffix to try) hint to remember once the op is recorded.
        """
        if count is not None and count < 0:
            raise ValueError(f"{op_type}: the number of outputs must be >= 0, got {count}")
        base = f"{scope}{self._net.name}/{op_type}"
        tails = [""] if count is None else [f":{i}" for i in range(count)]
        suffix = self._auto_next.get(base, 1)
        while True:
            stem = base if suffix == 1 else f"{base}_{suffix}"
            names = [stem + tail for tail in tails]
            if not any(self._taken(n) for n in names):
                return names, (base, suffix + 1)
            suffix += 1

    def _taken(self, blob: str) -> bool:
        return blob in self._produced or blob in self._external or blob in self._registered

    # ---- the Caffe2 Net API --------------------------------------------------------------------

    def Proto(self) -> NetDef:  # noqa: N802 - Caffe2 name
        """The live NetDef (edits are seen by this Net: its tables are rebuilt before the next op)."""
        self._stale = True
        return self._net

    def Name(self) -> str:  # noqa: N802
        """The net's (process-unique) name."""
        return self._net.name

    def BlobIsDefined(self, blob: str) -> bool:  # noqa: N802
        """True if an op of this net produces `blob` or it is an external input."""
        self._ensure_fresh()
        return blob in self._produced or blob in self._external

    def BlobIsProduced(self, blob: str) -> bool:  # noqa: N802
        """True if an op of this net writes `blob` (being an external input does not count)."""
        self._ensure_fresh()
        return blob in self._produced

    def NextBlob(self, prefix: str = "unnamed") -> BlobReference:  # noqa: N802
        """A blob name not defined in this net nor handed out before: `prefix`, `prefix_auto_0`, ..."""
        self._ensure_fresh()
        name, index = str(prefix), 0
        while self._taken(name):
            name, index = f"{prefix}_auto_{index}", index + 1
        self._registered.add(name)
        return BlobReference(name, self)

    def NextScopedBlob(self, prefix: str = "unnamed") -> BlobReference:  # noqa: N802
        """NextBlob of `prefix` inside the current name scope."""
        return self.NextBlob(ScopedName(prefix))

    def AddExternalInput(self, *names: str) -> BlobReference | list[BlobReference]:  # noqa: N802
        """Declare external inputs (names taken as given); one ref for one name, else a list.

        Raises ValueError if a name is already an external input or repeated, before adding any.
        """
        self._ensure_fresh()
        new = _names(list(names), "external inputs", f"net {self._net.name!r}")
        if not new:
            raise ValueError(f"net {self._net.name!r}: AddExternalInput needs at least one blob name")
        dup = [b for i, b in enumerate(new) if b in self._external or b in new[:i]]
        if dup:
            raise ValueError(f"net {self._net.name!r} already has external input(s) {dup}")
        self._net.external_inputs.extend(new)
        self._external.update(new)
        self._remember_shape()
        refs = [BlobReference(b, self) for b in new]
        return refs[0] if len(refs) == 1 else refs

    def AddExternalOutput(self, *blobs: str) -> None:  # noqa: N802
        """Declare external outputs; each must be defined in this net (outputs already declared are kept once).

        Raises ValueError naming the blobs that no op produces and that are not external inputs.
        """
        names = _names(list(blobs), "external outputs", f"net {self._net.name!r}")
        undefined = [b for b in names if not self.BlobIsDefined(b)]
        if undefined:
            raise ValueError(f"net {self._net.name!r}: cannot declare {undefined} as external outputs: "
                             f"no op produces them and they are not external inputs")
        for blob in names:
            if blob not in self._net.external_outputs:
                self._net.external_outputs.append(blob)

    def Clone(self, name: str, blob_remap: dict[str, str] | None = None,  # noqa: N802
              op_id_mask: Iterable[int] | None = None, remap_funcs: Any = None, keep_schema: bool = True,
              update_external_list: bool = False) -> Net:
        """A copy of this net named `name` (made unique), with blobs renamed through `blob_remap`.

        Inputs, outputs, control inputs and external inputs/outputs are all renamed, in the nets that
        ops take as arguments too (If / While), as Caffe2 does. `op_id_mask` keeps only the ops at
        those indices; `update_external_list=True` then recomputes the external inputs (read before
        written) and outputs (written, never read afterwards), as Caffe2. `remap_funcs` and
        `keep_schema` (Caffe2's hooks for other nested ops and record schemas) are accepted and ignored.
        """
        remap = {str(k): str(v) for k, v in (blob_remap or {}).items()}
        netdef = self._net.copy(name)
        if op_id_mask is not None:
            keep = set(op_id_mask)
            netdef.ops = [op for i, op in enumerate(netdef.ops) if i in keep]
        if update_external_list:
            _recompute_externals(netdef)
        _rename_blobs(netdef, remap)
        clone = Net.__new__(Net)
        clone._adopt(netdef)
        return clone

    def ClonePartial(self, name: str, inputs: Iterable[str] | dict[str, str], outputs: Iterable[str],  # noqa: N802
                     remap_funcs: Any = None) -> tuple[Net, list[BlobReference]]:
        """The forward ops that compute `outputs` from `inputs`, as a new net `name` (Caffe2's rule).

        `inputs` is a list of blobs, or a dict {blob: its name in the clone}. Blobs the kept ops
        produce are renamed `name/<blob>`; other blobs they read (params) keep their names and
        become external inputs with the inputs; the external outputs are the `outputs`. Returns the
        net and its output references.
        Raises PartialCloneError (a ValueError, and an AssertionError as Caffe2's assert) if an output
        cannot be reached, an input is not read on the path, or an op the outputs need also computes
        one of the inputs (the clone would need a value it is given).
        """
        renames = dict(inputs) if isinstance(inputs, dict) else {str(b): str(b) for b in inputs}
        renames = {str(k): str(v) for k, v in renames.items()}
        outputs = [str(b) for b in outputs]
        forward = [op for op in self._net.ops if not op.is_gradient_op]
        ops = _backward_slice(forward, list(renames), outputs)
        produced = {b for op in ops for b in op.outputs}
        unread = [b for b in renames if not any(b in op.inputs for op in ops)]
        if not ops or unread or not set(outputs) <= produced:
            raise PartialCloneError(f"ClonePartial({name!r}): outputs {outputs} must be computed from inputs "
                                    f"{list(renames)} by ops of net {self._net.name!r}, each input read on the "
                                    f"way{f'; not read: {unread}' if unread else ''}")
        feeding = {id(op) for op in _backward_slice(forward, [], list(renames))}
        both = [op.type for op in ops if id(op) in feeding]
        if both:
            raise PartialCloneError(f"ClonePartial({name!r}): cannot cut net {self._net.name!r} at inputs "
                                    f"{list(renames)}: ops {both} that outputs {outputs} need also compute some "
                                    f"of those inputs")
        renames.update({b: f"{name}/{b}" for b in produced})
        clone_ops = []
        for op in ops:
            op = op.copy()
            op.inputs = [renames.get(b, b) for b in op.inputs]
            op.outputs = [renames[b] for b in op.outputs]
            op.control_inputs = [renames.get(b, b) for b in op.control_inputs]
            clone_ops.append(op)
        netdef = NetDef(name, clone_ops, [], [])
        _recompute_externals(netdef)
        netdef.external_outputs = [renames[b] for b in outputs]  # Caffe2's: the outputs asked for
        clone = Net.__new__(Net)
        clone._adopt(netdef.validate())
        return clone, [BlobReference(renames[b], clone) for b in outputs]

    def AddExternalInputs(self, *names: str) -> BlobReference | list[BlobReference]:  # noqa: N802
        """Caffe2's plural name of AddExternalInput."""
        return self.AddExternalInput(*names)

    def AddExternalOutputs(self, *blobs: str) -> None:  # noqa: N802
        """Caffe2's plural name of AddExternalOutput."""
        self.AddExternalOutput(*blobs)

    def AddScopedExternalInputs(self, *names: str) -> BlobReference | list[BlobReference]:  # noqa: N802
        """AddExternalInput with the current NameScope prefixed to each name."""
        return self.AddExternalInput(*(ScopedName(str(n)) for n in names))

    def AddScopedExternalOutputs(self, *blobs: str) -> None:  # noqa: N802
        """AddExternalOutput with the current NameScope prefixed to each name."""
        self.AddExternalOutput(*(ScopedName(str(b)) for b in blobs))

    def is_external_input(self, blob: str) -> bool:
        """Whether `blob` is an external input of this net."""
        return str(blob) in self._net.external_inputs

    def UsedBlobNames(self) -> set[str]:  # noqa: N802
        """Every blob an op of this net reads or writes."""
        return {b for op in self._net.ops for b in (*op.inputs, *op.outputs)}

    def UsesBlob(self, blob: str) -> bool:  # noqa: N802
        """Whether an op of this net reads or writes `blob`."""
        return str(blob) in self.UsedBlobNames()

    def GetBlobRef(self, blob_name: str) -> BlobReference:  # noqa: N802
        """A reference bound to this net to a blob it defines. Raises KeyError otherwise."""
        if not self.BlobIsDefined(blob_name):
            raise KeyError(f"net {self._net.name!r} does not define blob {str(blob_name)!r}")
        return BlobReference(str(blob_name), self)

    def RunAllOnMKL(self) -> None:  # noqa: N802
        """Caffe2's MKL-DNN placement: here the CPU (torch's CPU kernels use oneDNN themselves)."""
        self.RunAllOnDevice(DeviceOption(CPU))

    RunAllOnIDEEP = RunAllOnMKL

    @property
    def external_inputs(self) -> list[BlobReference]:
        """The external inputs as BlobReferences (a copy; AddExternalInput adds one)."""
        return [BlobReference(b, self) for b in self._net.external_inputs]

    @property
    def external_outputs(self) -> list[BlobReference]:
        """The external outputs as BlobReferences (a copy; AddExternalOutput adds one)."""
        return [BlobReference(b, self) for b in self._net.external_outputs]

    def PopulateProtoWithFileName(self) -> None:  # noqa: N802
        """Name each unnamed op after where it was recorded, 'file:line:function' as Caffe2 (graphpar
        also keeps the site in `op.source`, Caffe2's `debug_info`)."""
        for op in self._net.ops:
            if not op.name and op.source:
                op.name = f"{op.source}:{op.function}" if op.function else op.source

    def reroute_tensor(self, tensor: str, new_producer: OperatorDef,  # noqa: N802 - Caffe2 name
                       can_modify: Iterable[OperatorDef] | None = None) -> None:
        """Insert `new_producer` (which reads `tensor` and writes new blobs) right after `tensor`'s
        producer (first if it is an external input), and make the ops after it in `can_modify`
        (default: all) read `new_producer`'s first output instead of `tensor`."""
        tensor = str(tensor)
        self._ensure_fresh()
        ops = self._net.ops
        at = max((i + 1 for i, op in enumerate(ops) if tensor in op.outputs), default=0)
        allowed = None if can_modify is None else [id(op) for op in can_modify]
        renamed = new_producer.outputs[0]
        for op in ops[at:]:
            if allowed is None or id(op) in allowed:
                op.inputs = [renamed if b == tensor else b for b in op.inputs]
        _check(new_producer, self._net.name)
        ops.insert(at, new_producer)
        self._stale = True

    def AppendNet(self, other: Net | NetDef) -> Net:  # noqa: N802
        """Append copies of `other`'s ops; its external inputs not produced here become ours.

        Ops of `other` that inherited `other`'s net-level device option keep it explicitly.
        Returns self.
        """
        theirs = other._net if isinstance(other, Net) else other
        if not isinstance(theirs, NetDef):
            raise TypeError(f"AppendNet takes a Net or a NetDef, got {type(other).__name__}")
        self._ensure_fresh()
        for blob in theirs.external_inputs:
            if blob not in self._produced and blob not in self._external:
                self._net.external_inputs.append(blob)
                self._external.add(blob)
        self._remember_shape()
        for op in list(theirs.ops):  # a copy of the list: `other` may be this net
            op = op.copy()
            op.device_option = op.device_option or theirs.device_option
            self._append_fresh(op)
        self._net.external_outputs.extend(
            b for b in dict.fromkeys(theirs.external_outputs) if b not in self._net.external_outputs)
        return self

    def RunAllOnGPU(self, gpu_id: int = 0) -> None:  # noqa: N802
        """Run the net on CUDA device `gpu_id`: ops without their own device option inherit it."""
        self.RunAllOnDevice(DeviceOption(CUDA, gpu_id))

    def RunAllOnDevice(self, device_option: DeviceOption) -> None:  # noqa: N802
        """Set the net-level device option, inherited by ops that have none of their own."""
        if not isinstance(device_option, DeviceOption):
            raise TypeError(f"RunAllOnDevice needs a DeviceOption, got {type(device_option).__name__}")
        self._net.device_option = device_option

    def AddGradientOperators(self, ys: Any, no_gradient_to: Any = ()) -> dict[BlobReference, Any]:  # noqa: N802
        """Append the gradient ops of all ops recorded so far; return {blob: gradient blob}.

        `ys` is a list of blobs (seeded with ones) or a dict {y: seed gradient blob}. Blobs in
        `no_gradient_to` get no gradient, nor does any computation that serves only them (see
        `autodiff.backward_pass`). Raises graphpar.errors.GradientError when a correct gradient
        cannot be built.
        """
        from graphpar.core.autodiff import backward_pass

        grad_ops, grad_map = backward_pass(list(self._net.ops), ys, no_gradient_to=no_gradient_to)
        self._ensure_fresh()
        for op in grad_ops:
            self._append_fresh(op)
        return {BlobReference(blob, self): self._bound(grad) for blob, grad in grad_map.items()}

    def _bound(self, grad: Any) -> Any:
        if isinstance(grad, GradientSlice):
            return GradientSlice(BlobReference(grad.indices, self), BlobReference(grad.values, self))
        return BlobReference(grad, self)

    # ---- printing ------------------------------------------------------------------------------

    def __str__(self) -> str:
        net = self._net
        head = (f"Net {net.name!r} ({net.type}, {len(net.ops)} ops)\n"
                f"  external inputs: {', '.join(net.external_inputs) or '-'}\n"
                f"  external outputs: {', '.join(net.external_outputs) or '-'}")
        return "\n".join([head, *(f"  #{i} {_op_line(op)}" for i, op in enumerate(net.ops))])

    __repr__ = __str__


def _backward_slice(ops: list[OperatorDef], inputs: list[str], outputs: list[str]) -> list[OperatorDef]:
    """The ops (in order) that `outputs` depend on, not looking past `inputs`."""
    needed, chosen = set(outputs), []
    for op in reversed(ops):
        if needed & set(op.outputs):
            chosen.append(op)
            needed.difference_update(op.outputs)
            needed.update(b for b in op.inputs if b not in inputs)
    return chosen[::-1]


def _rename_blobs(netdef: NetDef, remap: dict[str, str]) -> None:
    """Rename blobs through `remap` in `netdef` (a copy: changed in place) and the nets its ops take as
    arguments."""

    def rename(blobs: list[str]) -> list[str]:
        return [remap.get(b, b) for b in blobs]

    for op in netdef.ops:
        op.inputs, op.outputs, op.control_inputs = rename(op.inputs), rename(op.outputs), rename(op.control_inputs)
        for key, value in op.args.items():
            if isinstance(value, NetDef):  # op.copy() deep-copied it
                _rename_blobs(value, remap)
            elif isinstance(value, list) and any(isinstance(v, NetDef) for v in value):
                op.args[key] = [v.copy() if isinstance(v, NetDef) else v for v in value]  # the list copy shares them
                for inner in op.args[key]:
                    if isinstance(inner, NetDef):
                        _rename_blobs(inner, remap)
    netdef.external_inputs = rename(netdef.external_inputs)
    netdef.external_outputs = rename(netdef.external_outputs)


def _recompute_externals(netdef: NetDef) -> None:
    """Caffe2's rule: external inputs = blobs read before any op writes them; external outputs =
    blobs the ops write that no op of the net reads afterwards."""
    flow = dataflow(netdef)
    used = {version.blob for version in flow.versions if len(version.users) > 1}  # read after a write
    netdef.external_inputs = list(flow.loads)
    netdef.external_outputs = [b for b in flow.first_write if b not in used]


def _op_line(op: OperatorDef) -> str:
    """`y1, y2 = Type(x1, x2) {args} @CUDA:0` for printing."""
    text = f"{', '.join(op.outputs) or '()'} = {op.type}({', '.join(op.inputs)})"
    if op.control_inputs:
        text += f" after({', '.join(op.control_inputs)})"
    if op.args:
        text += " {" + ", ".join(f"{k}={v!r}" for k, v in op.args.items()) + "}"
    if op.device_option is not None:
        text += f" @{op.device_option.device_type.name}:{op.device_option.device_id}"
    return text
