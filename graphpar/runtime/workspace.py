"""Workspaces: named blobs (torch.Tensors, or host text), created nets and seeded random streams.

The CamelCase module functions act on the current workspace (initially "default"), as in Caffe2;
`Workspace` offers the same operations as PEP 8 methods. Every `net` argument accepts a `Net`
(anything with `.Proto()`) or a `NetDef`; blob names may be `str` or `BlobReference`.

FeedBlob keeps the dtype of numpy arrays and tensors: float64 numpy stays float64, so callers that
want float32 pass float32. Python floats and lists of floats become torch's default dtype (float32),
ints int64, bools bool. A fed value is always copied, and a value that cannot be fed leaves the
workspace unchanged.

A net's type names the executor that runs it (`graphpar.executor.registry`); a run changes the
workspace only if every op succeeds (`graphpar.executor.frame`). Nets with the argument
`dynamic_memory_management` keep only their persistent blobs; `Workspace.keep_all = True` (or
`GRAPHPAR_KEEP_ALL=1`) keeps every blob of nets created afterwards, for introspection.

Random ops draw from streams keyed by the workspace seed, the compile (its ordinal in the workspace),
the op's index and the run, so draws never depend on the order ops execute in.

Every call that raises leaves the workspace as it was (its blobs, nets and random streams): checks
come first, and what acts on several nets runs inside `Workspace.unchanged_on_error()`. A failed run
leaves every persistent blob as it was (`executor.frame`). One created net runs in one thread at a
time: a second thread that calls RunNet on it while it runs gets a RuntimeError. The current
workspace is per thread, as name and device scopes are (a new thread starts in "default").

Values loaded from a checkpoint are remembered until they are used (`Workspace.loaded`), so that
resuming in the wrong order raises (`graphpar.resume`).

Text blobs, as in Caffe2: `bytes`, `str` and numpy arrays of strings (or of bytes/str objects) are kept
as host objects in `Workspace.objects` and fetched back as fed; no operator reads them. `CreateBlob`
makes a blob that exists but holds nothing yet (it counts as present when a net is created).

Caffe2's execution plans (RunPlan), immediate mode, `Predictor` and its other functions that are not
about the workspace itself live in `graphpar.caffe2` (`run_plan`, `immediate`, `workspace_extras`);
this module gives them under their Caffe2 names.

Extras beyond Caffe2: `SetSeed(seed)` re-seeds the current workspace's random streams; `Workspaces()`
lists the workspaces; `get_workspace(name=None)` returns a `Workspace` object; `blobs` is a
dict-like view of the current workspace (`blobs[name]` fetches, `blobs[name] = v` feeds,
`del blobs[name]` removes).
"""

from __future__ import annotations

import difflib
import importlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from graphpar.core.ir import CUDA, DeviceOption, DeviceType, NetDef, OperatorDef, proto_converter
from graphpar.core.naming import ALIASED_STATE_ARG
from graphpar.core.scope import CurrentDeviceScope
from graphpar.core.shapes import infer_specs
from graphpar.errors import MissingBlobError, OperatorError, ShapeInferenceError
from graphpar.executor import CompiledNet, compile_net, get_executor
from graphpar.executor.plan import checked_torch_device
from graphpar.platform.devices import (
    can_access_peer,
    cuda_is_simulated,
    device_option_for_blob,
    num_cuda_devices,
)
from graphpar.runtime.resume import check_run
from graphpar.runtime.static_shapes import ShapePromise, promises_static_shapes

log = logging.getLogger(__name__)

_FEEDABLE_KINDS = "biufc"  # numpy dtype kinds with a torch equivalent: bool, ints, floats, complex


