"""Multi-host training on torch.distributed: the `rendezvous` dict, stores and communicators.

One process is one *shard*: it owns several local devices (replicas) and talks to the other shards
through communicators ("common worlds", as Caffe2 called them) built on a `torch.distributed.Store`.
Nets never hold Python objects: a store or a communicator lives in a process-local registry here, and
a blob holds its handle (an int64 scalar), so the ops that use one (`graphpar.ops.distributed`) read
it as an ordinary input and keep their data dependencies.

A communicator is a gloo (CPU tensors) or NCCL (CUDA tensors) process group of its own, built
directly on a prefix of the store, so several communicators let several collectives run at once
(`max_concurrent_distributed_ops`) and none needs torch.distributed's default group. A gloo
collective blocks the host at most the communicator's timeout; a peer that died or hangs makes it
raise an error naming the shard, the communicator and the collective, never hang. An NCCL collective
does not block the host: the current CUDA stream waits for it (`work.wait()` without a timeout; with
one, torch blocks the host until the all-reduce ends), and the group's own timeout and watchdog,
set to the same `timeout_sec`, end a hung one.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from graphpar.errors import ParallelizeError

ENGINES = ("GLOO", "NCCL")
TRANSPORTS = ("tcp", "ibverbs")
DEFAULT_TIMEOUT_SEC = 30.0  # Caffe2's _DEFAULT_TIMEOUT_SEC for common worlds
RENDEZVOUS_KEYS = ("shard_id", "num_shards", "engine", "kv_handler", "transport", "interface", "exit_nets",
                   "mpi_rendezvous", "timeout_sec", "reduce_order")
REDUCE_ORDERS = ("ring", "tree")
DEFAULT_STORE = -1  # CreateCommonWorld's `store` argument: torch.distributed's default store (env://)


@dataclass(frozen=True)
class Rendezvous:
    """A checked rendezvous dict (see `parse_rendezvous`)."""

    shard_id: int
    num_shards: int
    engine: str
    kv_handler: Any  # a torch.distributed.Store, the name of a blob holding a store's handle, or None
    transport: str = "tcp"
    interface: str = ""
    exit_nets: tuple = ()
    timeout_sec: float = DEFAULT_TIMEOUT_SEC
    reduce_order: str = "ring"


def default_engine(cuda: bool) -> str:
    """The engine a rendezvous without one gets: "NCCL" when every shard's devices are real CUDA devices
    (`cuda`, not placed on the CPU) and torch has NCCL, else "GLOO"."""
    from graphpar.platform.devices import cuda_is_simulated

    nccl = torch.distributed.is_available() and torch.distributed.is_nccl_available()
    return "NCCL" if cuda and not cuda_is_simulated() and torch.cuda.is_available() and nccl else "GLOO"


def parse_rendezvous(rendezvous: Mapping | None, what: str = "Parallelize",
                     default_engine: str = "GLOO") -> Rendezvous | None:
    """Check Caffe2's rendezvous dict and return it as a `Rendezvous` (None stays None).

    Keys: `shard_id` and `num_shards` (ints, 0 <= shard_id < num_shards), `engine` ("GLOO" or
    "NCCL", default `default_engine`: Parallelize passes `default_engine(cuda)`), `kv_handler` (a `torch.distributed.Store`, the name of a blob written by
    `FileStoreHandlerCreate` / `TCPStoreHandlerCreate`, or None: torch.distributed's default group if
    it is initialised, else `env://` with torchrun's variables RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT), optional `transport` ("tcp" or "ibverbs"), `interface`, `exit_nets`,
    `mpi_rendezvous` (must be false), `timeout_sec` (every collective's timeout, default 30 s) and
    `reduce_order`: "ring" (default, the backend's all-reduce) or "tree" (an all-gather, then the same
    Sum tree over the shards as one process uses over devices: S shards x D devices then sum exactly as
    1 x S*D for power-of-2 counts, at (S-1)x the traffic; with 2 shards both orders are exact).
    With `kv_handler=None`, `shard_id` and `num_shards` default to the default group's (or RANK and
    WORLD_SIZE) and must agree with them.

    Raises:
        ParallelizeError: not a dict, an unknown key, a missing or bad value. Nothing has changed then.
    """
    if rendezvous is None:
        return None
    if not isinstance(rendezvous, Mapping):
        raise ParallelizeError(f"{what}: rendezvous must be a dict, got {type(rendezvous).__name__}")
    unknown = sorted(set(rendezvous) - set(RENDEZVOUS_KEYS))
    if unknown:
        raise ParallelizeError(f"{what}: unknown rendezvous key(s) {unknown}; the keys are "
                               f"{', '.join(RENDEZVOUS_KEYS)}")
    kv = rendezvous.get("kv_handler")
    if (kv is not None and not isinstance(kv, (str, torch.distributed.Store))) or (isinstance(kv, str) and not kv):
        raise ParallelizeError(f"{what}: rendezvous['kv_handler'] must be a torch.distributed.Store, the "
                               f"name of a blob holding one (FileStoreHandlerCreate), or None; got {kv!r}")
    shard_id, num_shards = _shard(rendezvous, kv, what)
    engine = rendezvous.get("engine", default_engine)
    if engine not in ENGINES:
        raise ParallelizeError(f"{what}: rendezvous['engine'] must be one of {ENGINES}, got {engine!r}")
    transport = rendezvous.get("transport", "tcp")
    if transport not in TRANSPORTS:
        raise ParallelizeError(f"{what}: rendezvous['transport'] must be one of {TRANSPORTS}, got {transport!r}")
    interface = rendezvous.get("interface", "") or ""
    if not isinstance(interface, str):
        raise ParallelizeError(f"{what}: rendezvous['interface'] must be a network interface name, "
                               f"got {interface!r}")
    if rendezvous.get("mpi_rendezvous"):
        raise ParallelizeError(f"{what}: rendezvous['mpi_rendezvous'] is not supported; use a kv_handler "
                               f"(FileStore or TCPStore) or torchrun's env://")
    timeout = rendezvous.get("timeout_sec", DEFAULT_TIMEOUT_SEC)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ParallelizeError(f"{what}: rendezvous['timeout_sec'] must be a number of seconds > 0, "
                               f"got {timeout!r}")
    order = rendezvous.get("reduce_order", "ring")
    if order not in REDUCE_ORDERS:
        raise ParallelizeError(f"{what}: rendezvous['reduce_order'] must be one of {REDUCE_ORDERS}, got {order!r}")
    exit_nets = rendezvous.get("exit_nets") or ()
    return Rendezvous(shard_id, num_shards, engine, kv, transport, interface, tuple(exit_nets), float(timeout),
                      order)


def _shard(rendezvous: Mapping, kv: Any, what: str) -> tuple[int, int]:
    """shard_id and num_shards: given, or with kv_handler=None taken from the default group / env."""
    given = {key: rendezvous.get(key) for key in ("shard_id", "num_shards")}
    for key, value in given.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ParallelizeError(f"{what}: rendezvous[{key!r}] must be an int, got {value!r}")
    if kv is None:
        found = _default_shard()
        if found is None and None in given.values():
            raise ParallelizeError(f"{what}: rendezvous without kv_handler needs torch.distributed's default "
                                   f"group initialised or torchrun's RANK and WORLD_SIZE, or shard_id and "
                                   f"num_shards given")
        if found is not None:
            for key, value in zip(given, found):
                if given[key] is not None and given[key] != value:
                    raise ParallelizeError(f"{what}: rendezvous[{key!r}] is {given[key]} but the default "
                                           f"group / environment says {value}")
                given[key] = value
    shard_id, num_shards = given["shard_id"], given["num_shards"]
    if shard_id is None or num_shards is None:
        missing = [key for key, value in given.items() if value is None]
        raise ParallelizeError(f"{what}: rendezvous needs {' and '.join(missing)}")
    if num_shards < 1 or not 0 <= shard_id < num_shards:
        raise ParallelizeError(f"{what}: rendezvous needs num_shards >= 1 and 0 <= shard_id < num_shards, got "
                               f"shard_id={shard_id}, num_shards={num_shards}")
    return shard_id, num_shards


def _default_shard() -> tuple[int, int] | None:
    """(rank, world size) of the initialised default group, else from RANK / WORLD_SIZE, else None."""
    dist = torch.distributed
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


# ---- the registry of stores and communicators --------------------------------------------------

_lock = threading.Lock()
_stores: dict[int, Any] = {}
_worlds: dict[int, Communicator] = {}
_created: dict[str, int] = {}  # communicator name -> how many this process created (the store prefix)


@atexit.register
def release_all() -> None:
    """Drop every communicator and store of this process and leave torch.distributed's groups (run at
    exit): their threads are then joined while the interpreter still runs; gloo threads left to the C++
    teardown at exit aborted the process now and then (`terminate called without an active exception`)."""
    with _lock:
        _worlds.clear()
        _stores.clear()
    gc.collect()
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def register_store(store: Any) -> int:
    """Keep `store` (a torch.distributed.Store) for this process; returns its handle."""
    with _lock:
        handle = len(_stores)
        _stores[handle] = store
        return handle


def get_store(handle: int, timeout_sec: float = DEFAULT_TIMEOUT_SEC) -> Any:
    """The store of `handle`; DEFAULT_STORE joins torch.distributed's default group (env:// within
    `timeout_sec` if it is not initialised yet).

    Raises:
        ValueError: an unknown handle.
        RuntimeError: the env:// rendezvous did not complete within `timeout_sec`.
    """
    if handle == DEFAULT_STORE:
        dist = torch.distributed
        if not dist.is_initialized():
            try:
                dist.init_process_group("gloo", init_method="env://",
                                        timeout=datetime.timedelta(seconds=timeout_sec))
            except (RuntimeError, ValueError) as exc:  # DistError is a RuntimeError
                raise RuntimeError(f"env:// rendezvous (RANK={os.environ.get('RANK')}, WORLD_SIZE="
                                   f"{os.environ.get('WORLD_SIZE')}, MASTER_ADDR={os.environ.get('MASTER_ADDR')}, "
                                   f"MASTER_PORT={os.environ.get('MASTER_PORT')}) did not complete within "
                                   f"{timeout_sec:g} s: are all the processes started? {exc}") from None
        return dist.distributed_c10d._get_default_store()
    with _lock:
        store = _stores.get(handle)
    if store is None:
        raise ValueError(f"no store with handle {handle} in this process: run the op that creates it "
                         f"(FileStoreHandlerCreate, TCPStoreHandlerCreate) in this process first")
    return store


def get_world(handle: int) -> Communicator:
    """The communicator of `handle`. Raises ValueError for an unknown handle."""
    with _lock:
        world = _worlds.get(handle)
    if world is None:
        raise ValueError(f"no communicator with handle {handle} in this process: run the init net "
                         f"(RunInitNet) that creates it (CreateCommonWorld) first")
    return world


class Communicator:
    """One process group over the shards; its collectives wait at most `timeout_sec` and name the
    shard, the communicator and the collective when they fail (see the module docstring for NCCL)."""

    def __init__(self, name: str, rank: int, size: int, timeout_sec: float, group: Any, store: Any = None,
                 engine: str = "GLOO") -> None:
        self.name, self.rank, self.size, self.timeout_sec = name, rank, size, timeout_sec
        self.group = group  # None for a single shard
        self.store = store  # the group's own (prefixed) store
        self.engine = engine
        self.count = 0  # collectives run so far (in this process)

    def allreduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the shards, in place."""
        if self.group is not None:
            self._wait("Allreduce", lambda: self.group.allreduce([tensor]))

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """Overwrite `tensor` with shard `root`'s, in place."""
        if self.group is not None:
            self._wait(f"Broadcast(root={root})", lambda: self.group.broadcast(tensor, root))

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every shard's `tensor` (same shape everywhere), in shard order."""
        if self.group is None:
            return [tensor]
        outputs = [torch.empty_like(tensor) for _ in range(self.size)]
        self._wait("Allgather", lambda: self.group.allgather([outputs], [tensor]))
        return outputs

    def reduce_scatter(self, tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Part `rank` of 1-D `tensor` cut into `sizes` (one per shard), summed over the shards."""
        if self.group is None:
            return tensor.clone()
        parts = [piece.contiguous() for piece in torch.split(tensor, sizes)]
        output = torch.empty_like(parts[self.rank])
        self._wait("ReduceScatter", lambda: self.group.reduce_scatter([output], [parts]))
        return output

    def alltoall(self, tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """Shard s gets part s of 1-D `tensor` cut into `sizes` (one per shard); returns the parts of
        this shard's size every shard sent it, in shard order."""
        if self.group is None:
            return [tensor.clone()]
        output = tensor.new_empty(sizes[self.rank] * self.size)
        options = torch.distributed.AllToAllOptions()
        self._wait("AllToAll", lambda: self.group.alltoall_base(output, tensor.contiguous(),
                                                               [sizes[self.rank]] * self.size, sizes, options))
        return list(torch.split(output, sizes[self.rank]))

    def barrier(self) -> None:
        """Return once every shard has reached its barrier on this communicator."""
        if self.group is not None:
            self._wait("Barrier", lambda: self.group.barrier())

    def _wait(self, what: str, start: Any) -> None:
        self.count += 1
        timeout = datetime.timedelta(seconds=self.timeout_sec)
        try:
            work = start()
            if self.engine == "NCCL":
                work.wait()  # the current stream waits; the group's timeout and watchdog catch a hang
            elif not work.wait(timeout):
                raise RuntimeError(f"timed out after {self.timeout_sec:g} s")
        except (RuntimeError, ValueError) as exc:
            raise RuntimeError(f"shard {self.rank} of {self.size}: collective {what} #{self.count} on "
                               f"communicator {self.name!r} failed (timeout {self.timeout_sec:g} s): a peer "
                               f"shard died, hangs, or runs a different model: {exc}") from None


def create_world(name: str, store_handle: int | None, store: Any, rank: int, size: int, engine: str,
                 timeout_sec: float) -> int:
    """Build communicator `name` over `size` shards (this one is `rank`) and return its handle.

    Every shard must create the same communicators in the same order: the n-th creation of `name` in
    each process meets the others' n-th under the store prefix `name/n`. A creation that fails does not
    count, so calling again (the peers were late) meets them under the same prefix.

    Raises:
        RuntimeError: the peers did not all join within `timeout_sec` (naming the shard and the name).
    """
    group: Any = None  # a torch ProcessGroupGloo or ProcessGroupNCCL (torch's stubs give them no common base)
    prefixed = None
    if size > 1:
        if store is None:
            store = get_store(DEFAULT_STORE if store_handle is None else store_handle, timeout_sec)
        with _lock:
            generation = _created[name] = _created.get(name, 0) + 1
        prefixed = torch.distributed.PrefixStore(f"graphpar/{name}/{generation}", store)
        timeout = datetime.timedelta(seconds=timeout_sec)
        try:
            prefixed.set_timeout(timeout)
            if engine == "NCCL":  # not run on real multi-GPU hardware yet
                options = torch.distributed.ProcessGroupNCCL.Options()
                options._timeout = timeout
                group = torch.distributed.ProcessGroupNCCL(prefixed, rank, size, options)
            else:
                group = torch.distributed.ProcessGroupGloo(prefixed, rank, size, timeout)
        except (RuntimeError, ValueError) as exc:
            with _lock:  # a retry meets the peers under the same prefix (they may only be late)
                _created[name] = generation - 1
            raise RuntimeError(f"shard {rank} of {size}: could not create communicator {name!r} with "
                               f"{engine} within {timeout_sec:g} s (are all {size} shards running the same "
                               f"model with the same rendezvous?): {exc}") from None
    return register_world(Communicator(name, rank, size, timeout_sec, group, prefixed, engine))


@contextlib.contextmanager
def creations_kept_on_error() -> Iterator[None]:
    """Within the block, a raise puts back the count of communicators created (see `create_world`), so
    that a failed RunInitNet or Synchronize leaves nothing that makes the next attempt's prefixes differ
    from the peers'."""
    with _lock:
        before = dict(_created)
    try:
        yield
    except BaseException:
        with _lock:
            _created.clear()
            _created.update(before)
        raise


def register_world(world: Any) -> int:
    """Keep communicator `world` (a `Communicator`, or anything with its methods) for this process;
    returns its handle."""
    with _lock:
        handle = len(_worlds)
        _worlds[handle] = world
        return handle
