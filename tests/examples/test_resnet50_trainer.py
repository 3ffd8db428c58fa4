"""Caffe2's resnet50_trainer ported: runs at tiny sizes, checkpoints every epoch, and a run resumed
from the first epoch's checkpoint ends exactly where the uninterrupted run does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from graphpar import workspace
from graphpar.examples import resnet50_trainer
from tests.optional import installed

TINY = ["--use_cpu", "--num_gpus", "2", "--batch_size", "4", "--image_size", "32", "--num_labels", "10",
        "--epoch_size", "8", "--width", "4"]


def _params() -> dict[str, np.ndarray]:
    return {b: workspace.FetchBlob(b) for b in workspace.Blobs() if b.startswith("cpu_") and b.endswith("_w")}


@pytest.mark.slow
def test_resumed_training_equals_uninterrupted(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "this-job")  # a job the launcher's agent runs
    assert resnet50_trainer.main([*TINY, "--num_layers", "18", "--num_epochs", "2"]) == 0
    assert (tmp_path / "resnet18_model_1.safetensors").exists()
    assert (tmp_path / "resnet18_model_2.safetensors").exists()
    uninterrupted = _params()
    assert resnet50_trainer.main([*TINY, "--num_layers", "18", "--num_epochs", "2", "--save_model_name", "again",
                                  "--load_model_path", "resnet18_model_1.safetensors"]) == 0
    assert not (tmp_path / "again_1.safetensors").exists()  # epoch 1 was not run again
    resumed = _params()
    assert resumed.keys() == uninterrupted.keys() and len(resumed) > 10
    for name, value in uninterrupted.items():
        np.testing.assert_array_equal(resumed[name], value, err_msg=name)

    # Issue 33 item 3: the job dies in epoch 2; the agent restarts it with the same command, which continues
    # from the last checkpoint this job wrote
    (tmp_path / "resnet18_model_2.safetensors").unlink()
    first = (tmp_path / "resnet18_model_1.safetensors").stat().st_mtime_ns
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resnet50_trainer.main([*TINY, "--num_layers", "18", "--num_epochs", "2"]) == 0
    assert (tmp_path / "resnet18_model_1.safetensors").stat().st_mtime_ns == first  # epoch 1 was not run again
    for name, value in uninterrupted.items():
        np.testing.assert_array_equal(_params()[name], value, err_msg=name)
    assert resnet50_trainer.parse_args(["--num_layers", "18"]).load_model_path == "resnet18_model_2.safetensors"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "another-job")  # ... not another job's: refused as at its start
    with pytest.raises(SystemExit):
        resnet50_trainer.parse_args(["--num_layers", "18"])


@pytest.mark.slow
def test_resnet50_runs_one_tiny_epoch(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.chdir(tmp_path)
    assert resnet50_trainer.main([*TINY, "--epoch_size", "4", "--num_epochs", "1"]) == 0
    assert workspace.FetchBlob("cpu_1/res5_2_branch2c_w").shape == (128, 32, 1, 1)
    np.testing.assert_array_equal(workspace.FetchBlob("cpu_0/pred_w"), workspace.FetchBlob("cpu_1/pred_w"))


@pytest.mark.slow
def test_a_float16_epoch_whose_steps_the_loss_scale_skips_says_so_without_a_warning_per_step(
        tmp_path, monkeypatch, capsys) -> None:  # noqa: ANN001
    """Issue 32 item 16: an epoch whose every step the dynamic scale's start-up back-off skipped printed
    `loss nan`, after a warning per step."""
    monkeypatch.chdir(tmp_path)
    assert resnet50_trainer.main([*TINY, "--num_layers", "18", "--num_epochs", "1", "--dtype", "float16"]) == 0
    out = capsys.readouterr().out
    assert "epoch 1/1: no step trained yet (2 skipped while the loss scale backs off)" in out, out
    assert "step skipped" not in out and "nan" not in out


@pytest.mark.parametrize("flag", [["--train_data", "/data/imagenet_lmdb"], ["--num_shards", "2"],
                                  ["--float16_compute"]])
def test_unsupported_caffe2_flags_are_refused(flag: list[str]) -> None:
    with pytest.raises(SystemExit):
        resnet50_trainer.parse_args(flag)


# ---- the first hour through real processes (issue 35 item 5) ----------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def _trainer(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "graphpar.examples.resnet50_trainer", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("argv, says", [
    (["--epoch_size", "0"], "argument --epoch_size: must be an integer >= 1, got '0'"),
    (["--num_gpus", "0"], "argument --num_gpus: must be an integer >= 1, got '0'"),
    (["--batch_size", "-8"], "argument --batch_size: must be an integer >= 1, got '-8'"),
    (["--base_learning_rate", "nan"], "argument --base_learning_rate: must be a finite number > 0, got 'nan'"),
    (["--gpus", "0,0"], "argument --gpus: must be distinct device ids >= 0"),
    (["--use_cpu", "--batch_size", "8", "--epoch_size", "4"], "argument --epoch_size: must be at least --batch_size 8"),
])
def test_a_bad_value_is_one_line_naming_it_before_anything_runs(tmp_path, argv, says) -> None:
    done = _trainer(argv, tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_progress_within_an_epoch_the_last_k_checkpoints_and_no_silent_overwrite(tmp_path) -> None:
    argv = [*TINY, "--num_layers", "18", "--epoch_size", "8", "--num_epochs", "3", "--keep_checkpoints", "2"]
    first = _trainer(argv, tmp_path)
    assert first.returncode == 0, first.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resnet18_model_2.safetensors", "resnet18_model_3.safetensors"]
    if installed("tqdm"):  # a bar inside the epoch, with the loss
        assert re.search(r"epoch 1/3: +50%\|.*\| 1/2 .*loss \d", first.stderr)
    before = (tmp_path / "resnet18_model_3.safetensors").read_bytes()
    again = _trainer(argv, tmp_path)
    assert again.returncode == 2 and again.stderr.count("\n") == 1
    assert ("resnet18_model_2.safetensors exists: this run would replace it. Resume with --load_model_path "
            "resnet18_model_3.safetensors, start over with --overwrite") in again.stderr
    assert (tmp_path / "resnet18_model_3.safetensors").read_bytes() == before
    over = _trainer([*argv[:-4], "--num_epochs", "1", "--overwrite"], tmp_path)
    assert over.returncode == 0, over.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resnet18_model_1.safetensors"]  # no stale epochs 2, 3
