"""Detectron2's `comm` for graphpar: who this process is, groups of processes, and host-side
reductions of Python values (metrics, evaluation results) across the processes that train together.

    from graphpar import comm
    comm.get_rank(), comm.get_world_size(), comm.get_local_rank(), comm.is_main_process()
    comm.create_local_process_group(num_workers_per_machine)   # every process calls it, once
    comm.all_gather(obj), comm.gather(obj), comm.reduce_dict({"loss": 1.5}), comm.synchronize()
    comm.shared_random_seed()                                  # one random seed for every process

The collectives run over `group`: None is torch.distributed's default group (the one
`graphpar.launch` joins; a script started by `python -m graphpar.launch` or torchrun joins it
through env:// at its first collective; one process alone: nothing to do), a torch.distributed process group, or a
`graphpar.distributed.Communicator` such as `model_world(model)`, the model's own communicator over
its rendezvous' store (which needs no default group: a FileStore or TCPStore rendezvous works too).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from graphpar.parallel import launch
from graphpar.parallel.launch import get_local_rank, get_rank, get_world_size, is_main_process
from graphpar.platform import distributed

__all__ = ["all_gather", "create_local_process_group", "gather", "get_local_process_group", "get_local_rank",
           "get_local_size", "get_rank", "get_world_size", "is_main_process", "local_devices", "model_world",
           "reduce_dict", "shared_random_seed", "synchronize"]

METRICS_WORLD = "graphpar_metrics_cw"  # the communicator `model_world` creates
_local_group: Any = None


def get_local_size() -> int:
    """How many processes run on this machine (the local group's size, else LOCAL_WORLD_SIZE, else 1)."""
    if _local_group is not None:
        return torch.distributed.get_world_size(group=_local_group)
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def local_devices(num_devices: int | None = None, local_rank: int | None = None, local_size: int | None = None,
                  num_gpus: int | None = None) -> list[int]:
    """`launch.local_devices`, with `local_size` defaulting to `get_local_size()` (the local group's size
    once it exists)."""
    return launch.local_devices(num_devices, local_rank, get_local_size() if local_size is None else local_size,
                                num_gpus)


def create_local_process_group(num_workers_per_machine: int) -> Any:
    """Create the group of the processes on this machine (Detectron2's `create_local_process_group`):
    process r belongs to machine r // num_workers_per_machine. Every process of the default group must
    call it (torch.distributed.new_group is collective), with the same count. Returns this machine's
    group (also `get_local_process_group()`), e.g. for a hierarchical reduction (first within the
    machine, then across machines) or per-machine work such as a download.

    Raises:
        RuntimeError: torch.distributed's default group is not initialised, or the group exists already.
        ValueError: the world size is not a multiple of num_workers_per_machine.
    """
    global _local_group
    dist = torch.distributed
    _join_default_group()
    if not dist.is_initialized():
        raise RuntimeError("create_local_process_group: torch.distributed's default group is not initialised "
                           "(start the processes with graphpar.launch or torchrun)")
    if _local_group is not None:
        raise RuntimeError("create_local_process_group: the local process group exists already (create it once)")
    world = dist.get_world_size()
    if isinstance(num_workers_per_machine, bool) or not isinstance(num_workers_per_machine, int) \
            or num_workers_per_machine < 1 or world % num_workers_per_machine:
        raise ValueError(f"create_local_process_group: the world size {world} must be a multiple of "
                         f"num_workers_per_machine, got {num_workers_per_machine!r}")
    machine = dist.get_rank() // num_workers_per_machine
    for m in range(world // num_workers_per_machine):  # every process creates every machine's group, in order
        group = dist.new_group(list(range(m * num_workers_per_machine, (m + 1) * num_workers_per_machine)))
        if m == machine:
            _local_group = group
    return _local_group


def get_local_process_group() -> Any:
    """The group `create_local_process_group` made. Raises RuntimeError before it."""
    if _local_group is None:
        raise RuntimeError("get_local_process_group: call create_local_process_group(num_workers_per_machine) "
                           "in every process first")
    return _local_group


def _join_default_group() -> None:
    """Join torch.distributed's default group through env:// when a launcher set WORLD_SIZE > 1 and
    the script has not joined it (`python -m graphpar.launch script.py`, torchrun)."""
    dist = torch.distributed
    if dist.is_available() and not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        launch.init_process_group(launch.default_backend(get_local_size()))


def _size_rank(group: Any) -> tuple[int, int]:
    if isinstance(group, distributed.Communicator):
        return group.size, group.rank
    dist = torch.distributed
    if group is None:
        _join_default_group()
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group=group), dist.get_rank(group=group)


def synchronize(group: Any = None) -> None:
    """A barrier over `group` (nothing with one process)."""
    size, _ = _size_rank(group)
    if size == 1:
        return
    if isinstance(group, distributed.Communicator):
        group.barrier()
    else:
        torch.distributed.barrier(group=group)


def all_gather(obj: Any, group: Any = None) -> list[Any]:
    """Every process's picklable `obj`, in rank order (the same list on every process)."""
    size, _ = _size_rank(group)
    if size == 1:
        return [obj]
    if not isinstance(group, distributed.Communicator):
        out: list[Any] = [None] * size
        torch.distributed.all_gather_object(out, obj, group=group)
        return out
    data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    sizes = [int(n) for n in group.allgather(torch.tensor([len(data)], dtype=torch.int64))]
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[:len(data)] = torch.from_numpy(data.copy())
    return [pickle.loads(t[:n].numpy().tobytes()) for t, n in zip(group.allgather(padded), sizes)]


def shared_random_seed(group: Any = None) -> int:
    """A random int in [0, 2^31), the same on every process of `group`: process 0's (Detectron2's)."""
    return int(all_gather(int(np.random.default_rng().integers(2**31)), group)[0])


def gather(obj: Any, dst: int = 0, group: Any = None) -> list[Any]:
    """Every process's `obj` in rank order on process `dst`; [] on the others."""
    gathered = all_gather(obj, group)
    return gathered if _size_rank(group)[1] == dst else []


def reduce_dict(values: Mapping[str, float], average: bool = True, group: Any = None) -> dict[str, float]:
    """{name: the sum (or, with `average`, the mean) of every process's value}, on every process (Detectron2
    returns it on the main process only; here every process gets it, so all stop together on a NaN).
    Every process must pass the same names.

    Raises:
        ValueError: the processes passed different names.
    """
    size, _ = _size_rank(group)
    if size == 1:
        return {name: float(v) for name, v in values.items()}
    names = sorted(values)
    every = all_gather((names, [float(values[n]) for n in names]), group)
    if any(other != names for other, _ in every):
        raise ValueError(f"reduce_dict: the processes passed different names: {[other for other, _ in every]}")
    totals = [sum(v[k] for _, v in every) for k in range(len(names))]
    return {name: total / size if average else total for name, total in zip(names, totals)}


def model_world(model: Any) -> distributed.Communicator | None:
    """A communicator over the shards of `model`'s rendezvous (None for one process), created on its
    store; every shard must call this in the same order (each call creates one). For host-side
    reductions between steps (the Trainer's metrics), never while a net of the model runs."""
    from graphpar.core.ir import NetDef
    from graphpar.passes.distributed import create_world_op, store_of
    from graphpar.passes.model_state import parallel_state
    from graphpar.runtime import workspace

    rdv = parallel_state(model).options.rendezvous
    if rdv is None or rdv.num_shards <= 1:
        return None
    store = store_of(rdv)
    workspace.RunNetOnce(NetDef("metrics_world_init", [create_world_op(rdv, METRICS_WORLD, rdv.timeout_sec, store)],
                                list(store[0])))
    return distributed.get_world(int(workspace.FetchBlob(METRICS_WORLD)))
