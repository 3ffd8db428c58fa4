"""Checkpoint files: round trip, atomic writes, and loads that either succeed fully or change nothing."""

from __future__ import annotations

import collections.abc
import hashlib
import json
import os
import stat
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from graphpar import checkpoint, workspace
from graphpar.devices import cuda_is_simulated, cuda_on_cpu, num_cuda_devices
from graphpar.errors import CheckpointError


@pytest.fixture
def blobs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    values = {
        "cpu_0/fc_w": rng.standard_normal((4, 3)).astype(np.float32),
        "cpu_0/fc_w_momentum": rng.standard_normal((4, 3)).astype(np.float32),
        "cpu_1/bn_rm": rng.standard_normal(5),  # float64 stays float64
        "optimizer_iteration": np.array([7], dtype=np.int64),
        "mask": rng.random(6) > 0.5,
        "loss": np.array(1.5, dtype=np.float32),  # 0-d
    }
    for name, value in values.items():
        workspace.FeedBlob(name, value)
    return values


def _snapshot() -> dict[str, np.ndarray]:
    return {name: workspace.FetchBlob(name) for name in workspace.Blobs()}


def _assert_unchanged(before: dict[str, np.ndarray]) -> None:
    after = _snapshot()
    assert sorted(after) == sorted(before)
    for name, value in before.items():
        assert after[name].dtype == value.dtype
        np.testing.assert_array_equal(after[name], value)


def test_round_trip_restores_values_dtypes_and_metadata(tmp_path, blobs):
    path = tmp_path / "ckpt.safetensors"
    checkpoint.save(path, list(blobs), metadata={"epoch": 3, "note": "hi"})
    workspace.ResetWorkspace()
    assert checkpoint.load(path) == list(blobs)
    for name, value in blobs.items():
        got = workspace.FetchBlob(name)
        assert got.dtype == value.dtype and got.shape == value.shape
        np.testing.assert_array_equal(got, value)
    header = checkpoint.read_metadata(path)
    assert header["format_version"] == checkpoint.FORMAT_VERSION
    assert header["iteration"] == 7 and header["blobs"] == list(blobs)
    assert header["metadata"] == {"epoch": 3, "note": "hi"}


def test_load_overwrites_existing_blobs_and_a_subset_only(tmp_path, blobs):
    path = tmp_path / "ckpt.safetensors"
    checkpoint.save(path, ["cpu_0/fc_w", "optimizer_iteration"])
    workspace.FeedBlob("cpu_0/fc_w", np.zeros((4, 3), np.float32))
    workspace.FeedBlob("optimizer_iteration", np.array([0], np.int64))
    assert checkpoint.load(path, blobs=["cpu_0/fc_w"]) == ["cpu_0/fc_w"]
    np.testing.assert_array_equal(workspace.FetchBlob("cpu_0/fc_w"), blobs["cpu_0/fc_w"])
    assert workspace.FetchBlob("optimizer_iteration")[0] == 0


def test_iteration_is_none_without_the_counter(tmp_path, blobs):
    path = tmp_path / "ckpt.safetensors"
    checkpoint.save(path, ["mask"])
    assert checkpoint.read_metadata(path)["iteration"] is None


def test_save_and_load_use_the_named_workspace(tmp_path, blobs):
    path = tmp_path / "ckpt.safetensors"
    checkpoint.save(path, ["cpu_0/fc_w"], workspace="default")
    workspace.SwitchWorkspace("other", True)
    try:
        assert not workspace.HasBlob("cpu_0/fc_w")
        checkpoint.load(path, workspace=workspace.get_workspace("default"))
        assert not workspace.HasBlob("cpu_0/fc_w")
        checkpoint.load(path)
        np.testing.assert_array_equal(workspace.FetchBlob("cpu_0/fc_w"), blobs["cpu_0/fc_w"])
    finally:
        workspace.SwitchWorkspace("default")


