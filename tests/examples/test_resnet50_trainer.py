"""Caffe2's resnet50_trainer ported: runs at tiny sizes, checkpoints every epoch, and a run resumed
from the first epoch's checkpoint ends exactly where the uninterrupted run does."""

from __future__ import annotations

import numpy as np
import pytest

from graphpar import workspace
from graphpar.examples import resnet50_trainer

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
    assert resnet50_trainer.restart_checkpoint(resnet50_trainer.parse_args(["--num_layers", "18"])).name \
        == "resnet18_model_2.safetensors"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "another-job")  # another job's checkpoints are not continued
    assert resnet50_trainer.restart_checkpoint(resnet50_trainer.parse_args(["--num_layers", "18"])) is None


@pytest.mark.slow
def test_resnet50_runs_one_tiny_epoch(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.chdir(tmp_path)
    assert resnet50_trainer.main([*TINY, "--epoch_size", "4", "--num_epochs", "1"]) == 0
    assert workspace.FetchBlob("cpu_1/res5_2_branch2c_w").shape == (128, 32, 1, 1)
    np.testing.assert_array_equal(workspace.FetchBlob("cpu_0/pred_w"), workspace.FetchBlob("cpu_1/pred_w"))


@pytest.mark.parametrize("flag", [["--train_data", "/data/imagenet_lmdb"], ["--num_shards", "2"],
                                  ["--float16_compute"]])
def test_unsupported_caffe2_flags_are_refused(flag: list[str]) -> None:
    with pytest.raises(SystemExit):
        resnet50_trainer.parse_args(flag)
