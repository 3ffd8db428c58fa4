"""Start one training process per shard, as Detectron2's `launch`, or as a command like torchrun.

    from graphpar import launch
    launch.launch(main, num_processes_per_machine=2, args=(...,))        # in Python

    python -m graphpar.launch --nproc-per-node 2 train.py --epochs 3      # from the shell
    python -m graphpar.launch --nproc-per-node 2 -m graphpar.examples.train --devices 2
    python -m graphpar.launch --nproc-per-node 2 --max-restarts 3 train.py       # restart when one dies
    python -m graphpar.launch --nproc-per-node 2 --nnodes 2 --node-rank 0 --dist-url tcp://HOST:PORT train.py
    python -m graphpar.launch --nproc-per-node 2 --nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT train.py

Both run on torch's elastic agent, torchrun's (`torch.distributed.run`, see `graphpar.parallel.agent`):
every process gets torchrun's environment variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_RUN_ID), so a script
written for the launcher also runs under `torchrun`, and `rendezvous()` gives the
`Parallelize(rendezvous=...)` dict for it (kv_handler=None: torch.distributed's default group, joined
through env://). With `--max-restarts N` the agent starts the whole group again when a process dies
(SIGKILL, an exception, an out-of-memory kill), up to N times; a restarted process sees
TORCHELASTIC_RESTART_COUNT > 0 (`restart_count()`) and graphpar's Trainer and trainers then continue
from the last checkpoint their job wrote. Each process gets an equal share of this machine's cores
(OMP_NUM_THREADS, unless set). When a process fails, the launcher names its rank, how it ended and its
command, and restarts the group or stops the others and exits with its status. SIGTERM, SIGINT
(Ctrl-C), SIGHUP and SIGQUIT to the launcher go to every process, which gets the shutdown timeout to
exit before it is killed (a second signal other than Ctrl-C kills at once); the launcher then exits
with 128 + the signal's number (130 after Ctrl-C) and prints nothing itself (rank 0 says where it
stopped). No process outlives it.
"""

from __future__ import annotations

from graphpar.parallel import early_exit

if __name__ == "__main__":  # `python -m graphpar.launch`: from now on a signal before the processes start ends it
    early_exit.exit_on_signals()

import argparse  # noqa: E402
import datetime  # noqa: E402
import importlib.util  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402
from urllib.parse import urlparse  # noqa: E402

from graphpar.parallel.elastic import restart_count  # noqa: E402

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
_STATIC_RESTARTS = ("torch's static rendezvous keeps one store for every attempt, where a restarted group meets the "
                    "keys of the processes it replaces and cannot start; for restarts across machines use "
                    "--rdzv-backend c10d --rdzv-endpoint HOST:PORT (one machine: leave --dist-url at auto)")
_TOOLS = "graphpar.examples"  # graphpar's command-line tools: each takes Ctrl-C first thing
log = logging.getLogger(__name__)

__all__ = ["DEFAULT_TIMEOUT", "default_backend", "get_local_rank", "get_rank", "get_world_size",
           "init_process_group", "is_main_process", "launch", "local_devices", "main", "rendezvous",
           "restart_count"]


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


