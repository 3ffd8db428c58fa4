"""Collectives across processes (shards), as Caffe2's gloo ops, on torch.distributed (NOT_DIFFERENTIABLE).

A store or a communicator is a handle blob (an int64 scalar into `graphpar.distributed`'s registry of
this process), so these ops read it as an ordinary input:

    FileStoreHandlerCreate([], ["store_handler"], path=..., prefix=...)   # or TCPStoreHandlerCreate
    CreateCommonWorld(["store_handler"], ["cw"], size=num_shards, rank=shard_id, engine="GLOO")
    Allreduce(["cw", "x"], ["x"])       # x summed over the shards (each input on its own)
    Broadcast(["cw", "x"], ["x"], root=0)
    Barrier(["cw"], [])

`Allreduce` and `Broadcast` work in place, as Caffe2's (Trait.OVERWRITES_INPUTS): they reduce or
overwrite the tensors they are given and return them. The plan never gives them a tensor that anything
else still sees (a copy instead), and one loaded from the workspace only in the update phase, so no
other blob, view or caller sees the change and a run that fails before its updates leaves the
workspace as it was. Each collective runs with the communicator's timeout and raises an error naming
the shard, the communicator and the collective when a peer dies or hangs.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import socket
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch

from graphpar.core.ir import CPU, DeviceOption, OperatorDef
from graphpar.core.schema import (
    NOT_DIFFERENTIABLE,
    Arg,
    KernelContext,
    TensorSpec,
    Trait,
    register_op,
)
from graphpar.core.trees import tree_levels
from graphpar.ops.common import op_label
from graphpar.platform import distributed

_HANDLE = TensorSpec((), torch.int64)
_DISTRIBUTED = (Trait.COLLECTIVE, Trait.CROSS_DEVICE, Trait.DISTRIBUTED, Trait.HOST_SYNC)
_IN_PLACE = (*_DISTRIBUTED, Trait.OVERWRITES_INPUTS)


def _handle(value: int) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.int64)


def _handle_device(op: OperatorDef, device: DeviceOption) -> tuple[list, list]:
    """Handles live on the CPU; the blobs a collective reduces on the op's device."""
    host = DeviceOption(CPU, 0)
    inputs = [host if i == 0 else device for i in range(len(op.inputs))]
    return inputs, [host] if op.type == "CreateCommonWorld" else [device] * len(op.outputs)


def _file_store(a: SimpleNamespace, ctx: KernelContext) -> Callable[[], torch.Tensor]:
    if not a.path:
        raise ValueError(f"{op_label(ctx.op)}: needs path= (a directory shared by every shard, or a file)")

    def run() -> torch.Tensor:
        path = os.path.join(a.path, "graphpar_store") if os.path.isdir(a.path) else a.path
        store: torch.distributed.Store = torch.distributed.FileStore(path, -1)
        if a.prefix:
            store = torch.distributed.PrefixStore(a.prefix, store)
        return _handle(distributed.register_store(store))

    return run


def _tcp_store(a: SimpleNamespace, ctx: KernelContext) -> Callable[[], torch.Tensor]:
    if not a.host or not 0 <= a.port < 65536:
        raise ValueError(f"{op_label(ctx.op)}: needs host= and a port in 0..65535, got {a.host!r}:{a.port}")
    if a.timeout_ms < 1:
        raise ValueError(f"{op_label(ctx.op)}: timeout_ms must be >= 1, got {a.timeout_ms}")

    def run() -> torch.Tensor:
        role = "serve" if a.is_master else "reach"
        where = (f"{op_label(ctx.op)}: could not {role} the TCPStore at {a.host}:{a.port} within {a.timeout_ms} ms "
                 f"(is the shard with is_master=True running?)")
        timeout = datetime.timedelta(milliseconds=a.timeout_ms)
        deadline = time.monotonic() + a.timeout_ms / 1000
        if not a.is_master and not _listening(a.host, a.port, deadline):
            raise RuntimeError(f"{where}: nothing accepted a connection")
        try:  # torch's client retries a failed connect once more after its timeout: give it what is left
            left = max(1.0, (deadline - time.monotonic()) * 1000)
            store: torch.distributed.Store = torch.distributed.TCPStore(a.host, a.port, None, bool(a.is_master),
                                               datetime.timedelta(milliseconds=left), False)
            store.set_timeout(timeout)  # every store operation waits at most timeout_ms
        except (RuntimeError, ValueError) as exc:  # DistNetworkError is a RuntimeError
            raise RuntimeError(f"{where}: {exc}") from None
        if a.prefix:
            store = torch.distributed.PrefixStore(a.prefix, store)
        return _handle(distributed.register_store(store))

    return run


