"""MMCV / DataParallel details of graphpar.data: a collated list longer than the device count grouped
ceil(L / N) chunks per device (MMCV's scatter), ragged DataContainer(stack=False) fields put on each
device as lists of tensors, and gather(..., output_device=...) as DataParallel's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphpar import data_parallel_model as dpm
from graphpar import devices, workspace
from graphpar.data import DataContainer, collate, feed, gather, scatter
from graphpar.model_helper import ModelHelper


def _samples(n: int) -> list[dict]:
    rng = np.random.default_rng(n)
    return [{"img": DataContainer(rng.random((2, 1 + k % 3, 2 + k % 2), dtype=np.float32), stack=True,
                                  padding_value=-1.0, pad_dims=2),
             "boxes": DataContainer(np.full((k + 1, 4), k, dtype=np.float32)),
             "meta": DataContainer({"id": k}, cpu_only=True), "label": np.int64(k)} for k in range(n)]


def _mmcv_devices(chunks: int, num_devices: int) -> list[int]:
    """MMCV's _functions.scatter of a list: item i goes to device i // ceil(len / devices)."""
    per = (chunks - 1) // num_devices + 1
    return [i // per for i in range(chunks)]


@pytest.mark.parametrize("n, num_devices", [(6, 3), (5, 3), (8, 2), (4, 4)])
def test_a_list_longer_than_the_devices_is_grouped_as_mmcv_scatters_it(n, num_devices) -> None:
    samples = _samples(n)
    collated = collate(samples, samples_per_device=1)  # n chunks of one sample
    chunks = scatter({"img": collated["img"], "boxes": collated["boxes"]}, num_devices)
    owner = _mmcv_devices(n, num_devices)
    for d in range(num_devices):
        mine = [s for s, o in zip(samples, owner) if o == d]
        assert [b.tolist() for b in chunks[d]["boxes"].data] == [s["boxes"].data.tolist() for s in mine]
        # stacked chunks: re-padded to the group's largest sample, as collating them together pads them
        expected = collate(mine, samples_per_device=len(mine))["img"].data[0]
        np.testing.assert_array_equal(chunks[d]["img"].data, expected)


def test_a_grouping_that_leaves_a_device_without_samples_is_refused() -> None:
    collated = collate(_samples(5), samples_per_device=1)
    with pytest.raises(ValueError, match="5 chunks for 4 devices: grouped 2 per device, device 3 would get none"):
        scatter(collated, 4)


def _model(ids: list[int]) -> ModelHelper:
    model = ModelHelper(name="surface", init_params=False)
    dpm.Parallelize(model, input_builder_fun=lambda m: None,
                    forward_pass_builder_fun=lambda m, scale: [m.net.Relu("label_f", "out")],
                    devices=ids, cpu_device=True)
    return model


def test_ragged_fields_go_to_each_device_as_lists_of_tensors(monkeypatch) -> None:
    workspace.ResetWorkspace()
    model = _model([0, 1])
    # stand-in placement: replica 1's tensors on the meta device, so the test sees where each list went
    monkeypatch.setattr(devices, "torch_device", lambda option: torch.device("meta" if option.device_id == 1 else "cpu"))
    samples = _samples(4)
    batch = collate(samples, samples_per_device=2)
    batch["label_f"] = batch.pop("label").astype(np.float32)
    fed = feed(model, batch)
    assert sorted(fed.device[0]) == ["boxes"]  # stacked fields are blobs, cpu_only ones stay on the host
    for d in (0, 1):
        boxes = fed.device[d]["boxes"]
        assert [tuple(b.shape) for b in boxes] == [(2 * d + 1, 4), (2 * d + 2, 4)]
        assert all(b.device.type == ("meta" if d else "cpu") for b in boxes)
    np.testing.assert_array_equal(fed.device[0]["boxes"][1].numpy(), samples[1]["boxes"].data)
    assert fed.host[0]["meta"] == [{"id": 0}, {"id": 1}] and "meta" not in fed.device[0]
    assert [b.shape for b in fed.host[1]["boxes"]] == [(3, 4), (4, 4)]  # still handed back on the host too


def test_gather_to_an_output_device_returns_a_new_tensor_there(monkeypatch) -> None:
    workspace.ResetWorkspace()
    model = _model([2, 5])
    workspace.FeedBlob("cpu_2/out", np.arange(6, dtype=np.float32).reshape(3, 2))
    workspace.FeedBlob("cpu_5/out", np.arange(6, 10, dtype=np.float32).reshape(2, 2))
    host = gather(model, "out")
    assert isinstance(host, np.ndarray) and host.shape == (5, 2)
    for device in (-1, "cpu", 5):
        got = gather(model, "out", output_device=device)
        assert isinstance(got, torch.Tensor) and got.device.type == "cpu"
        np.testing.assert_array_equal(got.numpy(), host)
    got[0, 0] = 100.0  # a new tensor, not a view of the blob
    assert workspace.FetchBlob("cpu_2/out")[0, 0] == 0.0
    monkeypatch.setattr(devices, "torch_device", lambda option: torch.device("meta" if option.device_id == 5 else "cpu"))
    assert gather(model, ["out"], output_device=5)["out"].device.type == "meta"
    with pytest.raises(ValueError, match=r"output_device must be None .* devices cpu_\[2, 5\], got 3"):
        gather(model, "out", output_device=3)
