"""Run a group of processes on torch's elastic agent (torchrun's `LocalElasticAgent`), with graphpar's additions.

The agent starts the processes with torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_RUN_ID, ...), watches them, meets the other
machines' agents through the rendezvous (static: node 0's address; c10d: one endpoint, no shared file
system), starts the whole group again when a process dies (up to `max_restarts` times), and stops every
process when the launcher gets a signal (that signal, then SIGKILL after the shutdown timeout). `run`
adds what graphpar promises on top of it:

- a line naming the rank that failed, its pid, how it ended, its command and what happens next (the group
  restarts, or the others were stopped);
- graphpar's handler for SIGTERM, SIGINT, SIGHUP and SIGQUIT: the first stops the group as the agent's
  own handler would; a second one other than Ctrl-C's kills the processes at once (a second Ctrl-C is
  ignored while they finish their step), where the agent's handler would have broken off its own
  shutdown; the caller's handlers come back afterwards (`launch.launch` runs inside a user's process);
- processes that take Ctrl-C themselves once they can stop cleanly (those of a Python function, whose
  entry point does it, and graphpar's command-line tools) start with SIGINT blocked, so a Ctrl-C during
  their start-up (their interpreter, their imports) waits for that instead of printing a traceback from
  the middle of an import;
- whether the processes got the signal (`Signalled.told`): before they started, no one else reports it;
- torch's elastic logs kept quiet (graphpar says what happened) unless LOGLEVEL asks for them, as
  torchrun's are, and the agent's error files in a temporary directory removed at the end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rendezvous_registry
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig

from graphpar.parallel.early_exit import SIGNALS

__all__ = ["SIGNALS", "LaunchConfig", "RendezvousError", "Signalled", "first_failure", "run", "threads_per_process"]

PEER_GRACE_SEC = 5.0  # once one process has ended after a signal, how long the others get
_TORCH_SIGNALS = "TORCHELASTIC_SIGNALS_TO_HANDLE"  # the signals torch's process context takes over
_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # "1": a new store for the processes of each attempt
_TORCH_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")


class Signalled(Exception):
    """The launcher got signal `signum`; every process of the group has ended. `told`: running processes
    got it too (False: it came before any had started, or after they had all ended)."""

    def __init__(self, signum: int, told: bool = False) -> None:
        super().__init__(f"got {signal.Signals(signum).name}")
        self.signum, self.told = int(signum), told


def threads_per_process(processes: int) -> str:
    """OMP_NUM_THREADS for each of `processes` processes on this machine: the one set, else an equal
    share of the cores this process may use (gloo's and PyTorch's threads of several processes
    oversubscribe the CPU otherwise)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return os.environ.get("OMP_NUM_THREADS") or str(max(1, cores // max(1, processes)))


def run(config: LaunchConfig, entrypoint: Callable[..., Any] | str, args: Sequence[Any], command: str,
        report: Callable[[str, bool], None], block_sigint: bool = False,
        shutdown_timeout: float | None = None) -> RunResult:
    """Run `entrypoint(*args)` (a function, or a program and its arguments) as `config` says, on torch's
    agent, until the group succeeds or fails for good. `command` names what runs in the line
    `report(line, final)` gets for each failure (`final`: no restart follows). `block_sigint`: the
    processes start with SIGINT blocked (their entry point unblocks it once it can stop cleanly). From
    the call on, SIGNALS stop the run (a signal ignored on entry stays ignored).
    `shutdown_timeout`: seconds the processes get to exit after a signal (default: torch's,
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30).

    Raises:
        Signalled: the launcher got one of SIGNALS; the processes got it and have ended.
        RuntimeError: the rendezvous was closed by another agent.
        torch's RendezvousError: the rendezvous failed (timeout, endpoint unreachable).
    """
    signals = _Signals()
    spec: WorkerSpec | None = None
    logs: str | None = None
    closed = True  # the rendezvous is closed at the end, unless a signal stopped this agent (as torchrun)
    try:
        with signals, _quiet_torch_logs(), _environment(config):  # a signal from here on stops the run
            run_id = config.run_id or str(uuid.uuid4())
            params = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=run_id,
                                          min_nodes=config.min_nodes, max_nodes=config.max_nodes,
                                          local_addr=config.local_addr, **config.rdzv_configs)
            addr, port = (None, None)
            if config.rdzv_backend == "static":  # the processes meet at node 0's store, as torchrun's static one
                addr, port = parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=-1)
            spec = WorkerSpec(role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint,
                              args=tuple(args), rdzv_handler=rendezvous_registry.get_rendezvous_handler(params),
                              max_restarts=config.max_restarts, monitor_interval=config.monitor_interval,
                              master_addr=addr, master_port=port, local_addr=config.local_addr)
            logs = tempfile.mkdtemp(prefix="graphpar_launch_")
            grace = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30)) if shutdown_timeout is None \
                else shutdown_timeout
            agent = _Agent(spec, DefaultLogsSpecs(log_dir=logs), config.start_method, grace, command, report,
                           signals, block_sigint)
            signals.agent = agent
            result = agent.run()
    except SignalException as exc:
        closed = False
        raise Signalled(exc.sigval, signals.told) from None
    finally:
        if closed and spec is not None:
            with contextlib.suppress(Exception):
                spec.rdzv_handler.shutdown()
        if logs is not None:
            shutil.rmtree(logs, ignore_errors=True)
    if result is None:  # the agent left a rendezvous another agent closed
        raise RuntimeError("the rendezvous was closed by another node's launcher before this one's processes ran")
    return result


