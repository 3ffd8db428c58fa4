"""Start one training process per shard, as Detectron2's `launch`, or as a command like torchrun.

    from graphpar import launch
    launch.launch(main, num_processes_per_machine=2, args=(...,))        # in Python

    python -m graphpar.launch --nproc-per-node 2 train.py --epochs 3      # from the shell
    python -m graphpar.launch --nproc-per-node 2 -m graphpar.examples.train --devices 2
    python -m graphpar.launch --nproc-per-node 2 --nnodes 2 --node-rank 0 --dist-url tcp://HOST:PORT train.py

Every process gets torchrun's environment variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR, MASTER_PORT), so a script written for the launcher also runs under
`torchrun`, and `rendezvous()` gives the `Parallelize(rendezvous=...)` dict for it (kv_handler=None:
torch.distributed's default group, joined through env://). `dist_url="auto"` picks a free local port
(one machine only). Each process gets an equal share of this machine's cores (OMP_NUM_THREADS,
unless set): gloo's threads and PyTorch's intra-op threads of several processes oversubscribe the
CPU otherwise (a 1 MiB clone took 30 ms instead of 0.1 ms with two processes on two busy cores).
When one process fails, the others are stopped, its traceback is shown and the
launcher exits non-zero; no process outlives it. SIGTERM or SIGINT (Ctrl-C) to the launcher is
forwarded to every process, which gets a grace period to exit before it is killed (as torchrun): 5 s
after SIGTERM; after Ctrl-C (each process stops after its step in flight) `INTERRUPT_GRACE_SEC`, or
`PEER_GRACE_SEC` once one has ended. The launcher then exits with 128 + the signal's number (130
after Ctrl-C) and prints nothing itself (rank 0 says where it stopped).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlparse

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
log = logging.getLogger(__name__)
INTERRUPT_GRACE_SEC = 30.0  # after Ctrl-C, how long the processes get to stop before they are killed
PEER_GRACE_SEC = 5.0  # ... and once one has stopped, how long the others get (one may wait on it in C++)

__all__ = ["DEFAULT_TIMEOUT", "default_backend", "get_local_rank", "get_rank", "get_world_size",
           "init_process_group", "is_main_process", "launch", "local_devices", "main", "rendezvous"]


def get_rank() -> int:
    """This process's rank (torch.distributed's if initialised, else RANK, else 0)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))


def get_world_size() -> int:
    """How many processes train together (torch.distributed's, else WORLD_SIZE, else 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def get_local_rank() -> int:
    """This process's rank on its machine (LOCAL_RANK, else 0)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main_process() -> bool:
    """Whether this is rank 0 (the one that prints and saves checkpoints)."""
    return get_rank() == 0