def _listening(host: str, port: int, deadline: float) -> bool:
    """Whether a connection to host:port succeeds before `deadline` (time.monotonic()), trying again
    every 50 ms while it is refused (the serving shard may start later)."""
    while (left := deadline - time.monotonic()) > 0:
        try:
            with socket.create_connection((host, port), timeout=min(left, 1.0)):
                return True
        except OSError:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
    return False


def _handle_rule(_a: SimpleNamespace, _ctx: KernelContext, _inputs: list[TensorSpec]) -> list[TensorSpec]:
    return [_HANDLE]

register_op(
    "FileStoreHandlerCreate", inputs=0, outputs=1, args={"path": Arg("str"), "prefix": ""}, kernel=_file_store,
    infer=_handle_rule, gradient=NOT_DIFFERENTIABLE,
    doc="A store handle for CreateCommonWorld: a torch.distributed.FileStore in directory (or file) `path`, "
        "which every shard must see, under `prefix` (Caffe2's FileStoreHandlerCreate).")
register_op(
    "TCPStoreHandlerCreate", inputs=0, outputs=1, args={"host": Arg("str"), "port": Arg("int"), "prefix": "",
                                                         "is_master": False,
                                                         "timeout_ms": int(distributed.DEFAULT_TIMEOUT_SEC * 1000)},
    kernel=_tcp_store, infer=_handle_rule, gradient=NOT_DIFFERENTIABLE,
    doc="A store handle for CreateCommonWorld: a torch.distributed.TCPStore at host:port, served by the "
        "shard with is_master=True (Caffe2's RedisStoreHandlerCreate, without Redis). Reaching the store, "
        "and every store operation until a communicator sets its own timeout, waits at most `timeout_ms` "
        "(default 30 s, Caffe2's store timeout).")