def first_failure(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """(global rank, failure) of the process that failed first, as far as the agent can tell: the earliest
    (torch's timestamps count seconds; ties in rank order) of those that did not end by the agent's own
    SIGTERM (it stops the others after a failure)."""
    own = {rank: f for rank, f in failures.items() if f.exitcode != -signal.SIGTERM} or failures
    return min(own.items(), key=lambda item: item[1].timestamp)


def describe(rank: int, failure: ProcessFailure, command: str, restarts_left: int, max_restarts: int) -> str:
    """The line said when a process fails: who, how, its command, and what happens next."""
    raised = failure.message.get("message") if isinstance(failure.message, dict) else None
    how = (f"raised {raised}" if raised else f"exited with {failure.exitcode}" if failure.exitcode >= 0
           else f"was killed by {failure.signal_name()}")
    if restarts_left > 0:
        then = f"restarting the group (restart {max_restarts - restarts_left + 1} of {max_restarts})"
    else:
        then = "stopped the others" + (f" after {max_restarts} restart(s)" if max_restarts else "")
    return f"graphpar.launch: rank {rank} (pid {failure.pid}) {how}; its command: {command}; {then}"


class _Agent(LocalElasticAgent):
    """torch's agent, saying which process failed before it restarts or stops the group, stopping its
    processes with a grace for peers left waiting on one that ended, and able to kill them at once."""

    def __init__(self, spec: WorkerSpec, logs: DefaultLogsSpecs, start_method: str, shutdown_timeout: float,
                 command: str, report: Callable[[str, bool], None], signals: _Signals, block_sigint: bool) -> None:
        super().__init__(spec, logs, start_method)
        self._command, self._report, self._signals = command, report, signals
        self._grace, self._block_sigint = shutdown_timeout, block_sigint

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        # a stop half-way through starting them would leave some behind; they inherit the blocked SIGINT
        with self._signals.deferred(), _sigint_blocked() if self._block_sigint else contextlib.nullcontext():
            return super()._start_workers(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._signals.check()  # a stop that torch's code caught on its way (it is an Exception) comes again
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED and result.failures:
            rank, failure = first_failure(result.failures)
            self._report(describe(rank, failure, self._command, self._remaining_restarts,
                                  worker_group.spec.max_restarts), self._remaining_restarts == 0)
        return result

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, *args: Any, **kwargs: Any) -> None:
        """Stop the processes: `death_sig` to each, then wait for them all, for at most the shutdown timeout,
        or PEER_GRACE_SEC once one has ended (a process blocked in C++ on a peer that left, e.g. in a
        rendezvous, sees no SIGINT); SIGKILL the ones left; then torch's clean-up."""
        context = self._pcontext
        # Processes of a function that has returned wait until the agent has read its value (torch's
        # MultiprocessContext); a group being stopped has none to read: let them exit now.
        finished = getattr(context, "_worker_finished_event", None)
        if finished is not None:
            finished.set()
        pids = list(context.pids().values()) if context is not None else []
        if self._signals.received is not None and not all(_ended(pid) for pid in pids):
            self._signals.told = True
        for pid in pids:
            _send(pid, death_sig)
        deadline = time.monotonic() + self._grace
        while pids and not all(_ended(pid) for pid in pids) and time.monotonic() < deadline:
            if any(_ended(pid) for pid in pids):
                deadline = min(deadline, time.monotonic() + PEER_GRACE_SEC)
            time.sleep(0.05)
        self.kill_now()
        super()._shutdown(death_sig, *args, **kwargs)  # torch's: waits for nothing now, closes the logs

    def kill_now(self) -> None:
        """SIGKILL every live process of the group (a command's whole process group: it leads its own session)."""
        context = self._pcontext
        if context is None:
            return
        for pid in context.pids().values():
            if not _ended(pid):
                _send(pid, signal.SIGKILL)


class _Signals:
    """graphpar's handler of SIGNALS while a group runs (main thread only; see the module docstring).
    torch's process context would set its own handler before it starts the processes (see
    `_environment`), one that stops the agent half-way through starting them; graphpar's waits until
    they have all started."""

    def __init__(self) -> None:
        self.agent: _Agent | None = None
        self.received: int | None = None  # the first signal
        self.told = False  # ... and whether the agent sent it to running processes
        self.starting = False
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.getsignal(s) for s in SIGNALS if signal.getsignal(s) != signal.SIG_IGN}
            for signum in self.previous:
                signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Inside, a first signal only is noted; it stops the agent on leaving."""
        self.starting = True
        try:
            yield
        finally:
            self.starting = False
        self.check()

    def check(self) -> None:
        """Stop the agent if a signal came: raise torch's SignalException, which its `run` takes for one."""
        if self.received is not None:
            signum = signal.Signals(self.received)
            raise SignalException(f"graphpar.launch got {signum.name}", signum)

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signum  # the agent sends it to every process, kills the ones left after its timeout
            if not self.starting:
                self.check()
        elif signum != signal.SIGINT and self.agent is not None:
            self.agent.kill_now()