def launch(main_func: Callable[..., Any], num_processes_per_machine: int, num_machines: int = 1,
           machine_rank: int = 0, dist_url: str = "auto", args: Sequence[Any] = (),
           timeout: datetime.timedelta = DEFAULT_TIMEOUT, backend: str | None = None, max_restarts: int = 0) -> None:
    """Run `main_func(*args)` in `num_processes_per_machine` spawned processes on this machine (machine
    `machine_rank` of `num_machines`), each inside torch.distributed's default group (`backend`, default
    `default_backend`: NCCL with a GPU per process, else gloo; joined at `dist_url` within `timeout`,
    see `init_process_group`). One process in all: `main_func` runs here. The processes run on torch's
    elastic agent, as the command's do (it starts the processes of a Python function with
    torch.multiprocessing's spawn); with `max_restarts` (the c10d rendezvous: dist_url "auto") it
    starts them all again when one fails.

    Raises:
        ValueError: bad counts or dist_url.
        torch.multiprocessing.ProcessRaisedException: a process raised (its traceback in the message);
            ProcessExitedException: one ended otherwise (killed, exit status); the others were stopped.
        KeyboardInterrupt: Ctrl-C; every process got a SIGINT and has ended (killed after the agent's
            shutdown timeout, TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default). After SIGTERM, SIGHUP or
            SIGQUIT the processes are stopped the same way, then the signal is raised again here, for the
            handler this process had before.
    """
    if num_processes_per_machine < 1 or num_machines < 1 or not 0 <= machine_rank < num_machines:
        raise ValueError(f"launch: needs num_processes_per_machine >= 1, num_machines >= 1 and 0 <= machine_rank < "
                         f"num_machines, got {num_processes_per_machine}, {num_machines}, {machine_rank}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"launch: max_restarts must be an int >= 0, got {max_restarts!r}")
    if num_processes_per_machine * num_machines == 1:
        main_func(*args)
        return
    backend_of, endpoint, run_id = _rendezvous_of(dist_url, num_machines)
    if max_restarts and backend_of == "static":
        raise ValueError(f"launch: {_STATIC_RESTARTS}")
    import torch.multiprocessing as mp

    from graphpar.parallel import agent

    config = _config(num_processes_per_machine, num_machines, machine_rank, (backend_of, endpoint, run_id),
                     max_restarts, rendezvous_timeout=int(timeout.total_seconds()))
    name = f"{getattr(main_func, '__module__', '?')}.{getattr(main_func, '__qualname__', main_func)}"
    raised = mp.get_context("spawn").SimpleQueue()  # what each process raised, and when
    work = (main_func, tuple(args), backend or default_backend(num_processes_per_machine), timeout,
            agent.threads_per_process(num_processes_per_machine), raised)
    try:
        result = agent.run(config, _worker, work, name, _log_restart, block_sigint=True)
    except agent.Signalled as signalled:
        if signalled.signum == signal.SIGINT:
            raise KeyboardInterrupt from None
        os.kill(os.getpid(), signalled.signum)  # the processes have ended: now this process's own handler
        raise
    if result.is_failed():
        found = []
        while not raised.empty():
            found.append(raised.get())
        raise _failure(result.failures, found)


def _log_restart(line: str, final: bool) -> None:
    """`launch`'s report of a failure: logged when the group restarts (a final one is raised)."""
    if not final:
        log.warning("%s", line)


def _config(per_machine: int, machines: int, machine_rank: int, rendezvous: tuple[str, str, str], max_restarts: int,
            rendezvous_timeout: int = 900) -> Any:
    """torch's LaunchConfig: `machines` x `per_machine` processes meeting at `rendezvous` (backend,
    endpoint, run id; this machine is `machine_rank` of the static one), spawned as torchrun does."""
    from graphpar.parallel import agent

    backend, endpoint, run_id = rendezvous
    return agent.LaunchConfig(min_nodes=machines, max_nodes=machines, nproc_per_node=per_machine, run_id=run_id,
                              rdzv_backend=backend, rdzv_endpoint=endpoint, max_restarts=max_restarts,
                              rdzv_configs={"timeout": rendezvous_timeout,
                                            **({"rank": machine_rank} if backend == "static" else {})})


def _rendezvous_of(dist_url: str, num_machines: int) -> tuple[str, str, str]:
    """(rendezvous backend, endpoint, run id) for `dist_url`: "auto" is the c10d rendezvous on a free
    local port (one machine only, as torchrun's --standalone); tcp://HOST:PORT the static one at machine
    0's HOST:PORT, where every machine's agent uses the same run id."""
    if dist_url == "auto":
        if num_machines != 1:
            raise ValueError("launch: dist_url='auto' works on one machine only; pass tcp://HOST:PORT of machine 0")
        return "c10d", "localhost:0", str(uuid.uuid4())
    url = urlparse(dist_url)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"launch: dist_url must be 'auto' or tcp://HOST:PORT, got {dist_url!r}")
    return "static", f"{url.hostname}:{url.port}", f"graphpar-{url.hostname}-{url.port}"