def signature_digest(text: str) -> int:
    """A 63-bit digest of a model signature (equal texts, equal digests on every process)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _check_signature(world: distributed.Communicator, signature: str, where: str) -> None:
    """Raise on every shard unless every shard's model signature equals shard 0's, naming the shards
    that differ and the first line where the first of them differs from shard 0."""
    world.store.set(f"signature/{world.rank}", signature)
    digests = [int(t) for t in world.allgather(torch.tensor(signature_digest(signature), dtype=torch.int64))]
    differ = [shard for shard, digest in enumerate(digests) if digest != digests[0]]
    if differ:
        ours, theirs = (world.store.get(f"signature/{shard}").decode().splitlines() for shard in (0, differ[0]))
        line = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        first = ours[line] if line < len(ours) else "(nothing)"
        other = theirs[line] if line < len(theirs) else "(nothing)"
        raise RuntimeError(f"{where}: shard(s) {differ} built a different model than shard 0 (different params, "
                           f"device count or collective order), so their collectives would not match: shard 0 has "
                           f"{first!r} where shard {differ[0]} has {other!r}; run the same model with the same "
                           f"devices on every shard")


def _create_common_world(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., torch.Tensor]:
    where = op_label(ctx.op)
    if a.size < 1 or not 0 <= a.rank < a.size:
        raise ValueError(f"{where}: needs size >= 1 and 0 <= rank < size, got rank={a.rank}, size={a.size}")
    if a.engine not in distributed.ENGINES:
        raise ValueError(f"{where}: engine must be one of {distributed.ENGINES}, got {a.engine!r}")
    if a.timeout_ms < 1:
        raise ValueError(f"{where}: timeout_ms must be >= 1, got {a.timeout_ms}")
    name = a.name or ctx.op.outputs[0]

    def run(*store: torch.Tensor) -> torch.Tensor:
        handle = int(store[0]) if store else a.store
        world = distributed.create_world(name, handle, None, a.rank, a.size, a.engine, a.timeout_ms / 1000)
        if a.signature:
            _check_signature(distributed.get_world(world), a.signature, where)
        return _handle(world)

    return run


register_op(
    "CreateCommonWorld", inputs=(0, 1), outputs=1,
    args={"size": Arg("int"), "rank": Arg("int"), "engine": "GLOO", "timeout_ms": 30000, "name": "",
          "store": distributed.DEFAULT_STORE, "signature": "", "transport": "tcp", "interface": ""},
    kernel=_create_common_world, infer=_handle_rule, gradient=NOT_DIFFERENTIABLE,
    traits=(Trait.HOST_SYNC,), device_inference=_handle_device,
    doc="A communicator handle over `size` shards (this one `rank`): a gloo (or NCCL) process group on the "
        "store of input 0 (a store handle), else of `store` (a registered store's handle; -1: "
        "torch.distributed's default group, env:// if not initialised). Every collective on it waits at most "
        "`timeout_ms`. With `signature`, every shard's must equal shard 0's (an error on every shard "
        "otherwise, instead of mismatched collectives).")


def _collective(run_one: Callable[[distributed.Communicator, torch.Tensor, SimpleNamespace], None]
                ) -> Callable[[SimpleNamespace, KernelContext], Callable[..., object]]:
    def kernel(a: SimpleNamespace, ctx: KernelContext) -> Callable[..., object]:
        where = op_label(ctx.op)
        if len(ctx.op.inputs) != len(ctx.op.outputs) + 1:
            raise ValueError(f"{where}: needs the communicator then one input per output, got "
                             f"{len(ctx.op.inputs)} inputs and {len(ctx.op.outputs)} outputs")

        def run(world: torch.Tensor, *xs: torch.Tensor) -> object:
            comm = distributed.get_world(int(world))
            for x in xs:  # the plan's to overwrite (Trait.OVERWRITES_INPUTS)
                run_one(comm, x, a)
            return xs[0] if len(xs) == 1 else xs

        return run

    return kernel


def _copies_rule(_a: SimpleNamespace, _ctx: KernelContext, inputs: list[TensorSpec]) -> list[TensorSpec]:
    return list(inputs[1:])


def _shifted(i: int, o: int) -> bool:
    return i == o + 1


def _tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The sum of one tensor per shard, added in Parallelize's Sum tree over shard positions."""
    for level in tree_levels(len(parts)):
        for positions in level:
            total = parts[positions[0]]
            for position in positions[1:]:
                total = total + parts[position]
            parts[positions[0]] = total
    return parts[0]


def _check_order(order: str, op_type: str) -> None:
    if order not in distributed.REDUCE_ORDERS:
        raise ValueError(f"{op_type}: order must be one of {distributed.REDUCE_ORDERS}, got {order!r}")


def _allreduce(comm: distributed.Communicator, x: torch.Tensor, a: SimpleNamespace) -> None:
    _check_order(a.order, "Allreduce")
    if a.order == "ring" or comm.size == 1:
        comm.allreduce(x)
        return
    x.copy_(_tree_sum(comm.allgather(x)))  # every shard adds the same values in the same tree order


register_op(
    "Allreduce", inputs=(2, None), outputs=(1, None), enforce_inplace=_shifted, args={"order": "ring"},
    kernel=_collective(_allreduce), infer=_copies_rule,
    gradient=NOT_DIFFERENTIABLE, traits=_IN_PLACE, device_inference=_handle_device,
    doc="Output i = the sum over the shards of input i + 1 (input 0: the communicator); each input is "
        "reduced on its own, in place enforced. order='ring': the backend's all-reduce; 'tree': an "
        "all-gather, then Parallelize's Sum tree over shard positions (pairwise for 4, 8, 16 shards), so "
        "shards x devices sum exactly as one process's tree over all devices.")


def _broadcast(comm: distributed.Communicator, x: torch.Tensor, a: SimpleNamespace) -> None:
    if not 0 <= a.root < comm.size:
        raise ValueError(f"Broadcast: root {a.root} is not a shard (0..{comm.size - 1})")
    comm.broadcast(x, a.root)