class Workspace:
    """Named blobs, the nets created from NetDefs, and the random streams of their random ops."""

    def __init__(self, name: str, seed: int = 0) -> None:
        self.name = name
        self.blobs: dict[str, torch.Tensor] = {}
        self.objects: dict[str, Any] = {}  # blobs that are not tensors: text, or None (CreateBlob)
        self.nets: dict[str, CompiledNet] = {}
        self.seed = _check_seed(seed)
        self.keep_all = os.environ.get("GRAPHPAR_KEEP_ALL", "") not in ("", "0")  # see executor.frame
        self._compiles = 0  # plans compiled since the streams were last restarted
        self._epoch = 0  # bumped when the streams restart (SetSeed, reset)
        self.loaded: dict[str, str] = {}  # blobs loaded from a checkpoint and not used yet -> the file
        self._running: set[str] = set()  # the nets running now (in some thread)
        self._running_lock = threading.Lock()
        # the input shapes each created net with `static_shapes` keeps (runtime.static_shapes), by plan
        self._promises: dict[int, tuple[CompiledNet, ShapePromise]] = {}  # by id(plan)
        # the plans (by id) created while their blobs did not fit their shapes, checked before they run (_compile)
        self._unchecked: dict[int, CompiledNet] = {}

    def __repr__(self) -> str:
        return f"Workspace({self.name!r}, {len(self.blobs)} blobs, {len(self.nets)} nets)"

    def random_streams(self, net_name: str) -> Callable[[int], Callable[[torch.device], torch.Generator]]:
        """The random streams of one compiled net (`net_name` is for messages only).

        `streams(op_index)(device)` returns a generator on `device`, seeded anew on each call (once
        per run of the op) from the workspace seed, this compile's ordinal in the workspace, the op
        index and the call count: draws depend on neither execution order nor device placement.
        Names are not part of the key (Net names are made unique per process), so rebuilding a
        model in a fresh workspace draws the same values.
        """
        compile_key = self._compiles
        self._compiles += 1

        def streams(op_index: int) -> Callable[[torch.device], torch.Generator]:
            epoch, runs = self._epoch, 0
            generators: dict[torch.device, torch.Generator] = {}

            def next_generator(device: torch.device) -> torch.Generator:
                nonlocal epoch, runs
                if epoch != self._epoch:  # SetSeed restarted every stream
                    epoch, runs = self._epoch, 0
                gen = generators.get(device)
                if gen is None:
                    gen = generators[device] = torch.Generator(device=device)
                gen.manual_seed(_mix(self.seed, compile_key, op_index, runs))
                runs += 1
                return gen

            return next_generator

        return streams

    def set_seed(self, seed: int) -> None:
        """Restart the random streams from `seed` (created nets too, from their next run)."""
        self.seed = _check_seed(seed)
        self._restart_streams()

    def reset(self) -> None:
        """Remove every blob and net and restart the random streams from the seed."""
        self.blobs.clear()
        self.objects.clear()
        self.nets.clear()
        self.loaded.clear()
        self._promises.clear()
        self._unchecked.clear()
        self._restart_streams()

    @contextmanager
    def unchanged_on_error(self) -> Iterator[None]:
        """Put back the blobs (the same tensors), text blobs, nets, load records and random-stream state if
        the block raises. Tensors updated in place are not copied: runs stage those (`executor.frame`)."""
        mappings: tuple[dict[Any, Any], ...] = (self.blobs, self.objects, self.nets, self.loaded, self._promises,
                                                self._unchecked)
        saved = [(m, dict(m)) for m in mappings]
        compiles = self._compiles
        try:
            yield
        except BaseException:
            for mapping, before in saved:
                mapping.clear()
                mapping.update(before)
            self._compiles = compiles
            raise

    def _restart_streams(self) -> None:
        self._compiles = 0
        self._epoch += 1

    def feed_blob(self, name: str, value: Any, device_option: DeviceOption | None = None, *,
                  alias: bool = False) -> None:
        """Store a copy of `value` as blob `name` (see the module docstring for dtypes and devices).

        `alias=True` (what `graphpar.data.feed` uses): a contiguous tensor already on the blob's
        device, a GPU, is stored as it is, without a copy: the blob aliases it. Anything else is copied.

        Raises:
            TypeError: `name` is not a non-empty str, or `value` is not a numeric array, tensor,
                scalar or rectangular (nested) list.
            RuntimeError: the target CUDA device does not exist.
        """
        key = _blob_key(name)
        if _is_text(value):
            self.objects[key] = value.copy() if isinstance(value, np.ndarray) else value
            self.blobs.pop(key, None)
            return
        option = _feed_device_option(key, device_option)
        device = checked_torch_device(option, f"FeedBlob({key!r})")
        if alias and _on_accelerator(value, device):
            self.blobs[key] = value.detach() if value.requires_grad else value
        else:
            self.blobs[key] = _to_tensor(key, value, device)
        self.loaded.pop(key, None)
        self.objects.pop(key, None)

    def create_blob(self, name: str) -> None:
        """Make blob `name` exist, holding nothing, unless it exists (Caffe2's CreateBlob)."""
        key = _blob_key(name)
        if not self.has_blob(key):
            self.objects[key] = None

    def fetch_tensor(self, name: str) -> torch.Tensor:
        """The live tensor of blob `name`. Raises MissingBlobError if there is none."""
        key = _blob_key(name)
        tensor = self.blobs.get(key)
        if tensor is None and key in self.objects:
            held = self.objects[key]
            what = "nothing yet (CreateBlob)" if held is None else f"a {type(held).__name__} (text)"
            raise TypeError(f"blob {key!r} holds {what}, not a tensor")
        if tensor is None:
            freed = next((plan.name for plan in self.nets.values() if key in plan.frame.drops), None)
            if freed is not None:
                raise MissingBlobError(
                    f"blob {key!r} is an intermediate that net {freed!r} frees after its last use "
                    f"(dynamic_memory_management); to fetch it after a run, keep it: Parallelize("
                    f"blobs_to_keep=[...]) with its unscoped name, or the net argument blobs_to_keep")
            close = difflib.get_close_matches(key, self.blobs, n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise MissingBlobError(f"blob {key!r} does not exist in workspace {self.name!r}.{hint}")
        return tensor

    def fetch_blob(self, name: str) -> np.ndarray:
        """A host numpy copy of blob `name`.

        Raises:
            MissingBlobError: there is no such blob.
            TypeError: its dtype has no numpy equivalent (e.g. bfloat16); use fetch_tensor.
        """
        held = self.objects.get(name) if isinstance(name, str) else None
        if held is not None:
            return held.copy() if isinstance(held, np.ndarray) else held
        host = self.fetch_tensor(name).detach().to("cpu", copy=True)
        try:
            return host.numpy()
        except TypeError:  # torch: "Got unsupported ScalarType BFloat16"
            raise TypeError(f"blob {str(name)!r} is {str(host.dtype).removeprefix('torch.')}, which numpy "
                            f"cannot hold; use FetchTensor({str(name)!r}) (and .float() for a float32 "
                            f"copy)") from None

    def has_blob(self, name: str) -> bool:
        """Whether blob `name` exists."""
        return isinstance(name, str) and (name in self.blobs or name in self.objects)

    def blob_names(self) -> list[str]:
        """The sorted blob names."""
        return sorted({*self.blobs, *self.objects})

    def remove_blob(self, name: str) -> None:
        """Delete blob `name`. Raises MissingBlobError if there is none."""
        key = _blob_key(name)
        if self.objects.pop(key, _ABSENT) is not _ABSENT:
            return
        self.fetch_tensor(name)
        del self.blobs[key]
        self.loaded.pop(key, None)

    def create_net(self, net: Any, overwrite: bool = False) -> CompiledNet:
        """Compile `net` once and keep it under its NetDef's name; return its plan.

        A net whose ops do not fit the shapes of the blobs it reads (fed later, or still empty) is
        created, as in Caffe2, and its shapes checked again before it runs (`run_net`).

        Raises:
            RuntimeError: a net of that name exists and `overwrite` is False.
            MissingBlobError, ValueError, TypeError, OperatorError: see executor.compile_net (a broken
                schema, a missing input, a kernel that cannot be built; not a shape mismatch).
        """
        netdef = _as_netdef(net)
        if netdef.name in self.nets and not overwrite:
            raise RuntimeError(f"net {netdef.name!r} already exists in workspace {self.name!r}; pass "
                               f"overwrite=True to replace it.")
        with self.unchanged_on_error():  # a failed compile must not advance the random streams
            plan = self._compile(netdef)
        replaced = self.nets.get(netdef.name)
        if replaced is not None:
            self._promises.pop(id(replaced), None)
            self._unchecked.pop(id(replaced), None)
        if promises_static_shapes(plan):
            self._promises[id(plan)] = (plan, ShapePromise(plan, self.blobs))
        self.nets[netdef.name] = plan
        return plan

    def run_net(self, net_or_name: Any, num_iter: int = 1) -> None:
        """Run a created net (by name, Net or NetDef) `num_iter` times.

        Raises:
            RuntimeError: the net was never created in this workspace, or it is running in another thread.
            ValueError: `num_iter` is not a non-negative int, or the net promises static shapes and a
                fed input's shape or dtype changed (`runtime.static_shapes`); checked before anything runs.
            ShapeInferenceError: an op's inputs do not fit it (naming the op and their shapes; a
                ValueError and a RuntimeError), for a net created while they did not; nothing runs.
            CheckpointError: the run would misuse values loaded from a checkpoint (`graphpar.resume`).
            OperatorError, MissingBlobError: an op failed (see executor.run); persistent blobs are as
                they were after the last run that succeeded.
        """
        name = net_or_name if isinstance(net_or_name, str) else _as_netdef(net_or_name).name
        plan = self.nets.get(name)
        if plan is None:
            raise RuntimeError(f"net {name!r} has not been created in workspace {self.name!r}; call "
                               f"CreateNet first, or data_parallel_model.RunInitNet(model) for a parallelized "
                               f"model (known nets: {sorted(self.nets)})")
        if isinstance(num_iter, bool) or not isinstance(num_iter, int) or num_iter < 0:
            raise ValueError(f"RunNet({name!r}): num_iter must be a non-negative int, got {num_iter!r}")
        executor = get_executor(plan.type)
        with self._running_lock:
            if name in self._running:
                raise RuntimeError(f"net {name!r} is already running in another thread; a net runs one "
                                   f"step at a time (its steps update shared state): run it from one thread, "
                                   f"or wait for the other run to return")
            self._running.add(name)
        try:
            if num_iter:
                self._check_shapes(plan)
            entry = self._promises.get(id(plan)) if num_iter and self._promises else None
            promise = entry[1] if entry is not None and entry[0] is plan else None
            first_shapes = promise.check(self.blobs) if promise is not None else None
            if self.loaded and num_iter:
                self._check_load_order(plan)
            for _ in range(num_iter):
                executor.run(plan, self.blobs)
            if promise is not None and first_shapes:
                promise.record(first_shapes)
            if self.loaded and num_iter:
                self._mark_used(plan)
        finally:
            self._running.discard(name)

    def run_net_once(self, net: Any) -> None:
        """Compile and run `net` once without keeping it (typical for init nets); raises as
        create_net and run_net."""
        with self.unchanged_on_error():  # a failed compile or run must not advance the random streams
            plan = self._compile(_as_netdef(net))
            self._check_shapes(plan)
            if self.loaded:
                self._check_load_order(plan)
            get_executor(plan.type).run(plan, self.blobs)
            if self.loaded:
                self._mark_used(plan)

    def _compile(self, netdef: NetDef) -> CompiledNet:
        """compile_net; a net whose blobs do not fit its shapes yet (fed later, still empty) is compiled
        without shape facts and checked again before each run until one passes (`_check_shapes`):
        Caffe2 found such errors when the op ran, so CreateNet accepts the net as Caffe2's did."""
        compiles = self._compiles
        try:
            return compile_net(netdef, self, self.keep_all)
        except ShapeInferenceError as exc:
            self._compiles = compiles  # the compile that failed drew no random stream
            try:
                plan = compile_net(netdef, self, self.keep_all, infer_shapes=False)
            except OperatorError:  # a kernel refuses its args too: the shape rule's error says more
                raise exc from None
            self._unchecked[id(plan)] = plan
            log.info("CreateNet(%r): its blobs do not fit its shapes yet; checked again before it runs: %s",
                     netdef.name, exc)
            return plan

    def _check_shapes(self, plan: CompiledNet) -> None:
        """Raise ShapeInferenceError, before anything runs, if `plan`'s net was created with blobs that did
        not fit it and the workspace's blobs still do not (`_compile`)."""
        if self._unchecked and self._unchecked.get(id(plan)) is plan:
            infer_specs(plan.netdef, self.blobs)
            del self._unchecked[id(plan)]

    def _check_load_order(self, plan: CompiledNet) -> None:
        """Refuse a run that would misuse blobs loaded from a checkpoint (`graphpar.resume`)."""
        reads = {load.name for load in plan.frame.loads} | set(plan.netdef.args.get(ALIASED_STATE_ARG, ()))
        check_run(plan.name, reads, [name for name in plan.frame.names if name not in reads], self.loaded)

    def _mark_used(self, plan: CompiledNet) -> None:
        """After a successful run: the loaded blobs it read or wrote are in use."""
        for name in plan.frame.names:
            self.loaded.pop(name, None)

    def run_operator_once(self, op: OperatorDef) -> None:
        """Compile and run a single operator once; TypeError if `op` is not an OperatorDef (graphpar's,
        Caffe2's protobuf message, or its serialized bytes)."""
        if isinstance(op, (bytes, bytearray)) or hasattr(op, "DESCRIPTOR"):
            op = _from_caffe2(op, "OperatorDef")
        if not isinstance(op, OperatorDef):
            raise TypeError(f"RunOperatorOnce needs an OperatorDef, got {type(op).__name__}")
        self.run_net_once(NetDef(name=f"RunOperatorOnce({op.type})", ops=[op]))


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"a workspace seed must be a non-negative int, got {seed!r}")
    return int(seed)