def test_save_of_a_missing_blob_writes_nothing(tmp_path, blobs):
    path = tmp_path / "ckpt.safetensors"
    with pytest.raises(CheckpointError, match="nope"):
        checkpoint.save(path, ["cpu_0/fc_w", "nope"])
    assert os.listdir(tmp_path) == []


def test_save_rejects_bad_arguments(tmp_path, blobs):
    with pytest.raises(TypeError, match="JSON"):
        checkpoint.save(tmp_path / "a", ["mask"], metadata={"x": object()})
    with pytest.raises(TypeError, match="list"):
        checkpoint.save(tmp_path / "a", "mask")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("crash_in", ["replace", "fsync"])
def test_crash_during_save_keeps_the_previous_file_and_no_temp_files(tmp_path, blobs, monkeypatch, crash_in):
    path = tmp_path / "ckpt.safetensors"
    checkpoint.save(path, list(blobs))
    good = path.read_bytes()
    workspace.FeedBlob("cpu_0/fc_w", np.ones((4, 3), np.float32))

    def crash(*args, **kwargs):
        raise OSError("simulated crash")

    monkeypatch.setattr(checkpoint.os, crash_in, crash)
    with pytest.raises(OSError, match="simulated crash"):
        checkpoint.save(path, list(blobs))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["ckpt.safetensors"]
    assert path.read_bytes() == good
    checkpoint.load(path)
    np.testing.assert_array_equal(workspace.FetchBlob("cpu_0/fc_w"), blobs["cpu_0/fc_w"])


def _corruptions(good: bytes) -> dict[str, bytes]:
    header_len = struct.unpack("<Q", good[:8])[0]
    flipped = bytearray(good)
    flipped[-3] ^= 0xFF  # inside the tensor data
    return {"truncated": good[: len(good) - 10], "garbage": b"not a checkpoint at all",
            "empty": b"", "bad header": good[:8] + b"{" * header_len + good[8 + header_len:],
            "flipped data byte": bytes(flipped)}


def test_corrupt_files_raise_and_change_nothing(tmp_path, blobs):
    path = tmp_path / "ckpt.safetensors"
    checkpoint.save(path, list(blobs))
    workspace.FeedBlob("cpu_0/fc_w", np.ones((4, 3), np.float32))
    before = _snapshot()
    for what, data in _corruptions(path.read_bytes()).items():
        bad = tmp_path / f"{what}.safetensors"
        bad.write_bytes(data)
        with pytest.raises(CheckpointError):
            checkpoint.load(bad)
        _assert_unchanged(before)
    with pytest.raises(CheckpointError, match="cannot be read"):
        checkpoint.load(tmp_path / "does_not_exist.safetensors")


def test_foreign_and_future_files_are_refused(tmp_path, blobs):
    foreign = tmp_path / "foreign.safetensors"
    save_file({"x": torch.zeros(2)}, foreign)
    with pytest.raises(CheckpointError, match="not a graphpar checkpoint"):
        checkpoint.load(foreign)
    future = tmp_path / "future.safetensors"
    header = {"format_version": 99, "blobs": ["x"], "sha256": "", "iteration": None, "metadata": {}}
    save_file({"x": torch.zeros(2)}, future, metadata={"graphpar": json.dumps(header)})
    with pytest.raises(CheckpointError, match="format version 99"):
        checkpoint.load(future)
    assert not workspace.HasBlob("x")


def test_missing_blob_in_file_raises_and_changes_nothing(tmp_path, blobs):
    path = tmp_path / "ckpt.safetensors"
    checkpoint.save(path, ["cpu_0/fc_w"])
    workspace.FeedBlob("cpu_0/fc_w", np.ones((4, 3), np.float32))
    before = _snapshot()
    with pytest.raises(CheckpointError, match="gpu_0/fc_b"):
        checkpoint.load(path, blobs=["cpu_0/fc_w", "gpu_0/fc_b"])
    _assert_unchanged(before)