register_op(
    "Broadcast", inputs=(2, None), outputs=(1, None), args={"root": 0}, enforce_inplace=_shifted,
    kernel=_collective(_broadcast), infer=_copies_rule, gradient=NOT_DIFFERENTIABLE, traits=_IN_PLACE,
    device_inference=_handle_device,
    doc="Output i = shard `root`'s input i + 1 (input 0: the communicator); in place enforced.")


def _reduce_scatter(a: SimpleNamespace, ctx: KernelContext) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    where = op_label(ctx.op)
    _check_order(a.order, where)

    def run(world: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        comm, flat = distributed.get_world(int(world)), x.reshape(-1)
        sizes = list(a.split)
        if not sizes and flat.numel() % comm.size == 0:
            sizes = [flat.numel() // comm.size] * comm.size
        if len(sizes) != comm.size or sum(sizes) != flat.numel() or min(sizes) < 0:
            raise ValueError(f"{where}: split {list(a.split)} must cut X's {flat.numel()} elements into one part "
                             f"per shard ({comm.size})")
        if a.order == "ring" or comm.size == 1:
            return comm.reduce_scatter(flat, sizes)
        return _tree_sum(comm.alltoall(flat, sizes))  # each shard adds its part of every shard in tree order

    return run


def _reduce_scatter_infer(a: SimpleNamespace, _ctx: KernelContext, inputs: list[TensorSpec]) -> list[TensorSpec | None]:
    """Known when every part has one size (the shard's rank, known only at run time, picks its part)."""
    sizes = set(a.split)
    return [TensorSpec((sizes.pop(),), inputs[1].dtype) if len(sizes) == 1 else None]


register_op(
    "ReduceScatter", inputs=2, outputs=1, args={"split": Arg("ints", ()), "order": "ring"}, kernel=_reduce_scatter,
    infer=_reduce_scatter_infer, gradient=NOT_DIFFERENTIABLE, traits=_DISTRIBUTED, device_inference=_handle_device,
    doc="Y = part r of the sum over the shards of X (input 1, flattened; input 0: the communicator), r this "
        "shard: X is cut into the sizes of `split`, one part per shard in shard order (default equal parts). "
        "order='ring': the backend's reduce-scatter; 'tree': an all-to-all, then Parallelize's Sum tree over "
        "shard positions, so shards x devices sum exactly as one process's tree over all devices (as "
        "Allreduce). Parallelize(shard_gradients=True) reduces each gradient with it.")


def _allgather(_a: SimpleNamespace, ctx: KernelContext) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def run(world: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        comm = distributed.get_world(int(world))
        sizes = [int(n) for n in comm.allgather(torch.tensor([x.shape[0]], dtype=torch.int64))]
        if max(sizes) == 0:
            return x.clone()
        padded = x.new_zeros((max(sizes), *x.shape[1:]))  # gloo gathers equal shapes: pad, then cut
        padded[:x.shape[0]] = x
        return torch.cat([part[:n] for part, n in zip(comm.allgather(padded), sizes)])

    return run


def _allgather_infer(_a: SimpleNamespace, _ctx: KernelContext, inputs: list[TensorSpec]) -> list[TensorSpec | None]:
    if not inputs[1].shape:
        raise ValueError("Allgather: X needs an axis 0 to concatenate along")
    return [None]  # the length depends on the other shards


register_op(
    "Allgather", inputs=2, outputs=1, inplace={(1, 0)}, kernel=_allgather, infer=_allgather_infer,
    gradient=NOT_DIFFERENTIABLE, traits=_DISTRIBUTED, device_inference=_handle_device,
    doc="Y = every shard's X (input 1; input 0: the communicator) concatenated along axis 0 in shard order; "
        "the lengths may differ (sparse gradients' indices and values).")


def _barrier(_a: SimpleNamespace, _ctx: KernelContext) -> Callable[[torch.Tensor], tuple]:
    def run(world: torch.Tensor) -> tuple:
        distributed.get_world(int(world)).barrier()
        return ()

    return run


register_op(
    "Barrier", inputs=1, outputs=0, kernel=_barrier, infer=lambda _a, _ctx, _inputs: [],
    gradient=NOT_DIFFERENTIABLE, traits=_DISTRIBUTED, device_inference=_handle_device,
    doc="Returns once every shard of the communicator (input 0) has reached it, or raises after its timeout.")
