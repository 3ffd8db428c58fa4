"""The command-line tools' first hour: Ctrl-C, refusals at start, one-line errors, --help, logging."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from graphpar import checkpoint
from graphpar.examples import cli, dlrm, resnet50_trainer, train
from tests.optional import DIGITS

ROOT = Path(__file__).resolve().parents[2]
EPOCH_1 = ["--devices", "2", "--epochs", "1"]


def _fresh(tmp_path: Path, name: str = "c.safetensors") -> Path:
    path = tmp_path / name
    assert train.main([*EPOCH_1, "--checkpoint", str(path)]) == 0
    return path


# ---- Ctrl-C in a real process: status 130, one line, no traceback, no abort ----------------------


def _interrupt(command: list[str], trigger: str | None, delay: float, cwd: Path) -> tuple[int, str, float]:
    """Run `command`, send SIGINT to its process group `delay` s after stdout shows `trigger` (None: after
    start; `| module`: after stderr shows that `python -X importtime` imported `module`), and return
    (exit status, stderr, seconds from the signal to the exit). Once more if the free port the launcher
    picked was taken meanwhile (by another job on this machine)."""
    found = _interrupt_once(command, trigger, delay, cwd)
    return _interrupt_once(command, trigger, delay, cwd) if "EADDRINUSE" in found[1] else found


def _interrupt_once(command: list[str], trigger: str | None, delay: float, cwd: Path) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env,
                            start_new_session=True)
    if trigger is not None:
        for line in proc.stderr if trigger.startswith("| ") else proc.stdout:
            if trigger in line:
                break
    time.sleep(delay)
    sent = time.monotonic()
    try:
        os.killpg(proc.pid, signal.SIGINT)
    except ProcessLookupError:
        pass
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err, time.monotonic() - sent


TRAIN = [sys.executable, "-m", "graphpar.examples.train", "--devices", "2", "--epochs", "3", "--overwrite"]
POINTS = [  # (where, stdout line to wait for, then seconds)
    ("start-up, torch loading", "| graphpar.examples.cli", 0.0),  # imported once the handler is in place
    ("building the nets", "training a CNN", 0.0),
    ("first steps", "training a CNN", 0.4),
    ("right after an epoch's checkpoint", "epoch  1", 0.0),
    ("mid-epoch", "epoch  1", 0.15),
    ("the last epoch", "epoch  2", 0.05),
]


def _check_one_clean_stop(code: int, err: str, where: str) -> None:
    assert code == 130, f"{where}: exit status {code}\n{err}"
    assert "Traceback" not in err and "terminate called" not in err, f"{where}:\n{err}"
    lines = [line for line in err.splitlines() if "interrupted" in line]
    assert len(lines) == 1, f"{where}: {lines}"


@DIGITS
@pytest.mark.slow
@pytest.mark.parametrize("where, trigger, delay", POINTS, ids=[p[0] for p in POINTS])
def test_ctrl_c_ends_with_one_line_and_status_130(tmp_path, where, trigger, delay):
    repeats = int(os.environ.get("GRAPHPAR_SIGINT_REPEATS", 1))  # more in a soak run
    command = [*TRAIN, "--checkpoint", str(tmp_path / "c.safetensors")]
    if trigger.startswith("| "):  # the start: a moment fixed by the imports, whatever the machine's load
        command[1:1] = ["-X", "importtime"]
    for _ in range(repeats):
        code, err, _ = _interrupt(command, trigger, delay, tmp_path)
        _check_one_clean_stop(code, err, where)
    if trigger is not None and trigger.startswith("epoch"):  # the finished epoch's checkpoint survives
        assert checkpoint.read_metadata(tmp_path / "c.safetensors")["metadata"]["epoch"] >= 1


def test_ctrl_c_inside_an_exec_of_source_still_ends_with_130(tmp_path):
    """A Ctrl-C that lands while code built from a string runs (dataclasses and torch make functions so;
    1 in about 10 runs of the trainer's first steps hit it) made `python -m` end by SIGINT (status -2)
    after the clean stop, as CPython took that interrupt for an unhandled one."""
    (tmp_path / "interrupted_tool.py").write_text(
        "import sys\nfrom graphpar.examples import cli\n\n"
        "def main(argv):\n"
        "    exec('import os, signal, time\\nos.kill(os.getpid(), signal.SIGINT)\\ntime.sleep(30)', {})\n\n"
        "sys.exit(cli.guard(main, []))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "interrupted_tool"], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=60, check=False)
    _check_one_clean_stop(done.returncode, done.stderr, "exec")


@DIGITS
@pytest.mark.slow
@pytest.mark.parametrize("command", [
    [*TRAIN, "--num-processes", "2", "--devices", "1"],
    [sys.executable, "-m", "graphpar.launch", "--nproc-per-node", "2", "-m", "graphpar.examples.train",
     "--devices", "1", "--epochs", "3", "--overwrite"],
], ids=["--num-processes 2", "graphpar.launch"])
@pytest.mark.parametrize("trigger, delay", [("training a CNN", 0.0), ("epoch  1", 0.1)])
def test_ctrl_c_of_two_processes_says_it_once(tmp_path, command, trigger, delay):
    code, err, seconds = _interrupt([*command, "--checkpoint", str(tmp_path / "c.safetensors")], trigger, delay,
                                    tmp_path)
    _check_one_clean_stop(code, err, " ".join(command[2:4]))
    assert seconds < 25  # each process stopped after its step; none waited for the grace period to end


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@DIGITS
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the processes through /proc")
@pytest.mark.parametrize("delay", [0.0, 1.0])
def test_ctrl_c_while_the_processes_start_says_it_once(tmp_path, delay):
    """Issue 35 item 7 (the launcher's side): a Ctrl-C while the processes of `--num-processes 2` were
    starting printed their tracebacks from the middle of an import (or `Fatal Python error:
    init_import_site`). They start with SIGINT blocked and take it once they can stop cleanly."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [*TRAIN, "--num-processes", "2", "--devices", "1", "--checkpoint", str(tmp_path / "c.safetensors")]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(_children(proc.pid)) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
        assert len(_children(proc.pid)) >= 2, "the processes did not start"
        time.sleep(delay)
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the launcher and its processes
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    _check_one_clean_stop(proc.returncode, err, f"{delay} s into the processes' start-up")
    assert "Fatal Python error" not in err and time.monotonic() - sent < 25


@DIGITS
def test_an_interrupt_outside_the_steps_ends_the_process_of_a_launched_job_quietly(tmp_path, monkeypatch, capsys):
    """Issue 35 item 7: in a process that --num-processes started, a Ctrl-C while it loaded the data or
    built the nets escaped run() as a KeyboardInterrupt, whose traceback the process printed; now it
    ends with 130 and, where the parent reports the interrupt, says nothing."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "build", interrupted)
    args = train.parse_args(["--devices", "2", "--checkpoint", str(tmp_path / "c.safetensors")])
    args.report_interrupt = False  # as for a process of --num-processes
    assert train.run(args) == 130
    assert capsys.readouterr().err == ""
    del args.report_interrupt  # a process that reports it (alone, or rank 0 under the launcher)
    assert train.run(args) == 130
    assert capsys.readouterr().err == "\ninterrupted; no epoch finished, so nothing was saved\n"


# ---- refusals at start ------------------------------------------------------------------------------


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@DIGITS
@pytest.mark.slow
def test_an_existing_checkpoint_is_never_overwritten_silently(tmp_path, capsys):
    path = _fresh(tmp_path)
    before, rows = path.read_bytes(), (tmp_path / "metrics.json").read_text()
    err = _refused([*EPOCH_1, "--checkpoint", str(path)], capsys)
    assert f"{path} exists (epoch 1)" in err and "--resume" in err and "--overwrite" in err
    assert path.read_bytes() == before and (tmp_path / "metrics.json").read_text() == rows
    assert "pass one of them" in _refused([*EPOCH_1, "--checkpoint", str(path), "--resume", "--overwrite"], capsys)
    assert train.main([*EPOCH_1, "--checkpoint", str(path), "--overwrite"]) == 0
    assert len((tmp_path / "metrics.json").read_text().splitlines()) == 1


@DIGITS
@pytest.mark.slow
def test_resuming_with_another_batch_size_is_refused(tmp_path, capsys):
    path = _fresh(tmp_path)
    err = _refused(["--devices", "2", "--epochs", "3", "--batch-size", "32", "--checkpoint", str(path), "--resume"],
                   capsys)
    assert "--batch-size 32" in err and "trained with --batch-size 64" in err and "resume with --batch-size 64" in err
    assert checkpoint.read_metadata(path)["metadata"] == {"epoch": 1, "batch_size": 64}


def test_plot_without_matplotlib_is_refused_at_start(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    err = _refused(["--plot", "--cpu", "--checkpoint", str(tmp_path / "c.safetensors")], capsys)
    assert "--plot needs matplotlib: pip install 'graphpar[examples]'" in err
    assert not (tmp_path / "c.safetensors").exists()


# ---- errors at run time: one line, the traceback with --verbose --------------------------------------


@DIGITS
@pytest.mark.slow
def test_a_runtime_error_is_one_line_and_verbose_shows_the_traceback(tmp_path, capsys):
    path = _fresh(tmp_path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # a flipped bit in the tensor data: the header still reads
    path.write_bytes(bytes(data))
    capsys.readouterr()
    argv = ["--devices", "2", "--epochs", "2", "--checkpoint", str(path), "--resume"]
    assert train.main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and re.search(r"^error: CheckpointError: checkpoint .* is corrupt", err, re.M)
    assert len(err.strip().splitlines()) <= 3  # the error, the hint, where the traceback is
    assert train.main([*argv, "--verbose"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "error: CheckpointError" in err


def test_one_line_of_an_error_here_and_in_another_process():
    trace = ("\n\n-- Process 1 failed first, with:\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
             "    raise OperatorError(...)\ngraphpar.errors.OperatorError: op #3 failed: lower the LR\n  inputs:\n"
             "    input 0 'cpu_0/loss'\n")
    assert cli.one_line(RuntimeError(trace)) == "graphpar.errors.OperatorError: op #3 failed: lower the LR"
    assert cli.one_line(ValueError("op #3 failed: lower the LR\n  inputs:\n    input 0")) == \
        "ValueError: op #3 failed: lower the LR"
    assert cli.one_line(KeyError("x")) == "KeyError: 'x'"


@DIGITS
@pytest.mark.slow
def test_a_nan_loss_is_one_line_also_from_two_processes(tmp_path, capsys):
    for more in ([], ["--num-processes", "2"]):
        argv = ["--devices", "2", "--epochs", "1", "--lr", "1e6", "--overwrite", "--checkpoint", str(tmp_path / "n")]
        assert train.main([*argv, *more]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-2].startswith("error: ") and "OperatorError" in err[-2] and "is nan (not finite)" in err[-2]
        assert "Lower the learning rate" in err[-2] and err[-1] == "(--verbose shows the details and the traceback)"
        assert not any("Traceback" in line or "inputs:" in line for line in err)


# ---- every value checked as it is parsed, in one line, before torch loads (issue 35 items 6 and 9) ------


def _command(module: str, argv: list[str], cwd: Path, import_times: bool = False) -> subprocess.CompletedProcess:
    """`python -m module argv` in `cwd` (with -X importtime: stderr also lists every module imported)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    flags = ["-X", "importtime"] if import_times else []
    return subprocess.run([sys.executable, *flags, "-m", module, *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _without_import_times(err: str) -> tuple[list[str], bool]:
    """(stderr's own lines, whether torch was imported)."""
    times = [line for line in err.splitlines() if line.startswith("import time:")]
    return ([line for line in err.splitlines() if not line.startswith("import time:")],
            any(line.rstrip().endswith("| torch") for line in times))


@pytest.mark.parametrize("argv, says", [
    (["--seed", "-1"], "argument --seed: must be an integer >= 0, got '-1'"),
    (["--lr", "nan"], "argument --lr: must be a finite number > 0, got 'nan'"),
    (["--checkpoint", "/"], "argument --checkpoint: '/' is a directory: name a file in it"),
    (["--checkpoint", ""], "argument --checkpoint: must be a file path, got ''"),
    (["--checkpoint", "/dev/null/c.safetensors"], "argument --checkpoint: '/dev/null/c.safetensors': '/dev/null' "
                                                  "is not a directory"),
    (["--num-processes", "0"], "argument --num-processes: must be an integer >= 1, got '0'"),
    (["--epochs"], "argument --epochs: expected one argument"),
])
def test_a_bad_main_job_option_is_one_line_before_torch_loads(tmp_path, argv, says):
    done = _command("graphpar.examples.train", argv, tmp_path, import_times=True)
    lines, torch_loaded = _without_import_times(done.stderr)
    assert done.returncode == 2 and len(lines) == 1 and not torch_loaded, done.stderr[-2000:]
    assert lines[0].startswith("python -m graphpar.examples.train: error: ") and says in lines[0]
    assert lines[0].endswith("(--help lists the options)") and not list(tmp_path.iterdir())


@pytest.mark.parametrize("module", ["graphpar.examples.train", "graphpar.examples.resnet50_trainer",
                                    "graphpar.examples.dlrm"])
def test_help_answers_before_torch_loads(tmp_path, module):
    done = _command(module, ["--help"], tmp_path, import_times=True)
    lines, torch_loaded = _without_import_times(done.stderr)
    assert done.returncode == 0 and lines == [] and not torch_loaded
    assert done.stdout.startswith(f"usage: python -m {module} ")
    if module.endswith(".train"):  # what --no-finite-check does, said
        assert "A NaN or inf loss still stops the run" in " ".join(done.stdout.split())


@DIGITS
@pytest.mark.slow
def test_a_check_after_torch_loads_is_one_line_and_resume_suggests_more_epochs(tmp_path):
    odd = _command("graphpar.examples.train", ["--devices", "2", "--batch-size", "7"], tmp_path)
    assert odd.returncode == 2 and odd.stderr.count("\n") == 1
    assert "error: --batch-size 7 must be a multiple of --devices 2" in odd.stderr
    from graphpar import workspace

    workspace.FeedBlob("optimizer_iteration", np.array([12 * (1437 // 64)], np.int64))  # after 12 epochs
    checkpoint.save(tmp_path / "c.safetensors", ["optimizer_iteration"], metadata={"epoch": 12, "batch_size": 64})
    done = _command("graphpar.examples.train", ["--resume", "--epochs", "5", "--checkpoint", "c.safetensors"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert ("nothing to do: c.safetensors is at epoch 12, and --epochs 5 asks for no more; to train longer, pass an "
            "--epochs above 12 (e.g. --epochs 16)") in done.stdout


@DIGITS
@pytest.mark.slow
def test_no_finite_check_stops_at_the_recorded_loss_in_one_line(tmp_path):
    done = _command("graphpar.examples.train", ["--devices", "2", "--epochs", "1", "--lr", "1e6",
                                                "--no-finite-check", "--checkpoint", "c.safetensors"], tmp_path)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.match(r"error: FloatingPointError: loss 'loss' became nan at iteration \d+$",
                                         errors[0]), done.stderr[-2000:]
    assert "Traceback" not in done.stderr and not (tmp_path / "c.safetensors").exists()


# ---- --help -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("main, module, shows", [
    (train.main, "graphpar.examples.train", ["--lr LR", "learning rate", "(default: 0.05)", "(default: 12)",
                                             "training.png beside --checkpoint", "--overwrite", "the batch order (default: 0)"]),
    (resnet50_trainer.main, "graphpar.examples.resnet50_trainer", ["(default: 0.1)", "resnet<num_layers>_model"]),
    (dlrm.main, "graphpar.examples.dlrm", ["--lr LR", "(default: 0.1)", "(default: adagrad)"]),
])
def test_help_shows_the_command_and_the_defaults(capsys, main, module, shows):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal's width
    assert out.startswith(f"usage: python -m {module} ")
    for text in shows:
        assert text in out, text
    assert "(default: False)" not in out and "(default: None)" not in out


def test_launch_help_shows_the_command_and_the_defaults(capsys):
    from graphpar import launch

    with pytest.raises(SystemExit):
        launch.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("usage: python -m graphpar.launch ") and "(default: auto)" in out and "(default: 1)" in out
    for option in ("--max-restarts MAX_RESTARTS", "--rdzv-backend {static,c10d}", "--rdzv-endpoint RDZV_ENDPOINT",
                   "--standalone", "when a process fails (default: 0)", "before they are killed (default: 30)"):
        assert option in out, option  # torchrun's options (issue 33 item 1), with their defaults


# ---- logging ------------------------------------------------------------------------------------------


def test_log_lines_have_the_time_and_the_rank_and_other_ranks_only_warn(capsys):
    log = cli.setup_logger()
    log.info("epoch %d", 1)
    logging.getLogger("graphpar.passes").info("not without --verbose")
    assert re.fullmatch(r"\[\d\d:\d\d:\d\d rank0\] epoch 1\n", capsys.readouterr().out)
    cli.setup_logger(verbose=True)
    logging.getLogger("graphpar.passes").info("built")
    assert re.fullmatch(r"\[\d\d:\d\d:\d\d rank0\] INFO graphpar.passes: built\n", capsys.readouterr().out)
    cli.setup_logger(rank=1)
    log.info("rank 1 says nothing")
    log.warning("but warns")
    assert re.fullmatch(r"\[\d\d:\d\d:\d\d rank1\] WARNING graphpar.examples: but warns\n", capsys.readouterr().out)
    cli.setup_logger()


@DIGITS
@pytest.mark.slow
def test_epoch_lines_are_logged_with_time_and_rank(tmp_path, capsys):
    _fresh(tmp_path)
    out = capsys.readouterr().out
    assert re.search(r"^\[\d\d:\d\d:\d\d rank0\] epoch  1  loss \d\.\d{4}  test accuracy \d+\.\d\d%$", out, re.M)
    rows = [json.loads(line) for line in (tmp_path / "metrics.json").read_text().splitlines()]
    assert "loss" in rows[0] and "scaled_loss" not in rows[0]


@DIGITS
@pytest.mark.slow
def test_an_interrupt_before_the_first_epoch_ends_says_nothing_was_saved(tmp_path, capsys, monkeypatch):
    from graphpar import data_parallel_model as dpm

    path = _fresh(tmp_path)  # --overwrite replaces it: the old run's checkpoint must not pass for this one's
    run_net, calls = dpm.RunNet, []

    def interrupted(model, n):
        calls.append(model.name)
        if calls.count("digits_train") == 5:
            raise KeyboardInterrupt
        return run_net(model, n)

    monkeypatch.setattr(dpm, "RunNet", interrupted)
    assert train.main([*EPOCH_1, "--checkpoint", str(path), "--overwrite"]) == 130
    assert "interrupted at iteration 4; no epoch finished, so nothing was saved" in capsys.readouterr().err
    assert not path.exists() and not (tmp_path / "metrics.json").exists()


# ---- the finite-loss check follows Parallelize's device-dependent default ---------------------------

def test_the_finite_loss_check_is_parallelizes_default_unless_asked(tmp_path):
    """On CUDA replicas the check is a host read per device and step and rules out CUDA graphs: off
    unless --finite-check; on CPU replicas on unless --no-finite-check."""
    from graphpar import workspace
    from graphpar.devices import cuda_on_cpu

    def checks(argv: list[str], cpu: bool) -> bool:
        args = train.parse_args([*argv, "--checkpoint", str(tmp_path / "c")])
        workspace.ResetWorkspace()
        with cuda_on_cpu():
            model, _ = train.build([0, 1], cpu, 0.05, 100, args.finite_check)
        return any(op.type == "CheckFinite" for op in model.net.Proto().ops)

    assert [checks([], cpu=False), checks(["--finite-check"], cpu=False)] == [False, True]
    assert [checks([], cpu=True), checks(["--no-finite-check"], cpu=True)] == [True, False]