@pytest.mark.parametrize("conflict", [np.zeros((3, 4), np.float32), np.zeros((4, 3), np.float64)],
                         ids=["shape", "dtype"])
def test_shape_or_dtype_conflict_raises_and_changes_nothing(tmp_path, blobs, conflict):
    path = tmp_path / "ckpt.safetensors"
    checkpoint.save(path, list(blobs))
    workspace.FeedBlob("optimizer_iteration", np.array([0], np.int64))  # would be fed before fc_w
    workspace.FeedBlob("cpu_0/fc_w", conflict)
    before = _snapshot()
    with pytest.raises(CheckpointError, match="cpu_0/fc_w"):
        checkpoint.load(path)
    _assert_unchanged(before)


@pytest.mark.skipif(num_cuda_devices() > 5 or cuda_is_simulated(), reason="needs CUDA device 5 to be absent")
def test_failed_placement_rolls_back_blobs_already_fed(tmp_path, blobs):
    path = tmp_path / "ckpt.safetensors"
    with cuda_on_cpu():
        workspace.FeedBlob("gpu_5/w", np.ones(2, np.float32))  # logical CUDA 5, simulated on the CPU
        checkpoint.save(path, ["cpu_0/fc_w", "gpu_5/w", "mask"])
    workspace.get_workspace().remove_blob("gpu_5/w")
    workspace.FeedBlob("cpu_0/fc_w", np.ones((4, 3), np.float32))
    before = _snapshot()
    with pytest.raises(CheckpointError, match="cannot place blob 'gpu_5/w'"):
        checkpoint.load(path)  # cpu_0/fc_w is fed first, then CUDA 5 does not exist
    _assert_unchanged(before)


@pytest.mark.cuda
def test_blobs_load_onto_the_device_of_their_scope(tmp_path):
    workspace.FeedBlob("gpu_0/w", np.arange(3, dtype=np.float32))
    workspace.FeedBlob("plain", np.arange(2, dtype=np.float32))
    path = tmp_path / "ckpt.safetensors"
    checkpoint.save(path, ["gpu_0/w", "plain"])
    workspace.ResetWorkspace()
    checkpoint.load(path)
    assert workspace.FetchTensor("gpu_0/w").device == torch.device("cuda", 0)
    assert workspace.FetchTensor("plain").device.type == "cpu"


def _train_model() -> tuple:
    from graphpar import brew, optimizer
    from graphpar.model_helper import ModelHelper

    model = ModelHelper(name="resume")
    h = brew.fc(model, "data", "fc1", dim_in=4, dim_out=6)
    h = brew.relu(model, h, h)
    pred = brew.fc(model, h, "pred", dim_in=6, dim_out=3)
    _, loss = model.net.SoftmaxWithLoss([pred, "label"], ["softmax", "loss"])
    model.AddGradientOperators([loss])
    optimizer.build_sgd(model, 0.5, policy="step", stepsize=2, gamma=0.5, momentum=0.9)
    state = list(dict.fromkeys(b for op in model.param_init_net.Proto().ops for b in op.outputs))
    return model, state


def _create(model) -> None:
    workspace.FeedBlob("data", np.zeros((8, 4), np.float32))
    workspace.FeedBlob("label", np.zeros(8, np.int32))
    workspace.CreateNet(model.net)


def _steps(model, count: int, first: int) -> None:
    rng = np.random.default_rng(first)
    for _ in range(count):
        workspace.FeedBlob("data", rng.standard_normal((8, 4)).astype(np.float32))
        workspace.FeedBlob("label", rng.integers(0, 3, 8).astype(np.int32))
        workspace.RunNet(model.net)


