"""The main job end to end: it reaches its stated accuracy, and a resumed run equals an uninterrupted one."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from graphpar import checkpoint, workspace
from graphpar import data_parallel_model as dpm
from graphpar.examples import cli, train
from tests.optional import DIGITS

pytestmark = [pytest.mark.slow, DIGITS]


def _final_accuracy(output: str) -> float:
    match = re.search(r"final test accuracy ([0-9.]+)%", output)
    assert match, output
    return float(match.group(1)) / 100


def _params() -> dict[str, np.ndarray]:
    return {name: workspace.FetchBlob(name) for name in workspace.Blobs()
            if name.startswith("cpu_") and name.endswith(("_w", "_b", "_momentum"))}


def test_default_run_reaches_the_stated_accuracy(tmp_path, capsys):
    assert train.main(["--cpu", "--checkpoint", str(tmp_path / "ckpt.safetensors")]) == 0
    assert _final_accuracy(capsys.readouterr().out) > 0.95
    assert (tmp_path / "ckpt.safetensors").exists()


def test_resumed_run_equals_the_uninterrupted_run(tmp_path, capsys, monkeypatch):
    common = ["--cpu", "--devices", "2", "--epochs", "3", "--lr-step-epochs", "2"]
    train.main([*common, "--checkpoint", str(tmp_path / "a.safetensors")])
    uninterrupted = _params()
    assert workspace.FetchBlob("optimizer_iteration")[0] == 3 * (1437 // 64)

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "this-job")  # a job the launcher's agent runs
    train.main(["--cpu", "--devices", "2", "--epochs", "2", "--lr-step-epochs", "2",
                "--checkpoint", str(tmp_path / "b.safetensors")])
    halfway = _params()
    (tmp_path / "c.safetensors").write_bytes((tmp_path / "b.safetensors").read_bytes())
    train.main([*common, "--checkpoint", str(tmp_path / "b.safetensors"), "--resume"])
    assert "resumed from" in capsys.readouterr().out
    resumed = _params()

    assert sorted(resumed) == sorted(uninterrupted) and len(resumed) > 10
    for name, value in uninterrupted.items():
        np.testing.assert_array_equal(resumed[name], value, err_msg=name)
    assert any(not np.array_equal(halfway[n], uninterrupted[n]) for n in uninterrupted)

    # Issue 33 item 3: restarted by the agent, the same command (no --resume) continues this job's checkpoint
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert train.main([*common, "--checkpoint", str(tmp_path / "c.safetensors")]) == 0
    assert "(restart 1 of this job)" in capsys.readouterr().out
    for name, value in uninterrupted.items():
        np.testing.assert_array_equal(_params()[name], value, err_msg=name)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "another-job")  # ... but not another job's: refused as at its start
    with pytest.raises(SystemExit) as refused:
        train.main([*common, "--checkpoint", str(tmp_path / "c.safetensors")])
    assert refused.value.code == 2 and "continue it with --resume" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "0"], "argument --batch-size: must be an integer >= 1, got '0'"),
    (["--batch-size", "2000"], "argument --batch-size: must be at most the 1437 training samples, got 2000"),
    (["--batch-size", "66", "--devices", "4"], "--batch-size 66 must be a multiple of --devices 4"),
    (["--devices", "0"], "argument --devices: must be an integer >= 1, got '0'"),
    (["--epochs", "0"], "argument --epochs: must be an integer >= 1, got '0'"),
    (["--lr", "-1"], "argument --lr: must be a finite number > 0, got '-1'"),
    (["--resume"], "--resume: there is no checkpoint at"),
])
def test_bad_options_are_refused_with_a_clear_message(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        train.main([*argv, "--cpu", "--checkpoint", str(tmp_path / "none.safetensors")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_resuming_a_finished_run_says_how_to_train_longer(tmp_path, capsys):
    ckpt = str(tmp_path / "c.safetensors")
    assert train.main(["--cpu", "--devices", "7", "--batch-size", "63", "--epochs", "1", "--checkpoint", ckpt]) == 0
    out = capsys.readouterr().out
    assert "final test accuracy" in out and "nan" not in out
    metrics = [json.loads(line) for line in (tmp_path / "metrics.json").read_text().splitlines()]
    assert metrics[-1]["iteration"] == 1437 // 63 - 1 and 0 < metrics[-1]["test_accuracy"] <= 1
    assert train.main(["--cpu", "--devices", "7", "--batch-size", "63", "--epochs", "1", "--checkpoint", ckpt,
                       "--resume"]) == 0
    assert "nothing to do: " in (out := capsys.readouterr().out) and "--epochs 5" in out and "nan" not in out


def test_evaluation_covers_every_test_sample():
    x_train, y_train, x_test, y_test = train.load_digits()
    workspace.ResetWorkspace()
    model, test = train.build(list(range(7)), True, 0.05, 100)
    from graphpar.data import feed

    feed(model, {"data": x_train[:7], "label": y_train[:7]})
    dpm.RunInitNet(model)
    dpm.RunInitNet(test)
    assert len(y_test) % 7 and 0 <= train.evaluate(test, x_test, y_test) <= 1
    assert sum(len(workspace.FetchBlob(f"cpu_{d}/softmax")) for d in range(7)) == len(y_test)


def test_ctrl_c_stops_cleanly_and_keeps_the_last_checkpoint(tmp_path, capsys, monkeypatch):
    ckpt = tmp_path / "k.safetensors"
    run_net, calls = dpm.RunNet, []

    def interrupted(model, n):
        calls.append(model.name)
        if calls.count("digits_train") == 30:  # in the second epoch (22 steps each)
            raise KeyboardInterrupt
        return run_net(model, n)

    monkeypatch.setattr(dpm, "RunNet", interrupted)
    assert train.main(["--cpu", "--devices", "2", "--epochs", "3", "--checkpoint", str(ckpt)]) == 130
    err = capsys.readouterr().err
    assert "interrupted at iteration 29" in err and "--resume" in err and "Traceback" not in err
    assert checkpoint.read_metadata(ckpt)["iteration"] == 22  # the first epoch's, intact
    rows = [json.loads(line) for line in (tmp_path / "metrics.json").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [21]  # no partial row of the interrupted epoch
    assert "loss" in rows[0] and "scaled_loss" not in rows[0] and 0 < rows[0]["epoch_loss"] < 2.4
    monkeypatch.setattr(dpm, "RunNet", run_net)
    assert train.main(["--cpu", "--devices", "2", "--epochs", "3", "--checkpoint", str(ckpt), "--resume"]) == 0
    assert "resumed from" in capsys.readouterr().out


def test_plot_draws_loss_and_accuracy_per_epoch(tmp_path, monkeypatch, capsys):
    import sys
    import types

    drawn = {}

    class Axes:
        def __init__(self, key):
            self.key = key

        def plot(self, x, y, **kwargs):
            drawn[self.key] = (list(x), list(y))

        def set(self, **kwargs):
            pass

    class Figure:
        def tight_layout(self):
            pass

        def savefig(self, path):
            drawn["file"] = path

    pyplot = types.SimpleNamespace(subplots=lambda *a, **k: (Figure(), (Axes("loss"), Axes("accuracy"))))
    monkeypatch.setitem(sys.modules, "matplotlib", types.SimpleNamespace(use=lambda backend: None, pyplot=pyplot))
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)
    metrics = tmp_path / "metrics.json"
    metrics.write_text('{"iteration": 21, "epoch_loss": 0.5, "test_accuracy": 0.9}\n{"iteration": 30, "lr": 0.1}\n'
                       '{"iteration": 43, "epoch_loss": 0.2, "test_accuracy": 0.95}\n')
    cli.setup_logger()
    train._plot(metrics, tmp_path / "training.png")
    assert drawn == {"loss": ([22, 44], [0.5, 0.2]), "accuracy": ([22, 44], [0.9, 0.95]),
                     "file": tmp_path / "training.png"}
    assert "plot: " in capsys.readouterr().out


def _checkpoint(path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))


def test_two_processes_train_and_resume_like_one_and_a_two_process_checkpoint_resumes_on_one(tmp_path, capsys):
    """2 processes x 2 CPU devices (gloo) == 1 x 4 bit for bit, after a resume on 2 processes and after
    resuming their checkpoint on 1 process."""
    common = ["--cpu", "--epochs", "2", "--lr-step-epochs", "1"]
    train.main([*common, "--devices", "4", "--checkpoint", str(tmp_path / "one.safetensors")])
    uninterrupted = _checkpoint(tmp_path / "one.safetensors")
    two = ["--cpu", "--devices", "2", "--num-processes", "2", "--lr-step-epochs", "1"]
    assert train.main([*two, "--epochs", "1", "--checkpoint", str(tmp_path / "two.safetensors")]) == 0
    (tmp_path / "copy.safetensors").write_bytes((tmp_path / "two.safetensors").read_bytes())
    assert train.main([*two, "--epochs", "2", "--checkpoint", str(tmp_path / "two.safetensors"), "--resume"]) == 0
    train.main([*common, "--devices", "4", "--checkpoint", str(tmp_path / "copy.safetensors"), "--resume"])
    for name in ("two", "copy"):
        resumed = _checkpoint(tmp_path / f"{name}.safetensors")
        assert sorted(resumed) == sorted(uninterrupted)
        for blob, value in uninterrupted.items():
            np.testing.assert_array_equal(resumed[blob], value, err_msg=f"{name}: {blob}")