_MASK64 = (1 << 64) - 1


def _mix(*values: int) -> int:
    """A well-spread non-negative 63-bit seed from small integers (splitmix64 over each in turn)."""
    state = 0
    for value in values:
        state = (state ^ (value & _MASK64)) + 0x9E3779B97F4A7C15 & _MASK64
        state = (state ^ (state >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
        state = (state ^ (state >> 27)) * 0x94D049BB133111EB & _MASK64
        state ^= state >> 31
    return state >> 1


def _blob_key(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"a blob name must be a non-empty str or BlobReference, got {name!r}")
    return str(name)


def _as_netdef(net: Any) -> NetDef:
    if isinstance(net, NetDef):
        return net
    if hasattr(net, "Proto"):
        return net.Proto()
    if isinstance(net, (bytes, bytearray)) or hasattr(net, "DESCRIPTOR"):
        return _from_caffe2(net, "NetDef")  # a caffe2_pb2.NetDef or its serialized bytes
    raise TypeError(f"expected a Net or a NetDef, got {type(net).__name__}: {net!r}")


def _from_caffe2(message: Any, kind: str) -> Any:
    """A graphpar NetDef/OperatorDef from a caffe2_pb2 message or its bytes (needs protobuf)."""
    return proto_converter().from_proto(message, kind)


def _feed_device_option(name: str, device_option: DeviceOption | None) -> DeviceOption:
    """The explicit option, else the current DeviceScope, else the name's replica scope, else CPU."""
    if device_option is not None and not isinstance(device_option, DeviceOption):
        raise TypeError(f"FeedBlob({name!r}): device_option must be a DeviceOption, got {device_option!r}")
    return device_option or CurrentDeviceScope() or device_option_for_blob(name) or DeviceOption()


_ABSENT = object()


def _is_text(value: Any) -> bool:
    """Whether `value` is one of Caffe2's string blobs: bytes, str, or a numpy array of them."""
    if isinstance(value, (bytes, str)):
        return True
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "SUO":
        return False
    return value.dtype.kind != "O" or all(isinstance(v, (bytes, str)) for v in value.flat)


def _on_accelerator(value: Any, device: torch.device) -> bool:
    """Whether `value` is a contiguous tensor already on `device`, and that is not the CPU."""
    return (isinstance(value, torch.Tensor) and device.type != "cpu" and value.device == device
            and value.is_contiguous())


def _to_tensor(name: str, value: Any, device: torch.device) -> torch.Tensor:
    """A fresh tensor on `device` holding `value`; raise TypeError for anything but numeric data."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, copy=True)
    if isinstance(value, (np.ndarray, np.generic)):
        if value.dtype.kind not in _FEEDABLE_KINDS:
            raise TypeError(f"FeedBlob({name!r}): numpy dtype {value.dtype} has no tensor equivalent; "
                            f"feed a numeric or bool array")
        native = value.dtype.newbyteorder("=")  # torch reads native byte order only
        return torch.from_numpy(np.array(value, dtype=native, order="C")).to(device)  # our own copy
    if isinstance(value, (bool, int, float, complex, list, tuple)):
        try:
            return torch.tensor(value, device=device)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"FeedBlob({name!r}): cannot make a tensor of {type(value).__name__} "
                            f"{value!r:.80}: {exc}. Feed numbers in a rectangular (nested) list") from None
    raise TypeError(f"FeedBlob({name!r}): cannot feed a {type(value).__name__}; feed a numpy array, a "
                    f"torch.Tensor, a Python number or a (nested) list of numbers")


_workspaces: dict[str, Workspace] = {"default": Workspace("default")}
_thread = threading.local()  # the current workspace's name, per thread


def _current() -> str:
    return getattr(_thread, "current", "default")


def get_workspace(name: str | None = None) -> Workspace:
    """The `Workspace` called `name` (default: this thread's current one). Raises KeyError if it does
    not exist."""
    key = _current() if name is None else name
    if key not in _workspaces:
        raise KeyError(f"workspace {key!r} does not exist (workspaces: {sorted(_workspaces)})")
    return _workspaces[key]


def FeedBlob(name: str, value: Any, device_option: DeviceOption | None = None) -> bool:  # noqa: N802
    """Store a copy of `value` as blob `name` in the current workspace; returns True (as Caffe2).

    numpy arrays and tensors keep their dtype (float64 stays float64: pass float32 for float32
    blobs); Python floats and lists of floats become float32, ints int64, bools bool.

    Device: `device_option`, else the current DeviceScope, else the name's replica scope
    ('gpu_3/x' -> CUDA 3, 'cpu_1/x' -> CPU), else CPU. Text (bytes, str, numpy arrays of strings) is
    kept as a host object and fetched back as fed. Raises TypeError for other values that are not
    numeric data (None, dict, mixed object arrays, ragged lists) and RuntimeError for a CUDA device
    that does not exist; the workspace is then unchanged.
    """
    get_workspace().feed_blob(name, value, device_option)
    return True


def FetchBlob(name: str) -> np.ndarray:  # noqa: N802
    """A host numpy copy of blob `name` (GPU blobs are copied to the host).

    Raises MissingBlobError if there is none, TypeError if its dtype has no numpy equivalent
    (bfloat16: use FetchTensor).
    """
    return get_workspace().fetch_blob(name)


def FetchTensor(name: str) -> torch.Tensor:  # noqa: N802
    """The live tensor of blob `name` (not a copy). Raises MissingBlobError if there is none."""
    return get_workspace().fetch_tensor(name)


def HasBlob(name: str) -> bool:  # noqa: N802
    """Whether the current workspace has blob `name`."""
    return get_workspace().has_blob(name)


def Blobs() -> list[str]:  # noqa: N802
    """The sorted blob names of the current workspace."""
    return get_workspace().blob_names()


def CreateNet(net: Any, overwrite: bool = False) -> bool:  # noqa: N802
    """Compile `net` (Net or NetDef) into the current workspace under its name; returns True.

    Raises RuntimeError if the name is taken and `overwrite` is False, MissingBlobError if an op
    input neither exists nor is produced earlier in the net, ValueError/TypeError for an op that
    breaks its schema, OperatorError if a kernel cannot be built. Shapes that do not fit yet are
    reported by RunNet, before anything runs (as Caffe2 reported them when the op ran).
    """
    get_workspace().create_net(net, overwrite)
    return True


def RunNet(net_or_name: Any, num_iter: int = 1) -> bool:  # noqa: N802
    """Run a created net (by name, Net or NetDef) `num_iter` times; returns True.

    Raises RuntimeError if it was not created, ValueError for a bad `num_iter`, ShapeInferenceError
    (a ValueError and a RuntimeError) for inputs that do not fit an op, and OperatorError (or
    MissingBlobError) naming the failing op.
    """
    get_workspace().run_net(net_or_name, num_iter)
    return True


def RunNetOnce(net: Any) -> bool:  # noqa: N802
    """Compile and run `net` once without keeping it; returns True. Raises as CreateNet and RunNet."""
    get_workspace().run_net_once(net)
    return True


def RunOperatorOnce(op: OperatorDef) -> bool:  # noqa: N802
    """Compile and run one OperatorDef once; returns True. Raises as RunNetOnce."""
    get_workspace().run_operator_once(op)
    return True


def ResetWorkspace(root_folder: str | None = None) -> bool:  # noqa: N802
    """Remove every blob and net of the current workspace and restart its random streams; returns True.

    `root_folder` (Caffe2's; created if missing) becomes what `RootFolder()` returns; None keeps it.
    """
    get_workspace().reset()
    if root_folder is not None:
        os.makedirs(root_folder, exist_ok=True)
        _root_folders[_current()] = root_folder
    return True


def RootFolder() -> str:  # noqa: N802
    """The current workspace's root folder (Caffe2's; "." unless ResetWorkspace set one). Nothing in
    graphpar reads files relative to it."""
    return _root_folders.get(_current(), ".")


_root_folders: dict[str, str] = {}


def SwitchWorkspace(name: str, create_if_missing: bool = False) -> None:  # noqa: N802
    """Make workspace `name` current in this thread; with `create_if_missing=True`, create it (seed 0)
    if needed.

    Raises RuntimeError if it does not exist and `create_if_missing` is False (Caffe2's default);
    TypeError for a bad name.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"a workspace name must be a non-empty str, got {name!r}")
    if name not in _workspaces:
        if not create_if_missing:
            raise RuntimeError(f"workspace {name!r} does not exist (workspaces: {sorted(_workspaces)}); pass "
                           f"create_if_missing=True to create it")
        _workspaces[name] = Workspace(name)
    _thread.current = name


def CurrentWorkspace() -> str:  # noqa: N802
    """The name of this thread's current workspace."""
    return _current()


def Workspaces() -> list[str]:  # noqa: N802
    """The sorted names of all workspaces."""
    return sorted(_workspaces)


def NumCudaDevices() -> int:  # noqa: N802
    """The number of CUDA devices: the real GPUs (0 without, even when CUDA is simulated on the CPU),
    or the logical devices of a device map (`graphpar.devices.device_map`)."""
    return num_cuda_devices()


# ---- Caffe2 names kept for scripts written against Caffe2's workspace module ---------------------

GpuDeviceType = DeviceType.CUDA  # Caffe2's GPU device type (HIP builds are not supported)
has_gpu_support = has_cuda_support = torch.cuda.is_available()
has_hip_support = False


def GetGpuPeerAccessPattern(num_devices: int | None = None) -> np.ndarray:  # noqa: N802
    """A [n, n] bool matrix: whether GPU i can access GPU j's memory directly (empty without GPUs).

    With real GPUs, n is the logical CUDA device count (the device map's length, else the GPUs; or
    `num_devices`, the first ones). With logical CUDA devices placed on the CPU (`GRAPHPAR_CUDA_ON_CPU`),
    they share one memory, so every pair is a peer; n is `num_devices`, else the logical devices the nets
    of the current workspace use (the highest CUDA device id + 1), at least the real GPU count.
    """
    if cuda_is_simulated():
        used = [op.device_option.device_id for plan in get_workspace().nets.values() for op in plan.netdef.ops
                if op.device_option is not None and op.device_option.device_type == CUDA]
        n = num_devices if num_devices is not None else max([num_cuda_devices() - 1, *used]) + 1
        return np.ones((n, n), dtype=bool)
    n = num_cuda_devices() if num_devices is None else min(num_devices, num_cuda_devices())
    return np.array([[i == j or can_access_peer(i, j) for j in range(n)] for i in range(n)],
                    dtype=bool).reshape(n, n)


GetCudaPeerAccessPattern = GetGpuPeerAccessPattern


def GetBlobSizeBytes(name: str) -> int:  # noqa: N802
    """The bytes blob `name`'s data takes (text: a pointer per string plus the strings' lengths).
    Raises MissingBlobError if there is none."""
    held = get_workspace().objects.get(name)
    if held is not None:
        texts = list(held.flat) if isinstance(held, np.ndarray) else [held]
        return len(texts) * np.dtype(object).itemsize + sum(len(t) for t in texts)
    tensor = get_workspace().fetch_tensor(name)
    return tensor.numel() * tensor.element_size()


def CreateBlob(name: str) -> bool:  # noqa: N802
    """Create blob `name`, holding nothing, if it does not exist (as Caffe2); returns True. Nets may
    be created that read it; feed it before they run."""
    get_workspace().create_blob(name)
    return True


@contextmanager
def WorkspaceGuard(workspace_name: str) -> Iterator[None]:  # noqa: N802
    """Switch to workspace `workspace_name` (created if missing) for the block, then back."""
    current = CurrentWorkspace()
    SwitchWorkspace(workspace_name, True)
    try:
        yield
    finally:
        SwitchWorkspace(current)


# The rest of Caffe2's workspace module lives in graphpar/caffe2/ (modules that import this one), so
# `workspace.RunPlan(...)` and the others below load their module on first use.
_CAFFE2_NAMES = {
    "run_plan": ("RunPlan", "RunPlanInBackground"),
    "immediate": ("IsImmediate", "StartImmediate", "StopImmediate", "RunOperatorImmediate", "ImmediateBlobs",
                  "FetchImmediate", "FeedImmediate", "_immediate_root_folder"),
    "workspace_extras": ("NumGpuDevices", "IsGPUDeviceType", "FetchTorch", "FetchBlobs", "RunOperatorsOnce",
                         "StringifyBlobName", "StringifyNetName", "GetNameScope", "StringifyProto", "Predictor",
                         "RunOperatorMultiple", "C", "GlobalInit"),
}
_CAFFE2_HOME = {name: module for module, names in _CAFFE2_NAMES.items() for name in names}


def __getattr__(name: str) -> Any:
    """A Caffe2 function kept in `graphpar.caffe2` (`_CAFFE2_NAMES`)."""
    if name not in _CAFFE2_HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"graphpar.caffe2.{_CAFFE2_HOME[name]}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_CAFFE2_HOME])


def SetSeed(seed: int) -> None:  # noqa: N802
    """Re-seed the current workspace's random streams (fills, dropout) with `seed`."""
    get_workspace().set_seed(seed)


def reset_all(seed: int = 0) -> None:
    """Drop every workspace but a fresh "default" (seeded with `seed`) and make it current (for tests)."""
    _workspaces.clear()
    _workspaces["default"] = Workspace("default", seed)
    _thread.current = "default"
    _root_folders.clear()


class _BlobsView(MutableMapping):
    """The current workspace's blobs as a mapping: get fetches (numpy), set feeds, del removes."""

    def __getitem__(self, name: str) -> np.ndarray:
        return FetchBlob(name)

    def __setitem__(self, name: str, value: Any) -> None:
        FeedBlob(name, value)

    def __delitem__(self, name: str) -> None:
        get_workspace().remove_blob(name)

    def __iter__(self) -> Iterator[str]:
        return iter(Blobs())

    def __len__(self) -> int:
        return len(Blobs())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and HasBlob(name)


blobs = _BlobsView()
