"""Checkpoints of sharded optimizer state keep one format: they move between sharded and unsharded runs
and between device counts exactly (multi-process counts: tests/multihost/test_training.py).

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
from graphpar.engine import PeriodicCheckpointer, Trainer
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


def _trainer(hooks: list, max_iter: int) -> Trainer:
    """A Trainer of the MLP with sharded Adam on 2 devices, each replica updating its own part."""
    workspace.ResetWorkspace()
    model = model_helper.ModelHelper(name="trained")
    dpm.Parallelize(model, input_builder_fun=lambda m: None, forward_pass_builder_fun=mlp, optimizer_builder_fun=ADAM,
                    devices=[0, 1], cpu_device=True, cpu_update_once=False, shard_optimizer_state=True)
    data = [dict(zip(("data", "label"), batch(step))) for step in range(4)]
    return Trainer(model, data, hooks, max_iter=max_iter)


def _trained(trainer: Trainer) -> dict[str, np.ndarray]:
    """The checkpoint's blobs (the state gathered whole) and the losses recorded, after training."""
    blobs = {name: workspace.FetchBlob(name) for name in sorted(dpm.GetCheckpointParams(trainer.model))}
    return {**blobs, "losses": np.array([v for _, v in trainer.storage.history["total_loss"]])}


def test_training_goes_on_exactly_after_a_checkpoint_gathered_the_state(tmp_path):
    """GetCheckpointParams leaves the whole state on the first device only: the train net neither reads
    nor declares it, and the next step drops it (it would go stale), so training goes on as if no
    checkpoint had been taken; a run resumed from the mid-run file ends the same too."""
    trainer = _trainer([], 6)
    trainer.train()
    want = _trained(trainer)
    trainer = _trainer([], 3)  # the brief's repro: checkpoint params taken, then more steps
    trainer.train()
    dpm.GetCheckpointParams(trainer.model)
    trainer.max_iter = 6
    trainer.train()
    assert not workspace.HasBlob("cpu_0/fc1_w_first_moment")  # the next step dropped the gathered copy
    got = _trained(trainer)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)

    trainer = _trainer([PeriodicCheckpointer(tmp_path, period=3)], 6)  # a checkpoint mid-run, then on
    trainer.train()
    got = _trained(trainer)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    resumed = _trainer([], 6)
    assert resumed.resume_or_load(path=tmp_path / "model_0000003.safetensors") == 3
    resumed.train()
    got = _trained(resumed)
    np.testing.assert_array_equal(got.pop("losses"), want["losses"][3:])
    for key in got:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
