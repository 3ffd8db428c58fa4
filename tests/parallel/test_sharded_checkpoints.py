"""Checkpoints of sharded optimizer state keep one format: they move between sharded and unsharded runs
and between device counts exactly (multi-process counts: tests/multihost/test_sharded.py).

A checkpoint file is deterministic (identical blobs and metadata, identical bytes), so "exactly" is
checked on the files themselves: the same training saved sharded or not gives the same bytes, and a
file loaded into any other configuration and saved again right away gives the bytes back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from graphpar import checkpoint, model_helper, workspace
from graphpar import data_parallel_model as dpm
from graphpar.errors import CheckpointError
from tests.parallel.test_sharded_training import BATCH, OPTIMIZERS, batch, mlp

ADAM = OPTIMIZERS["adam"]


def _model(devices: int, **options: Any) -> Any:
    workspace.ResetWorkspace()
    model = model_helper.ModelHelper(name="ckpt")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=mlp, optimizer_builder_fun=ADAM,
                    devices=list(range(devices)), cpu_device=True, **options)
    _feed(devices, 0)
    dpm.RunInitNet(model)
    return model


def _feed(devices: int, step: int) -> None:
    x, y = batch(step)
    for d, rows in enumerate(np.split(np.arange(BATCH), devices)):
        workspace.FeedBlob(f"cpu_{d}/data", x[rows])
        workspace.FeedBlob(f"cpu_{d}/label", y[rows])


def _steps(model: Any, devices: int, steps: range) -> dict[str, np.ndarray]:
    for step in steps:
        _feed(devices, step)
        dpm.RunNet(model, 1)
    return {str(p): workspace.FetchBlob(str(p)) for p in model.GetParams()}


def _resumed(path: Path, devices: int, **options: Any) -> Any:
    model = _model(devices, **options)
    checkpoint.load(path, model=model)
    dpm.FinalizeAfterCheckpoint(model)
    return model


def test_sharded_and_unsharded_runs_write_the_same_file_and_any_run_reads_it_back_exactly(tmp_path):
    files = {}
    for name, options in {"plain": {}, "stage1": {"shard_optimizer_state": True},
                          "stage2": {"shard_gradients": True}}.items():
        model = _model(4, **options)
        _steps(model, 4, range(2))
        assert dpm.save_checkpoint(model, tmp_path / f"{name}.safetensors")
        files[name] = (tmp_path / f"{name}.safetensors").read_bytes()
    assert files["stage1"] == files["plain"] and files["stage2"] == files["plain"]
    assert not [b for b in workspace.Blobs() if b.endswith("_moment")]  # the gathered state was dropped again
    for devices, options in ((2, {"shard_gradients": True}), (3, {"shard_optimizer_state": True}), (1, {})):
        model = _resumed(tmp_path / "stage2.safetensors", devices, **options)
        checkpoint.save(tmp_path / "again.safetensors", dpm.GetCheckpointParams(model))
        assert (tmp_path / "again.safetensors").read_bytes() == files["plain"], (devices, options)


def test_resumed_equals_uninterrupted_and_skipping_finalize_is_caught(tmp_path):
    want = _steps(_model(4, shard_optimizer_state=True), 4, range(4))
    model = _model(4, shard_optimizer_state=True)
    _steps(model, 4, range(2))
    path = tmp_path / "half.safetensors"
    dpm.save_checkpoint(model, path)
    resumed = _resumed(path, 4, shard_optimizer_state=True)
    got = _steps(resumed, 4, range(2, 4))
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    model = _model(4, shard_optimizer_state=True)
    checkpoint.load(path, ["cpu_0/fc1_w_first_moment"], model=model)  # state only: its parts read it
    with pytest.raises(CheckpointError, match=r"reads 'cpu_\d/fc1_w_first_moment_shard', a replica of "
                                              r"'cpu_0/fc1_w_first_moment' loaded"):
        _steps(model, 4, range(1))


def test_checkpoint_params_of_an_uninitialised_model_are_names_only():
    workspace.ResetWorkspace()
    model = model_helper.ModelHelper(name="names")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=mlp, optimizer_builder_fun=ADAM,
                    devices=[0, 1], cpu_device=True, shard_optimizer_state=True)
    names = dpm.GetCheckpointParams(model)
    assert {"cpu_0/fc1_w", "cpu_0/fc1_w_first_moment", "cpu_0/pred_b_second_moment", "optimizer_iteration"} <= names
    assert not [n for n in names if "shard" in n or n.startswith("cpu_1/")]
    assert not workspace.Blobs()
