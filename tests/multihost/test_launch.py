"""graphpar.launch: processes with torchrun's variables in one default group; a failure stops them all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from graphpar import launch
from tests.multihost import workers

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_launch_runs_one_process_per_rank_in_one_group_on_an_auto_port(tmp_path: Path) -> None:
    launch.launch(workers.report_rank, 2, args=(str(tmp_path),))
    assert (tmp_path / "rank0").read_text() == "2 0 True 2"
    assert (tmp_path / "rank1").read_text() == "2 1 False 2"


@pytest.mark.slow
def test_a_failing_process_stops_the_others_and_its_traceback_is_raised(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 fails on purpose"):
        launch.launch(workers.fail_on_rank_1, 2, args=(str(tmp_path),))
    assert time.monotonic() - start < 60
    pid = int((tmp_path / "pid0").read_text()) if (tmp_path / "pid0").exists() else None
    if pid is not None:  # rank 0 was stopped, not left behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_one_process_runs_in_place_and_bad_arguments_are_refused(tmp_path: Path) -> None:
    seen = []
    launch.launch(seen.append, 1, args=("here",))
    assert seen == ["here"]
    with pytest.raises(ValueError, match="one machine only"):
        launch.launch(seen.append, 2, num_machines=2, machine_rank=0)
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        launch.launch(seen.append, 2, dist_url="http://x")
    assert launch.rendezvous() is None and launch.get_rank() == 0 and launch.get_world_size() == 1


SCRIPT = """
import os, sys, time
rank = int(os.environ["RANK"])
open(os.path.join(sys.argv[1], f"env{rank}"), "w").write(" ".join(os.environ[k] for k in (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")))
if sys.argv[2] == "fail" and rank == 1:
    sys.exit(7)
if sys.argv[2] == "fail":
    time.sleep(60)
"""


def test_the_command_sets_torchrun_variables_and_a_failure_stops_the_rest(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "graphpar.launch", "--nproc-per-node", "2", str(script), str(tmp_path)]
    done = subprocess.run([*command, "ok"], cwd=ROOT, timeout=60)
    assert done.returncode == 0
    assert (tmp_path / "env0").read_text() == "0 0 2 2 0 127.0.0.1"
    assert (tmp_path / "env1").read_text() == "1 1 2 2 0 127.0.0.1"
    start = time.monotonic()
    failed = subprocess.run([*command, "fail"], cwd=ROOT, timeout=60, capture_output=True, text=True)
    assert failed.returncode == 7
    assert "rank 1 (pid " in failed.stderr and "exited with 7; its command: " in failed.stderr
    assert f"{script} {tmp_path} fail; stopping the others" in failed.stderr  # issue 23 item 18: rank and command
    assert time.monotonic() - start < 30
    module = subprocess.run([sys.executable, "-m", "graphpar.launch", "--nproc-per-node", "2", "-m", "this"], cwd=ROOT,
                            timeout=60, capture_output=True, text=True)
    assert module.returncode == 0 and module.stdout.count("Beautiful is better than ugly") == 2


STUBBORN = """
import os, signal, sys, time
rank, where, mode = os.environ["RANK"], sys.argv[1], sys.argv[2]

def on_signal(signum, _frame):
    open(os.path.join(where, f"signal{rank}"), "w").write(str(signum))
    if mode == "exit":
        sys.exit(0)

signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGINT, on_signal)
open(os.path.join(where, f"pid{rank}"), "w").write(str(os.getpid()))
while True:
    time.sleep(0.05)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _signal_the_launcher(tmp_path: Path, signum: int, mode: str) -> tuple[int, list[int], float]:
    """Start the launcher on two STUBBORN processes, send it `signum` once both run; return its exit
    code, the children's pids and the seconds it took to exit. Leaves no child behind."""
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    launcher = subprocess.Popen([sys.executable, "-m", "graphpar.launch", "--nproc-per-node", "2", str(script),
                                 str(tmp_path), mode], cwd=ROOT)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while len(pids) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = [int(f.read_text()) for f in tmp_path.glob("pid*") if f.read_text()]
        assert len(pids) == 2, "the processes did not start"
        time.sleep(0.2)  # both have set their handlers before writing their pid
        start = time.monotonic()
        launcher.send_signal(signum)
        code = launcher.wait(timeout=30)
        return code, pids, time.monotonic() - start
    finally:
        launcher.kill()
        launcher.wait()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_is_forwarded_to_every_process(tmp_path: Path, signum: int) -> None:
    """Issue 23 item 9: SIGTERM to the launcher left its processes running."""
    code, pids, seconds = _signal_the_launcher(tmp_path, signum, "exit")
    assert code == 128 + signum and seconds < 5
    assert [(tmp_path / f"signal{rank}").read_text() for rank in (0, 1)] == [str(int(signum))] * 2
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.slow
def test_a_process_that_ignores_the_signal_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    code, pids, seconds = _signal_the_launcher(tmp_path, signal.SIGTERM, "ignore")
    assert code == 128 + signal.SIGTERM and 4 < seconds < 20
    assert (tmp_path / "signal0").exists() and (tmp_path / "signal1").exists()
    assert not any(_alive(pid) for pid in pids)
