"""The main job end to end: it reaches its stated accuracy, and a resumed run equals an uninterrupted one."""

from __future__ import annotations

import re

import numpy as np
import pytest

from graphpar import workspace
from graphpar.examples import train

pytestmark = pytest.mark.slow


def _final_accuracy(output: str) -> float:
    match = re.search(r"final test accuracy ([0-9.]+)%", output)
    assert match, output
    return float(match.group(1)) / 100


def _params() -> dict[str, np.ndarray]:
    return {name: workspace.FetchBlob(name) for name in workspace.Blobs()
            if name.startswith("cpu_") and name.endswith(("_w", "_b", "_momentum"))}


def test_default_run_reaches_the_stated_accuracy(tmp_path, capsys):
    assert train.main(["--checkpoint", str(tmp_path / "ckpt.safetensors")]) == 0
    assert _final_accuracy(capsys.readouterr().out) > 0.95
    assert (tmp_path / "ckpt.safetensors").exists()


def test_resumed_run_equals_the_uninterrupted_run(tmp_path, capsys):
    common = ["--devices", "2", "--epochs", "3", "--lr-step-epochs", "2"]
    train.main([*common, "--checkpoint", str(tmp_path / "a.safetensors")])
    uninterrupted = _params()
    assert workspace.FetchBlob("optimizer_iteration")[0] == 3 * (1437 // 64)

    train.main(["--devices", "2", "--epochs", "2", "--lr-step-epochs", "2",
                "--checkpoint", str(tmp_path / "b.safetensors")])
    halfway = _params()
    train.main([*common, "--checkpoint", str(tmp_path / "b.safetensors"), "--resume"])
    assert "resumed from" in capsys.readouterr().out
    resumed = _params()

    assert sorted(resumed) == sorted(uninterrupted) and len(resumed) > 10
    for name, value in uninterrupted.items():
        np.testing.assert_array_equal(resumed[name], value, err_msg=name)
    assert any(not np.array_equal(halfway[n], uninterrupted[n]) for n in uninterrupted)


def _checkpoint(path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))


def test_two_processes_train_and_resume_like_one_and_a_two_process_checkpoint_resumes_on_one(tmp_path, capsys):
    """2 processes x 2 CPU devices (gloo) == 1 x 4 bit for bit, after a resume on 2 processes and after
    resuming their checkpoint on 1 process."""
    common = ["--epochs", "2", "--lr-step-epochs", "1"]
    train.main([*common, "--devices", "4", "--checkpoint", str(tmp_path / "one.safetensors")])
    uninterrupted = _checkpoint(tmp_path / "one.safetensors")
    two = ["--devices", "2", "--num-processes", "2", "--lr-step-epochs", "1"]
    assert train.main([*two, "--epochs", "1", "--checkpoint", str(tmp_path / "two.safetensors")]) == 0
    (tmp_path / "copy.safetensors").write_bytes((tmp_path / "two.safetensors").read_bytes())
    assert train.main([*two, "--epochs", "2", "--checkpoint", str(tmp_path / "two.safetensors"), "--resume"]) == 0
    train.main([*common, "--devices", "4", "--checkpoint", str(tmp_path / "copy.safetensors"), "--resume"])
    for name in ("two", "copy"):
        resumed = _checkpoint(tmp_path / f"{name}.safetensors")
        assert sorted(resumed) == sorted(uninterrupted)
        for blob, value in uninterrupted.items():
            np.testing.assert_array_equal(resumed[blob], value, err_msg=f"{name}: {blob}")