def local_devices(num_devices: int | None = None, local_rank: int | None = None, local_size: int | None = None,
                  num_gpus: int | None = None) -> list[int]:
    """The GPU ids this process owns: process r of K on a machine with G GPUs owns GPUs r*D .. r*D + D - 1,
    D = `num_devices` (default G // K: `K` processes on a K-GPU machine get one GPU each, as
    Detectron2's `torch.cuda.set_device(local_rank)`). `local_rank`, `local_size` and `num_gpus`
    default to LOCAL_RANK, LOCAL_WORLD_SIZE (else 1) and the visible GPUs.

    Raises:
        ValueError: bad counts; fewer GPUs than processes; K x D > G, where processes would share GPUs.
    """
    from graphpar.platform.devices import num_cuda_devices  # torch: only when asked

    rank = get_local_rank() if local_rank is None else local_rank
    size = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if local_size is None else local_size
    gpus = num_cuda_devices() if num_gpus is None else num_gpus
    for name, value, low in (("local_rank", rank, 0), ("local_size", size, 1), ("num_gpus", gpus, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"local_devices: {name} must be an int >= {low}, got {value!r}")
    if rank >= size:
        raise ValueError(f"local_devices: local_rank {rank} must be < local_size {size}")
    if gpus < size:
        raise ValueError(f"local_devices: {size} processes on this machine but {gpus} GPU(s) visible; each process "
                         f"needs a GPU of its own: start at most {gpus} processes, or train on CPU devices")
    per = gpus // size if num_devices is None else num_devices
    if isinstance(per, bool) or not isinstance(per, int) or per < 1:
        raise ValueError(f"local_devices: num_devices must be an int >= 1, got {num_devices!r}")
    if size * per > gpus:
        last = list(range((size - 1) * per, size * per))
        raise ValueError(f"local_devices: {size} processes x {per} GPUs need {size * per} GPUs but {gpus} are visible, "
                         f"so processes would share GPUs (process {size - 1} would own GPUs {last}); use at most "
                         f"{gpus // size} GPU(s) per process, or fewer processes")
    return list(range(rank * per, (rank + 1) * per))


def rendezvous(engine: str | None = None, timeout_sec: float | None = None) -> dict | None:
    """`Parallelize(rendezvous=...)` for this process: None alone, else the default group's shard
    (engine None: Parallelize's default, NCCL on real CUDA devices, else GLOO)."""
    if get_world_size() <= 1:
        return None
    found: dict[str, Any] = {"kv_handler": None, "shard_id": get_rank(), "num_shards": get_world_size()}
    if engine is not None:
        found["engine"] = engine
    return found if timeout_sec is None else {**found, "timeout_sec": timeout_sec}


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _master(dist_url: str, num_machines: int) -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT) of `dist_url` ("auto": a free local port, one machine only)."""
    if dist_url == "auto":
        if num_machines != 1:
            raise ValueError("launch: dist_url='auto' works on one machine only; pass tcp://HOST:PORT of machine 0")
        return "127.0.0.1", free_port()
    url = urlparse(dist_url)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"launch: dist_url must be 'auto' or tcp://HOST:PORT, got {dist_url!r}")
    return url.hostname, url.port


def _environment(rank: int, local_rank: int, world_size: int, local_world_size: int, machine_rank: int,
                 addr: str, port: int) -> dict[str, str]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, cores // local_world_size))
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(local_world_size), "GROUP_RANK": str(machine_rank),
            "MASTER_ADDR": addr, "MASTER_PORT": str(port), "OMP_NUM_THREADS": threads}


def launch(main_func: Callable[..., Any], num_processes_per_machine: int, num_machines: int = 1,
           machine_rank: int = 0, dist_url: str = "auto", args: Sequence[Any] = (),
           timeout: datetime.timedelta = DEFAULT_TIMEOUT, backend: str | None = None) -> None:
    """Run `main_func(*args)` in `num_processes_per_machine` spawned processes on this machine (machine
    `machine_rank` of `num_machines`), each inside torch.distributed's default group (`backend`, default
    `default_backend`: NCCL with a GPU per process, else gloo; joined at `dist_url` within `timeout`,
    see `init_process_group`). One process in all: `main_func` runs here.

    Raises:
        ValueError: bad counts or dist_url.
        torch.multiprocessing.ProcessRaisedException / ProcessExitedException: a process failed (its
            traceback in the message); the others were stopped.
        KeyboardInterrupt: Ctrl-C; every process got a SIGINT and has ended (killed after
            `INTERRUPT_GRACE_SEC`).
    """
    if num_processes_per_machine < 1 or num_machines < 1 or not 0 <= machine_rank < num_machines:
        raise ValueError(f"launch: needs num_processes_per_machine >= 1, num_machines >= 1 and 0 <= machine_rank < "
                         f"num_machines, got {num_processes_per_machine}, {num_machines}, {machine_rank}")
    world_size = num_processes_per_machine * num_machines
    if world_size == 1:
        main_func(*args)
        return
    import torch.multiprocessing as mp

    addr, port = _master(dist_url, num_machines)
    errors = mp.get_context("spawn").SimpleQueue()  # tracebacks in the order the processes failed
    context = mp.start_processes(_worker, nprocs=num_processes_per_machine, join=False, start_method="spawn",
                                 args=(main_func, num_processes_per_machine, num_machines, machine_rank, addr,
                                       port, tuple(args), timeout, errors))
    try:
        _join(context)
    except mp.ProcessRaisedException as exc:
        if errors.empty():
            raise
        # the first failure is the cause; the others' (a peer's connection reset) are its consequences
        rank, trace = errors.get()
        raise mp.ProcessRaisedException(f"\n\n-- Process {rank} failed first, with:\n{trace}", rank,
                                        exc.error_pid) from None


def default_backend(num_processes_per_machine: int = 1) -> str:
    """torch.distributed's backend for the default group: "nccl" when this machine has a GPU for every
    process and torch has NCCL, else "gloo"."""
    import torch
    import torch.distributed as dist

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "nccl" if dist.is_nccl_available() and gpus >= num_processes_per_machine > 0 else "gloo"


def init_process_group(backend: str, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> None:
    """Join torch.distributed's default group through env:// (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT), logging the backend, init method and URL; with NCCL, first select this process's
    first GPU (`local_devices`).

    Raises:
        RuntimeError: the group could not be joined; names the backend, init method, URL and timeout.
    """
    import torch
    import torch.distributed as dist

    rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
    url = f"tcp://{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    log.info("process %s of %s: init_process_group(%s) with init method env:// at %s", rank, world, backend, url)
    if backend == "nccl":
        torch.cuda.set_device(local_devices()[0])
    try:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    except (RuntimeError, ValueError) as exc:
        raise RuntimeError(f"process {rank} of {world}: init_process_group({backend!r}) failed with init method "
                           f"env:// at {url} (MASTER_ADDR:MASTER_PORT; timeout {timeout}): is process 0 running "
                           f"and is {url} reachable from here? {exc}") from exc


def _join(context: Any) -> None:
    """Wait for the processes (torch's join, which raises when one fails and stops the others). On
    Ctrl-C: SIGINT to each live process, wait for them (Ctrl-C ignored meanwhile), kill the ones left
    after INTERRUPT_GRACE_SEC, and re-raise."""
    try:
        while not context.join(timeout=0.1):
            pass
    except KeyboardInterrupt:
        with _ignoring_sigint():
            _stop(context.processes, INTERRUPT_GRACE_SEC)
        raise


class _ignoring_sigint:  # noqa: N801 - used as a context manager
    """SIGINT ignored inside (main thread only), the previous handler back on leaving."""

    def __enter__(self) -> None:
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, signal.SIG_IGN)

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def _alive(p: Any) -> bool:
    return p.is_alive() if hasattr(p, "is_alive") else p.poll() is None


def _worker(local_rank: int, main_func: Callable[..., Any], per_machine: int, num_machines: int, machine_rank: int,
            addr: str, port: int, args: tuple, timeout: datetime.timedelta, errors: Any,
            backend: str = "gloo") -> None:
    import torch
    import torch.distributed as dist

    rank = machine_rank * per_machine + local_rank
    os.environ.update(_environment(rank, local_rank, per_machine * num_machines, per_machine, machine_rank,
                                   addr, port))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # read by OpenMP only when torch started
    try:
        init_process_group(backend, timeout)
    except RuntimeError:
        errors.put((local_rank, traceback.format_exc()))
        raise
    try:
        main_func(*args)
    except BaseException:
        errors.put((local_rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m graphpar.launch`: run a script once per process with torchrun's variables set."""
    parser = argparse.ArgumentParser(prog="python -m graphpar.launch", description=__doc__.split("\n\nEvery")[0],
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1,
                        help="processes (shards) to start on this machine")
    parser.add_argument("--nnodes", type=int, default=1, help="machines in the job")
    parser.add_argument("--node-rank", "--node_rank", type=int, default=0, help="this machine's index, 0 to --nnodes - 1")
    parser.add_argument("--dist-url", default="auto", help="'auto' (a free local port) or tcp://HOST:PORT")
    parser.add_argument("-m", "--module", action="store_true", help="run `script` as a module (python -m)")
    parser.add_argument("script", help="the training script, or a module with -m")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own options")
    options = parser.parse_args(argv)
    if options.nproc_per_node < 1 or options.nnodes < 1 or not 0 <= options.node_rank < options.nnodes:
        parser.error("needs --nproc-per-node >= 1, --nnodes >= 1 and 0 <= --node-rank < --nnodes")
    try:
        addr, port = _master(options.dist_url, options.nnodes)
    except ValueError as exc:
        parser.error(str(exc))
    command = [sys.executable, *(["-m"] if options.module else []), options.script, *options.script_args]
    per, world = options.nproc_per_node, options.nproc_per_node * options.nnodes
    procs: dict[int, subprocess.Popen] = {}
    with _signals_raised():
        try:
            for k in range(per):
                procs[options.node_rank * per + k] = subprocess.Popen(command, env={**os.environ, **_environment(
                    options.node_rank * per + k, k, world, per, options.node_rank, addr, port)})
        except _Signalled as sig:
            _stop(list(procs.values()), 5.0, sig.signum)
            return 128 + sig.signum
        return _supervise(procs)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help shows each option's default (not a flag's False) and the description's line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help or "" if action.default is False else super()._get_help_string(action) or ""