def test_a_resumed_run_continues_exactly(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    model, state = _train_model()
    assert {"optimizer_iteration", "fc1_w_momentum"} <= set(state)
    workspace.RunNetOnce(model.param_init_net)
    _create(model)
    _steps(model, 3, first=0)
    checkpoint.save(path, state)
    _steps(model, 3, first=1)
    expected = {name: workspace.FetchBlob(name) for name in state}

    workspace.ResetWorkspace()
    model, state = _train_model()
    workspace.RunNetOnce(model.param_init_net)
    assert checkpoint.load(path) == state
    assert checkpoint.read_metadata(path)["iteration"] == 3
    _create(model)
    _steps(model, 3, first=1)
    for name in state:
        np.testing.assert_array_equal(workspace.FetchBlob(name), expected[name], err_msg=name)


# ---- issue 15: the header is checksummed, names and permissions, deterministic files ---------------


def _edit_header(good: bytes, old: bytes, new: bytes) -> bytes:
    """The file with `old` replaced by `new` (same length) in the safetensors header."""
    assert len(old) == len(new)
    header_len = struct.unpack("<Q", good[:8])[0]
    header = good[8:8 + header_len]
    assert header.count(old) == 1, header
    return good[:8] + header.replace(old, new) + good[8 + header_len:]


def test_edits_to_the_header_are_caught(tmp_path):
    workspace.FeedBlob("w", np.arange(12, dtype=np.float32).reshape(4, 3))
    workspace.FeedBlob("optimizer_iteration", np.array([7], np.int64))
    path = tmp_path / "ckpt.safetensors"
    checkpoint.save(path, ["w", "optimizer_iteration"], metadata={"epoch": 3})
    good = path.read_bytes()
    edits = {"dtype": (b'"F32"', b'"I32"'), "shape": (b"[4,3]", b"[3,4]"),
             "iteration": (b'\\"iteration\\": 7', b'\\"iteration\\": 6'),
             "metadata": (b'\\"epoch\\": 3', b'\\"epoch\\": 4')}
    workspace.ResetWorkspace()
    for what, (old, new) in edits.items():
        bad = tmp_path / f"{what}.safetensors"
        bad.write_bytes(_edit_header(good, old, new))
        with pytest.raises(CheckpointError, match="corrupt"):
            checkpoint.load(bad)
        assert workspace.Blobs() == []
    assert checkpoint.load(path) == ["w", "optimizer_iteration"]


def test_version_1_files_still_load(tmp_path, blobs):
    path = tmp_path / "v1.safetensors"
    tensors = {n: torch.as_tensor(v).contiguous() for n, v in blobs.items()}
    digest = hashlib.sha256()
    for t in tensors.values():
        digest.update(t.reshape(-1).view(torch.uint8).numpy())
    header = {"format_version": 1, "blobs": list(tensors), "sha256": digest.hexdigest(), "iteration": 7,
              "metadata": {}}
    save_file(tensors, path, metadata={"graphpar": json.dumps(header)})
    workspace.ResetWorkspace()
    assert checkpoint.load(path) == list(blobs)
    np.testing.assert_array_equal(workspace.FetchBlob("cpu_0/fc_w"), blobs["cpu_0/fc_w"])


def test_a_blob_named_like_the_safetensors_header_is_refused_before_the_file_is_touched(tmp_path, blobs):
    path = tmp_path / "ckpt.safetensors"
    checkpoint.save(path, list(blobs))
    good = path.read_bytes()
    workspace.FeedBlob("__metadata__", np.ones(2, np.float32))
    with pytest.raises(CheckpointError, match="__metadata__"):
        checkpoint.save(path, ["mask", "__metadata__"])
    assert path.read_bytes() == good and os.listdir(tmp_path) == ["ckpt.safetensors"]


def test_a_re_save_keeps_the_target_permissions(tmp_path, blobs):
    path = tmp_path / "ckpt.safetensors"
    checkpoint.save(path, ["mask"])
    os.chmod(path, 0o600)
    checkpoint.save(path, ["mask", "loss"])
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


class _Ordered(collections.abc.Set):
    """A set that iterates in the order given (as a set of str may, from one process to the next)."""

    def __init__(self, items) -> None:
        self.items = list(items)

    def __iter__(self):
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, item) -> bool:
        return item in self.items