def _failure(failures: dict, raised: list[tuple[int, int, int, float, str]]) -> Exception:
    """The exception `launch` raises: the traceback of the process that raised first in the last attempt
    (a peer's error, such as a connection reset, follows it), or how the agent saw one end (a killed
    process is the cause of the others' errors)."""
    import torch.multiprocessing as mp

    from graphpar.parallel import agent

    rank, failure = agent.first_failure(failures)
    last = max((attempt for attempt, *_ in raised), default=None)
    if failure.exitcode >= 0 and last is not None:
        _, rank, pid, _, trace = min((r for r in raised if r[0] == last), key=lambda r: r[3])
        return mp.ProcessRaisedException(f"\n\n-- Process {rank} failed first, with:\n{trace}", rank, pid)
    how = f"exited with {failure.exitcode}" if failure.exitcode >= 0 else f"was killed by {failure.signal_name()}"
    return mp.ProcessExitedException(f"process {rank} (pid {failure.pid}) {how}", rank, failure.pid,
                                     failure.exitcode, failure.signal_name() if failure.exitcode < 0 else None)


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


def _worker(main_func: Callable[..., Any], args: tuple, backend: str, timeout: datetime.timedelta,
            threads: str, raised: Any) -> Any:
    """A process of `launch`: take Ctrl-C (started with SIGINT blocked: one that came meanwhile lands
    here, before anything ran), use its share of the cores, join the default group, run `main_func`;
    what it raises goes to `raised` too, with the time."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    import torch
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = threads
    torch.set_num_threads(int(threads))  # read by OpenMP only when torch started
    try:
        init_process_group(backend, timeout)
        return main_func(*args)
    except Exception:  # when it raised: before leaving the group, which makes the peers raise too
        raised.put((restart_count(), get_rank(), os.getpid(), time.time(), traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m graphpar.launch`: torchrun's agent runs the script once per process (see the module
    docstring); returns the exit status: 0, a failed process's status (1 if a signal killed it), or 128 +
    the signal the launcher got."""
    parser = argparse.ArgumentParser(prog="python -m graphpar.launch", description=__doc__.split("\n\nBoth")[0],
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1,
                        help="processes (shards) to start on this machine")
    parser.add_argument("--nnodes", default="1", help="machines in the job (a range MIN:MAX is refused: a fixed "
                        "number of processes shares each global batch)")
    parser.add_argument("--node-rank", "--node_rank", type=int, default=0,
                        help="this machine's index, 0 to --nnodes - 1 (with --dist-url; c10d numbers the machines)")
    parser.add_argument("--dist-url", default="auto", help="'auto' (one machine: a rendezvous on a free local port) "
                        "or tcp://HOST:PORT of machine 0 (the static rendezvous)")
    parser.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                        help="times to start the whole group again when a process fails")
    parser.add_argument("--rdzv-backend", "--rdzv_backend", default="static", choices=("static", "c10d"),
                        help="torchrun's rendezvous: 'static' (--dist-url) or 'c10d' (--rdzv-endpoint)")
    parser.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="",
                        help="HOST:PORT of the rendezvous (c10d: the same on every machine; no shared file system)")
    parser.add_argument("--rdzv-id", "--rdzv_id", default="none", help="the job's id, the same on every machine")
    parser.add_argument("--standalone", action="store_true",
                        help="one machine: a c10d rendezvous on a free local port (what 'auto' does)")
    parser.add_argument("--shutdown-timeout", "--shutdown_timeout", type=int, default=30,
                        help="seconds the processes get to exit after a signal before they are killed")
    parser.add_argument("-m", "--module", action="store_true", help="run `script` as a module (python -m)")
    parser.add_argument("script", help="the training script, or a module with -m")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own options")
    options = parser.parse_args(argv)
    try:
        rendezvous = _rendezvous_options(options)
    except ValueError as exc:
        parser.error(str(exc))
    from graphpar.parallel import agent  # torch loads here, after --help and the checks

    os.environ["OMP_NUM_THREADS"] = agent.threads_per_process(options.nproc_per_node)  # the agent passes it on
    config = _config(options.nproc_per_node, options.nnodes, options.node_rank, rendezvous, options.max_restarts)
    program = os.environ.get("PYTHON_EXEC", sys.executable)  # what torchrun runs: python -u [-m] script args
    program_args = ["-u", *(["-m"] if options.module else []), options.script, *options.script_args]
    try:
        result = agent.run(config, program, program_args, shlex.join([program, *program_args]),
                           lambda line, final: _say(line), block_sigint=_takes_sigint_itself(options),
                           shutdown_timeout=options.shutdown_timeout)
    except agent.Signalled as signalled:
        if signalled.signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while this one ends says nothing more
            if not signalled.told:  # no process of the job heard it, so none says it
                _say("\ninterrupted")
        return 128 + signalled.signum
    except (agent.RendezvousError, RuntimeError) as exc:  # one line, as for a process that failed
        _say(f"graphpar.launch: the rendezvous failed: {type(exc).__name__}: {exc}")
        return 1
    if not result.is_failed():
        return 0
    _, failure = agent.first_failure(result.failures)
    return failure.exitcode if failure.exitcode > 0 else 1