class _Signalled(Exception):
    """SIGTERM (or another forwarded signal) reached the launcher."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_signalled(signum: int, _frame: Any) -> None:
    raise _Signalled(signum)


class _signals_raised:
    """Within the block, SIGTERM raises `_Signalled` (SIGINT raises KeyboardInterrupt already); the
    previous handler is put back after. Only the main thread can set handlers."""

    def __enter__(self) -> None:
        main = threading.current_thread() is threading.main_thread()
        self.previous = signal.signal(signal.SIGTERM, _raise_signalled) if main else None

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


def _command(args: Any) -> str:
    """A process's command line (Popen.args: a list, or one str or path), as a shell would read it."""
    return shlex.join(str(a) for a in args) if isinstance(args, (list, tuple)) else str(args)


def _supervise(procs: dict[int, subprocess.Popen], grace_sec: float = 5.0) -> int:
    """Wait for every process (by rank); when one fails, stop the others (SIGTERM, then SIGKILL after
    `grace_sec`) and return its exit code; on SIGTERM, forward it the same way and return 128 + its
    number; on Ctrl-C, each process gets a SIGINT and INTERRUPT_GRACE_SEC to stop (they print; the
    launcher does not), then 130. 0 when all succeed."""
    failed, forward = 0, int(signal.SIGTERM)
    running = dict(procs)
    try:
        while running and not failed:
            for rank, p in list(running.items()):
                code = p.poll()
                if code is not None:
                    del running[rank]
                    if code != 0:
                        failed = code
                        print(f"graphpar.launch: rank {rank} (pid {p.pid}) exited with {code}; its command: "
                              f"{_command(p.args)}; stopping the others", file=sys.stderr)
            time.sleep(0.05)
    except KeyboardInterrupt:
        failed, forward, grace_sec = 130, int(signal.SIGINT), INTERRUPT_GRACE_SEC
    except _Signalled as sig:
        failed, forward = 128 + sig.signum, sig.signum
    with _ignoring_sigint():
        _stop(list(running.values()), grace_sec, forward)
    return failed if failed > 0 else (1 if failed else 0)


def _stop(processes: Sequence[Any], grace_sec: float, signum: int = signal.SIGINT) -> None:
    """`signum` to each live process (`multiprocessing` or `subprocess` ones), then wait up to `grace_sec`
    for all of them, or PEER_GRACE_SEC once one has ended (a process blocked in C++ on a peer that left,
    e.g. joining the rendezvous, does not see a SIGINT); kill the ones left (at once after a second SIGTERM)."""
    alive = [p for p in processes if _alive(p)]
    for p in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signum)
    deadline = time.monotonic() + grace_sec
    try:
        while any(_alive(p) for p in alive) and time.monotonic() < deadline:
            if not all(_alive(p) for p in alive):
                deadline = min(deadline, time.monotonic() + PEER_GRACE_SEC)
            time.sleep(0.05)
    except _Signalled:  # a second SIGTERM: kill at once
        pass
    for p in alive:
        if _alive(p):
            p.kill()
        if hasattr(p, "join"):
            p.join()
        else:
            p.wait()


if __name__ == "__main__":
    sys.exit(main())
