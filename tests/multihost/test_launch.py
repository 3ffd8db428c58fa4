"""graphpar.launch on torch's elastic agent: processes with torchrun's variables in one default group, the
backend asked for, a failure that names the rank and its command, restarts after a killed rank or an
exception, every signal to the launcher reaching every process, and two agents meeting over c10d."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch.multiprocessing as mp

from graphpar import launch
from tests.multihost import workers

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 90  # seconds any launcher here may take


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "graphpar.launch", *args]


# ---- launch.launch: Detectron2's Python API -----------------------------------------------------------


@pytest.mark.slow
def test_launch_runs_one_process_per_rank_in_one_group_with_the_backend_asked_for(tmp_path: Path) -> None:
    """Issue 34 item 1: `backend=` was dropped and every process joined a gloo group. The backend here is
    gloo under another name, so what each process's default group reports is what launch passed on."""
    launch.launch(workers.report_rank, 2, args=(str(tmp_path),), backend=workers.TEST_BACKEND)
    share = max(1, len(os.sched_getaffinity(0)) // 2) if "OMP_NUM_THREADS" not in os.environ \
        else int(os.environ["OMP_NUM_THREADS"])
    # SIGINT blocked while the process started (a Ctrl-C then waits for it), taken when the function runs
    assert (tmp_path / "rank0").read_text() == f"2 0 True 2 {workers.TEST_BACKEND} {share} True False"
    assert (tmp_path / "rank1").read_text() == f"2 1 False 2 {workers.TEST_BACKEND} {share} True False"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the caller's handlers are back
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


@pytest.mark.slow
def test_a_failing_process_stops_the_others_and_its_traceback_is_raised(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 fails on purpose"):
        launch.launch(workers.fail_on_rank_1, 2, args=(str(tmp_path),))
    assert time.monotonic() - start < LIMIT
    pid = int((tmp_path / "pid0").read_text()) if (tmp_path / "pid0").exists() else None
    if pid is not None:  # rank 0 was stopped, not left behind
        assert not _alive(pid)


def test_one_process_runs_in_place_and_bad_arguments_are_refused(tmp_path: Path) -> None:
    seen = []
    launch.launch(seen.append, 1, args=("here",))
    assert seen == ["here"]
    with pytest.raises(ValueError, match="one machine only"):
        launch.launch(seen.append, 2, num_machines=2, machine_rank=0)
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        launch.launch(seen.append, 2, dist_url="http://x")
    with pytest.raises(ValueError, match="max_restarts must be an int >= 0"):
        launch.launch(seen.append, 2, max_restarts=-1)
    with pytest.raises(ValueError, match="static rendezvous keeps one store for every attempt"):
        launch.launch(seen.append, 2, dist_url="tcp://127.0.0.1:1", max_restarts=1)
    assert launch.rendezvous() is None and launch.get_rank() == 0 and launch.get_world_size() == 1
    assert launch.restart_count() == 0


# ---- python -m graphpar.launch --------------------------------------------------------------------------


SCRIPT = """
import os, signal, sys, time
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
open(os.path.join(sys.argv[1], f"env{rank}_{attempt}"), "w").write(" ".join(os.environ[k] for k in (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT",
    "OMP_NUM_THREADS")))
if sys.argv[2] == "fail" and rank == 1:
    sys.exit(7)
if sys.argv[2] == "faults" and (rank, attempt) in ((1, 0), (0, 1)):
    while not os.path.exists(os.path.join(sys.argv[1], f"env{1 - rank}_{attempt}")):
        time.sleep(0.05)                             # the other one has started
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)         # a killed rank: the group restarts
    raise RuntimeError("an exception on purpose")  # an exception in a rank: it restarts again
if sys.argv[2] == "fail" or (sys.argv[2] == "faults" and attempt < 2):
    time.sleep(60)                                 # the others are stopped, not waited for
"""


def test_the_command_sets_torchrun_variables_and_a_failure_names_the_rank_and_its_command(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "3"}
    done = subprocess.run(_command("--nproc-per-node", "2", str(script), str(tmp_path), "ok"), cwd=ROOT,
                          timeout=LIMIT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # torch's agent logs nothing unless LOGLEVEL asks
    assert (tmp_path / "env0_0").read_text() == "0 0 2 2 0 0 3"
    assert (tmp_path / "env1_0").read_text() == "1 1 2 2 0 0 3"
    start = time.monotonic()
    failed = subprocess.run(_command("--nproc-per-node", "2", str(script), str(tmp_path), "fail"), cwd=ROOT,
                            timeout=LIMIT, capture_output=True, text=True)
    assert failed.returncode == 7
    assert failed.stderr.startswith("graphpar.launch: rank 1 (pid "), failed.stderr
    assert f") exited with 7; its command: {sys.executable} -u {script} {tmp_path} fail; stopped the others\n" \
        in failed.stderr
    assert len(failed.stderr.splitlines()) == 1
    assert time.monotonic() - start < 30


@pytest.mark.slow
def test_a_killed_rank_and_an_exception_restart_the_group(tmp_path: Path) -> None:
    """Issue 33 item 3: with --max-restarts the agent starts the whole group again when a process dies,
    and the new processes see TORCHELASTIC_RESTART_COUNT."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    done = subprocess.run(_command("--nproc-per-node", "2", "--max-restarts", "2", str(script), str(tmp_path),
                                   "faults"), cwd=ROOT, timeout=LIMIT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("graphpar.launch:")]
    assert len(said) == 2, done.stderr
    assert "rank 1 (pid " in said[0] and "was killed by SIGKILL" in said[0] \
        and said[0].endswith("restarting the group (restart 1 of 2)")
    assert "rank 0 (pid " in said[1] and "exited with 1" in said[1] \
        and said[1].endswith("restarting the group (restart 2 of 2)")
    assert "RuntimeError: an exception on purpose" in done.stderr  # rank 0's own traceback
    assert sorted(p.name for p in tmp_path.glob("env*")) == [f"env{r}_{a}" for r in (0, 1) for a in (0, 1, 2)]
    assert (tmp_path / "env1_2").read_text().split()[5] == "2"


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "1:2"], "--nnodes 1:2: a changing number of machines is not supported"),
    (["--nnodes", "2"], "--nnodes 2: pass --dist-url tcp://HOST:PORT of machine 0"),
    (["--rdzv-backend", "c10d"], "--rdzv-backend c10d needs --rdzv-endpoint HOST:PORT"),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--node-rank", "1", "--nnodes", "2"],
     "c10d numbers the machines itself"),
    (["--dist-url", "tcp://h:1", "--standalone"], "--standalone starts its own rendezvous"),
    (["--dist-url", "http://h"], "tcp://HOST:PORT"),
    (["--max-restarts", "-1"], "--max-restarts >= 0"),
    (["--nnodes", "2", "--node-rank", "2", "--dist-url", "tcp://h:1"], "0 <= --node-rank < --nnodes"),
    (["--nnodes", "2", "--dist-url", "tcp://h:1", "--max-restarts", "1"], "use --rdzv-backend c10d --rdzv-endpoint"),
])
def test_the_command_refuses_what_it_cannot_do_with_a_clear_message(capsys, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        launch.main([*argv, "script.py"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


STUBBORN = """
import os, signal, sys, time
rank, where, mode = os.environ["RANK"], sys.argv[1], sys.argv[2]

def on_signal(signum, _frame):
    open(os.path.join(where, f"signal{rank}"), "w").write(str(signum))
    if mode == "exit":
        sys.exit(0)

for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(signum, on_signal)
open(os.path.join(where, f"pid{rank}"), "w").write(str(os.getpid()))
while True:
    time.sleep(0.05)
"""


def _signal_the_launcher(tmp_path: Path, signals: list[int], mode: str, *options: str) -> tuple[int, list[int], float]:
    """Start the launcher on two STUBBORN processes, send it `signals` (0.5 s apart) once both run;
    return its exit code, the children's pids and the seconds it took to exit after the first signal.
    Leaves no child behind."""
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    launcher = subprocess.Popen(_command("--nproc-per-node", "2", *options, str(script), str(tmp_path), mode),
                                cwd=ROOT)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + LIMIT
        while len(pids) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = [int(f.read_text()) for f in tmp_path.glob("pid*") if f.read_text()]
        assert len(pids) == 2, "the processes did not start"
        time.sleep(0.2)  # both have set their handlers before writing their pid
        start = time.monotonic()
        for k, signum in enumerate(signals):
            if k:
                time.sleep(0.5)
            launcher.send_signal(signum)
        code = launcher.wait(timeout=LIMIT)
        return code, pids, time.monotonic() - start
    finally:
        launcher.kill()
        launcher.wait()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT])
def test_every_signal_to_the_launcher_reaches_every_process_and_none_outlives_it(tmp_path: Path, signum: int) -> None:
    """Issue 23 item 9 (SIGTERM left the processes running), issue 32 item 8 (SIGHUP and SIGQUIT did)."""
    code, pids, seconds = _signal_the_launcher(tmp_path, [signum], "exit")
    assert code == 128 + signum and seconds < 10
    assert [(tmp_path / f"signal{rank}").read_text() for rank in (0, 1)] == [str(int(signum))] * 2
    assert not any(_alive(pid) for pid in pids)


def test_only_graphpars_tools_start_with_sigint_blocked(tmp_path: Path) -> None:
    """graphpar's command-line tools take Ctrl-C first thing, so their processes start with it blocked;
    any other program starts as under torchrun."""
    from graphpar.parallel.launch import _takes_sigint_itself

    train = ROOT / "graphpar" / "examples" / "train.py"
    for module, script, blocked in ((False, str(train), True), (True, "graphpar.examples.train", True),
                                    (False, str(tmp_path / "train.py"), False), (True, "train", False)):
        assert _takes_sigint_itself(argparse.Namespace(module=module, script=script)) is blocked


@pytest.mark.parametrize("delay", [0.3, 0.8])
def test_a_ctrl_c_while_the_launcher_loads_torch_ends_it_with_one_line(tmp_path: Path, delay: float) -> None:
    """Before the processes start (the launcher imports torch's agent for seconds), a Ctrl-C printed a
    KeyboardInterrupt traceback from inside an import and ended the launcher by SIGINT (status -2)."""
    script = tmp_path / "never.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    launcher = subprocess.Popen(_command("--nproc-per-node", "2", str(script)), cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    launcher.send_signal(signal.SIGINT)
    out, err = launcher.communicate(timeout=LIMIT)
    assert launcher.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in err and err.strip().splitlines() == ["interrupted"], err
    assert not (tmp_path / "ran").exists()


@pytest.mark.slow
def test_a_process_that_ignores_the_signal_is_killed_after_the_timeout_or_at_a_second_signal(tmp_path: Path) -> None:
    (tmp_path / "timeout").mkdir()
    code, pids, seconds = _signal_the_launcher(tmp_path / "timeout", [signal.SIGTERM], "ignore",
                                               "--shutdown-timeout", "2")
    assert code == 128 + signal.SIGTERM and 1.5 < seconds < 20
    assert not any(_alive(pid) for pid in pids)
    (tmp_path / "again").mkdir()
    code, pids, seconds = _signal_the_launcher(tmp_path / "again", [signal.SIGHUP, signal.SIGHUP], "ignore",
                                               "--shutdown-timeout", "60")
    assert code == 128 + signal.SIGHUP and seconds < 20  # not the 60 s: the second signal killed them
    assert (tmp_path / "again" / "signal0").read_text() == str(int(signal.SIGHUP))
    assert not any(_alive(pid) for pid in pids)


TWO_AGENTS = """
import os, sys
from graphpar import comm
ranks = comm.all_gather(comm.get_rank())  # joins the default group (env://) across the two machines
open(os.path.join(sys.argv[1], f"rank{comm.get_rank()}"), "w").write(
    f"{comm.get_world_size()} {os.environ['GROUP_RANK']} {os.environ['LOCAL_RANK']} {ranks}")
"""


@pytest.mark.slow
def test_two_agents_on_one_machine_meet_over_c10d_at_one_endpoint_and_torchrun_is_one_of_them(tmp_path: Path) -> None:
    """Issue 33 item 4: --nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT, no shared file system
    (the processes write their results to the same directory only so the test can read them). The
    other machine runs torchrun itself, on the same graphpar script."""
    script = tmp_path / "two_agents.py"
    script.write_text(TWO_AGENTS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    options = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", f"two-agents-{port}", str(script), str(tmp_path)]
    commands = [_command(*options), [sys.executable, "-m", "torch.distributed.run", *options]]
    agents = [subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True) for command in commands]
    try:
        errors = [agent.communicate(timeout=LIMIT)[1] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], errors
    found = sorted((tmp_path / f"rank{r}").read_text() for r in (0, 1))
    assert [line.split(" ", 3)[0::3] for line in found] == [["2", "[0, 1]"], ["2", "[0, 1]"]]
    assert sorted(line.split()[1] for line in found) == ["0", "1"]  # one process on each machine
    assert all(line.split()[2] == "0" for line in found)


@pytest.mark.slow
def test_a_rank_killed_mid_training_restarts_and_resumes_to_the_uninterrupted_params(tmp_path: Path) -> None:
    """Issue 33 item 3 end to end: 2 processes x 2 devices train with the Trainer under --max-restarts 1;
    rank 1 is SIGKILLed before iteration 7 (the last checkpoint holds 6). The agent restarts both, the
    same script continues from that checkpoint on its own, and the final params equal an uninterrupted
    run's bit for bit (1 process x 4 devices here: 2 x 2 sum exactly as 1 x 4, tests/multihost/test_training)."""
    from tests.multihost import elastic_job

    done = subprocess.run(_command("--nproc-per-node", "2", "--max-restarts", "1", "-m", "tests.multihost.elastic_job",
                                   str(tmp_path), "7"), cwd=ROOT, timeout=2 * LIMIT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "rank 1 (pid " in done.stderr and "was killed by SIGKILL" in done.stderr \
        and "restarting the group (restart 1 of 1)" in done.stderr
    assert (tmp_path / "attempt").read_text() == "1"
    expected = elastic_job.run(str(tmp_path / "uninterrupted"), -1, [0, 1, 2, 3])
    with np.load(tmp_path / "final.npz") as found:
        assert sorted(found.files) == sorted(expected) and int(found["optimizer_iteration"][0]) == elastic_job.STEPS
        for name, value in expected.items():
            np.testing.assert_array_equal(found[name], value, err_msg=name)