def _takes_sigint_itself(options: argparse.Namespace) -> bool:
    """Whether the program is one of graphpar's command-line tools (`-m graphpar.examples.train`, or its
    file), which unblock SIGINT as soon as their own Ctrl-C handler is in place
    (`graphpar.examples.interrupt`); their processes then start with it blocked. Any other program starts
    as under torchrun, SIGINT open: a Ctrl-C during its start-up is Python's KeyboardInterrupt."""
    if options.module:
        return options.script.startswith(_TOOLS + ".")
    tools = importlib.util.find_spec(_TOOLS)  # not __file__: `-m graphpar.launch` runs this module without one
    if tools is None or tools.origin is None:
        return False
    return Path(options.script).resolve().parent == Path(tools.origin).resolve().parent


def _rendezvous_options(options: argparse.Namespace) -> tuple[str, str, str]:
    """(rendezvous backend, endpoint, run id) of the launcher's options, as torchrun's, checked (ValueError
    names the option and the fix); `options.nnodes` becomes a number."""
    nodes = options.nnodes.split(":")
    if len(nodes) == 2 and nodes[0] != nodes[1]:
        raise ValueError(f"--nnodes {options.nnodes}: a changing number of machines is not supported (each global "
                         f"batch is split over a fixed number of processes, and a resume is exact on the same "
                         f"layout); pass one number, e.g. --nnodes {nodes[1]}")
    if len(nodes) > 2 or not nodes[0].isdigit() or int(nodes[0]) < 1:
        raise ValueError(f"--nnodes must be a number >= 1, got {options.nnodes!r}")
    count = options.nnodes = int(nodes[0])
    if options.nproc_per_node < 1 or options.max_restarts < 0 or options.shutdown_timeout < 0:
        raise ValueError("needs --nproc-per-node >= 1, --max-restarts >= 0 and --shutdown-timeout >= 0")
    backend, endpoint, url = options.rdzv_backend, options.rdzv_endpoint, options.dist_url
    if backend != "static":
        if url != "auto" or options.node_rank or options.standalone:
            raise ValueError(f"--rdzv-backend {backend} numbers the machines itself at --rdzv-endpoint: drop "
                             f"--dist-url, --node-rank and --standalone")
        if not endpoint:
            raise ValueError(f"--rdzv-backend {backend} needs --rdzv-endpoint HOST:PORT (the same on every machine)")
        return backend, endpoint, options.rdzv_id
    if not 0 <= options.node_rank < count:
        raise ValueError(f"needs 0 <= --node-rank < --nnodes, got {options.node_rank} and {count}")
    if url != "auto" and endpoint:
        raise ValueError("--dist-url and --rdzv-endpoint both give the rendezvous' address: pass one of them")
    if url != "auto" or endpoint:
        if options.max_restarts:
            raise ValueError(f"--max-restarts with --dist-url / --rdzv-endpoint: {_STATIC_RESTARTS}")
        if options.standalone:
            raise ValueError("--standalone starts its own rendezvous: drop --dist-url / --rdzv-endpoint")
        run_id = options.rdzv_id
        if url != "auto":
            _, endpoint, run_id = _rendezvous_of(url, count)
        return "static", endpoint, run_id
    if count != 1:
        raise ValueError(f"--nnodes {count}: pass --dist-url tcp://HOST:PORT of machine 0 (and --node-rank), or "
                         f"--rdzv-backend c10d --rdzv-endpoint HOST:PORT")
    return _rendezvous_of("auto", 1)  # torchrun's --standalone


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help shows each option's default (not a flag's False, nor an empty one) and the description's line
    breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is False or action.default == "":
            return action.help or ""
        return super()._get_help_string(action) or ""


if __name__ == "__main__":
    sys.exit(main())