def _send(pid: int, signum: int) -> None:
    """`signum` to process `pid`, and to its process group when it leads one (a command the agent started
    in a session of its own, with whatever it started), as torch's agent sends it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)


def _ended(pid: int) -> bool:
    """Whether process `pid` has ended (gone, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] in ("Z", "X")
    except OSError:  # gone, or no /proc
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread, so the processes it starts inherit the block; one that came
    meanwhile is handled on leaving."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def _environment(config: LaunchConfig) -> Iterator[None]:
    """Inside, torch's process context sets no signal handler of its own (TORCHELASTIC_SIGNALS_TO_HANDLE
    empty: graphpar's `_Signals` handle them), and with restarts the c10d rendezvous gives each attempt
    a fresh store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE: in the one store torch shares across attempts, a
    restarted group met the keys the previous attempt's processes left, and init_process_group hung)."""
    values = {_TORCH_SIGNALS: ""}
    if config.max_restarts > 0 and config.rdzv_backend == "c10d":
        values[_SHARED_STORE] = "1"
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch's elastic loggers print nothing inside (graphpar reports failures itself), unless LOGLEVEL
    is set, which torchrun users set to see them."""
    if "LOGLEVEL" in os.environ:
        yield
        return
    saved = []
    for name in _TORCH_LOGGERS:
        logger = logging.getLogger(name)
        quiet = logging.NullHandler()
        saved.append((logger, logger.propagate, quiet))
        logger.addHandler(quiet)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, propagate, quiet in saved:
            logger.removeHandler(quiet)
            logger.propagate = propagate