def test_identical_saves_write_identical_bytes_whatever_the_set_order(tmp_path, blobs):
    names = list(blobs)
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    checkpoint.save(first, _Ordered(names), metadata={"a": 1, "b": 2})
    checkpoint.save(second, _Ordered(reversed(names)), metadata={"b": 2, "a": 1})
    assert first.read_bytes() == second.read_bytes()
    assert checkpoint.read_metadata(first)["blobs"] == sorted(names)


_SAVE_A_SET = """
import sys
import numpy as np
from graphpar import checkpoint, workspace
names = [f"cpu_0/blob_{i}" for i in range(12)] + ["optimizer_iteration"]
for i, name in enumerate(names):
    workspace.FeedBlob(name, np.full(3, i, np.float32))
checkpoint.save(sys.argv[1], set(names), metadata={"epoch": 1, "run": "a"})
"""


@pytest.mark.slow
def test_identical_runs_write_byte_identical_files(tmp_path):
    """In separate processes, whose str hashes (and so set orders) differ."""
    files = []
    for seed in ("1", "2"):
        path = tmp_path / f"run_{seed}.safetensors"
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run([sys.executable, "-c", _SAVE_A_SET, str(path)], check=True, env=env, timeout=300)
        files.append(path.read_bytes())
    assert files[0] == files[1]


def test_an_unscoped_name_is_saved_and_loaded_from_the_first_replica(tmp_path):
    """The names ExtractPredictorNet gives a parallelized model's params (issue 35 item 2)."""
    first, second = np.arange(6, dtype=np.float32), np.zeros(6, np.float32)
    workspace.FeedBlob("cpu_1/fc_w", second)
    workspace.FeedBlob("cpu_0/fc_w", first)
    workspace.FeedBlob("fc_b", np.ones(2, np.float32))
    path = tmp_path / "predictor.safetensors"
    checkpoint.save(path, ["fc_w", "fc_b"])  # fc_w from cpu_0, the lowest device; fc_b is its own
    assert checkpoint.read_metadata(path)["blobs"] == ["fc_w", "fc_b"]
    assert not workspace.HasBlob("fc_w")
    scoped = tmp_path / "trained.safetensors"
    checkpoint.save(scoped, ["cpu_0/fc_w", "fc_b"])
    workspace.ResetWorkspace()
    assert checkpoint.load(scoped, ["fc_w", "fc_b"]) == ["fc_w", "fc_b"]
    np.testing.assert_array_equal(workspace.FetchBlob("fc_w"), first)
    assert not workspace.HasBlob("cpu_0/fc_w")
    checkpoint.load(path, ["fc_w"])
    np.testing.assert_array_equal(workspace.FetchBlob("fc_w"), first)
    with pytest.raises(CheckpointError, match=r"has no blobs \['fc_x'\]"):
        checkpoint.load(scoped, ["fc_x"])


def test_an_unscoped_name_held_by_cpu_and_gpu_replicas_is_refused(tmp_path):
    workspace.FeedBlob("cpu_0/w", np.ones(2, np.float32))
    with cuda_on_cpu():
        workspace.FeedBlob("gpu_0/w", np.zeros(2, np.float32))
        with pytest.raises(CheckpointError, match=r"'w' is held by replicas of several device types \(cpu_\*, "
                                                  r"gpu_\*\): name the one meant, e.g. 'cpu_0/w'"):
            checkpoint.save(tmp_path / "w.safetensors", ["w"])
        assert not (tmp_path / "w.safetensors").exists()
        checkpoint.save(tmp_path / "both.safetensors", ["cpu_0/w", "gpu_0/w"])
    with pytest.raises(CheckpointError, match="several device types"):
        checkpoint.load(tmp_path / "both.safetensors", ["w"])
    assert not workspace.HasBlob("w")
