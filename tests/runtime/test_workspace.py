"""The workspace: feeding and fetching blobs, device placement, workspaces, nets and seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphpar import core, devices, workspace
from graphpar.core import CPU, CUDA, BlobReference, DeviceOption, DeviceScope
from graphpar.errors import MissingBlobError

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without a GPU")


# ---- FeedBlob / FetchBlob ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64, np.bool_, np.uint8, np.float16])
def test_feed_fetch_round_trip_keeps_dtype(dtype: type) -> None:
    value = (np.random.RandomState(1).randn(3, 4) * 10).astype(dtype)
    workspace.FeedBlob("x", value)
    fetched = workspace.FetchBlob("x")
    assert fetched.dtype == value.dtype and fetched.shape == (3, 4)
    np.testing.assert_array_equal(fetched, value)
    assert workspace.FetchTensor("x").dtype == torch.from_numpy(value).dtype


def test_feed_copies_the_value_and_fetch_returns_a_copy() -> None:
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    workspace.FeedBlob("x", value)
    value[0, 0] = 100.0
    fetched = workspace.FetchBlob("x")
    fetched[1, 1] = -5.0
    np.testing.assert_array_equal(workspace.FetchBlob("x"), np.arange(6, dtype=np.float32).reshape(2, 3))


def test_feed_tensor_is_copied_and_detached() -> None:
    source = torch.ones(3, requires_grad=True)
    workspace.FeedBlob("t", source)
    with torch.no_grad():
        source.add_(1.0)
    live = workspace.FetchTensor("t")
    assert not live.requires_grad and live.tolist() == [1.0, 1.0, 1.0]
    assert workspace.FetchTensor("t") is live  # the live tensor, not a copy


def test_feed_non_contiguous_and_read_only_arrays() -> None:
    base = np.arange(12, dtype=np.int64).reshape(3, 4)
    workspace.FeedBlob("t", base.T)
    np.testing.assert_array_equal(workspace.FetchBlob("t"), base.T)
    base.setflags(write=False)
    workspace.FeedBlob("r", base[::-1])
    np.testing.assert_array_equal(workspace.FetchBlob("r"), base[::-1])


def test_feed_non_native_byte_order() -> None:
    value = np.arange(4, dtype=">f4")  # big-endian, e.g. read from a file written elsewhere
    workspace.FeedBlob("be", value)
    assert workspace.FetchTensor("be").dtype == torch.float32
    np.testing.assert_array_equal(workspace.FetchBlob("be"), [0.0, 1.0, 2.0, 3.0])


def test_fetch_blob_without_a_numpy_dtype_explains_fetch_tensor() -> None:
    workspace.FeedBlob("half", torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="'half' is bfloat16.*FetchTensor"):
        workspace.FetchBlob("half")
    assert workspace.FetchTensor("half").dtype == torch.bfloat16


@pytest.mark.parametrize(("value", "dtype", "shape"), [
    (2.5, torch.float32, ()),
    (3, torch.int64, ()),
    (True, torch.bool, ()),
    (np.float64(1.5), torch.float64, ()),
    (np.int32(7), torch.int32, ()),
    ([1.0, 2.0, 3.0], torch.float32, (3,)),
    ([[1, 2], [3, 4], [5, 6]], torch.int64, (3, 2)),
    ((0.5, 1.5), torch.float32, (2,)),
])
def test_feed_scalars_and_lists(value: object, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    workspace.FeedBlob("v", value)
    tensor = workspace.FetchTensor("v")
    assert tensor.dtype == dtype and tuple(tensor.shape) == shape
    np.testing.assert_array_equal(workspace.FetchBlob("v"), np.asarray(value))


@pytest.mark.parametrize("bad", [
    None, {"a": 1}, object(), np.array([1, "a"], dtype=object), [[1, 2], [3]], [1, None], ["a", "b"],
], ids=["None", "dict", "object", "object-array", "ragged", "None-in-list", "str-list"])
def test_bad_feed_raises_type_error_and_changes_nothing(bad: object) -> None:
    workspace.FeedBlob("keep", np.ones(2, dtype=np.float32))
    with pytest.raises(TypeError, match="'keep'"):
        workspace.FeedBlob("keep", bad)
    with pytest.raises(TypeError, match="'fresh'"):
        workspace.FeedBlob("fresh", bad)
    assert workspace.Blobs() == ["keep"]
    np.testing.assert_array_equal(workspace.FetchBlob("keep"), np.ones(2, dtype=np.float32))


@pytest.mark.parametrize("name", ["", None, 3])
def test_bad_blob_name_raises(name: object) -> None:
    with pytest.raises(TypeError, match="blob name"):
        workspace.FeedBlob(name, 1.0)
    assert workspace.Blobs() == []


def test_blob_reference_names_are_stored_as_plain_strings() -> None:
    ref = BlobReference("scope/x")
    workspace.FeedBlob(ref, [1.0])
    assert workspace.HasBlob("scope/x") and workspace.HasBlob(ref)
    assert type(workspace.Blobs()[0]) is str
    np.testing.assert_array_equal(workspace.FetchBlob(ref), [1.0])


def test_fetch_missing_blob_names_it_and_suggests_close_names() -> None:
    workspace.FeedBlob("gpu_0/fc_w", 1.0, DeviceOption(CPU))
    with pytest.raises(MissingBlobError, match=r"'gpu_0/fc_b'.*'default'.*gpu_0/fc_w"):
        workspace.FetchBlob("gpu_0/fc_b")
    with pytest.raises(KeyError):  # MissingBlobError is a KeyError
        workspace.FetchTensor("nope")


def test_has_blob_and_sorted_blobs() -> None:
    for name in ("b", "a", "c/d"):
        workspace.FeedBlob(name, 0)
    assert workspace.Blobs() == ["a", "b", "c/d"]
    assert workspace.HasBlob("a") and not workspace.HasBlob("z") and not workspace.HasBlob(3)


def test_blobs_view_fetches_feeds_and_deletes() -> None:
    workspace.blobs["x"] = np.arange(3, dtype=np.int32)
    assert "x" in workspace.blobs and len(workspace.blobs) == 1 and list(workspace.blobs) == ["x"]
    np.testing.assert_array_equal(workspace.blobs["x"], [0, 1, 2])
    del workspace.blobs["x"]
    assert not workspace.HasBlob("x")
    with pytest.raises(MissingBlobError):
        del workspace.blobs["x"]


# ---- device placement -------------------------------------------------------------------------

def test_feed_device_precedence(placed: list[DeviceOption]) -> None:
    workspace.FeedBlob("plain", 1.0)
    workspace.FeedBlob("gpu_3/x", 1.0)
    workspace.FeedBlob("cpu_1/x", 1.0)
    with DeviceScope(DeviceOption(CUDA, 2)):
        workspace.FeedBlob("gpu_3/y", 1.0)
        workspace.FeedBlob("gpu_3/z", 1.0, device_option=DeviceOption(CUDA, 1))
    workspace.FeedBlob("gpu_5/w", 1.0, device_option=DeviceOption(CPU))
    assert placed == [DeviceOption(CPU, 0), DeviceOption(CUDA, 3), DeviceOption(CPU, 1),
                      DeviceOption(CUDA, 2), DeviceOption(CUDA, 1), DeviceOption(CPU, 0)]


def test_simulated_cuda_blobs_live_on_the_cpu() -> None:
    with devices.cuda_on_cpu():
        workspace.FeedBlob("gpu_1/x", np.ones(2, dtype=np.float32))
    assert workspace.FetchTensor("gpu_1/x").device == torch.device("cpu")


def test_bad_device_option_type_raises() -> None:
    with pytest.raises(TypeError, match="device_option"):
        workspace.FeedBlob("x", 1.0, device_option="cuda:0")
    assert workspace.Blobs() == []


@NO_GPU
def test_feed_to_missing_cuda_device_explains_simulation() -> None:
    missing = devices.num_cuda_devices()  # the first id past the machine's GPUs (0 without any)
    with devices.cuda_on_cpu(False), pytest.raises(RuntimeError, match="GRAPHPAR_CUDA_ON_CPU"):
        workspace.FeedBlob(f"gpu_{missing}/x", np.ones(2))
    assert workspace.Blobs() == []


@pytest.mark.cuda
def test_feed_places_gpu_scoped_blobs_on_cuda() -> None:
    with devices.cuda_on_cpu(False):
        workspace.FeedBlob("gpu_0/x", np.ones(2, dtype=np.float32))
        workspace.FeedBlob("y", np.ones(2, dtype=np.float32), DeviceOption(CUDA, 0))
    assert workspace.FetchTensor("gpu_0/x").device == torch.device("cuda", 0)
    assert workspace.FetchTensor("y").device == torch.device("cuda", 0)
    np.testing.assert_array_equal(workspace.FetchBlob("gpu_0/x"), [1.0, 1.0])


def test_num_cuda_devices_matches_torch() -> None:
    expected = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert workspace.NumCudaDevices() == expected


# ---- workspaces ---------------------------------------------------------------------------------

def test_switch_workspace_keeps_blobs_apart() -> None:
    workspace.FeedBlob("x", 1.0)
    assert workspace.CurrentWorkspace() == "default"
    workspace.SwitchWorkspace("other", create_if_missing=True)
    assert workspace.CurrentWorkspace() == "other" and workspace.Blobs() == []
    workspace.FeedBlob("y", 2.0)
    workspace.SwitchWorkspace("default", create_if_missing=False)
    assert workspace.Blobs() == ["x"]
    assert workspace.Workspaces() == ["default", "other"]
    assert workspace.get_workspace("other").blob_names() == ["y"]


def test_switch_to_missing_workspace_without_create_raises() -> None:
    with pytest.raises(RuntimeError, match="'nowhere'.*create_if_missing"):
        workspace.SwitchWorkspace("nowhere", create_if_missing=False)
    assert workspace.CurrentWorkspace() == "default"
    with pytest.raises(TypeError):
        workspace.SwitchWorkspace("")
    with pytest.raises(KeyError, match="'nowhere'"):
        workspace.get_workspace("nowhere")


def test_reset_workspace_clears_blobs_and_nets_of_the_current_workspace_only() -> None:
    net = core.Net("reset_me")
    net.ConstantFill([], "c", shape=[2], value=1.0)
    workspace.CreateNet(net)
    workspace.SwitchWorkspace("other", True)
    workspace.FeedBlob("kept", 1.0)
    workspace.SwitchWorkspace("default")
    workspace.RunNet(net)
    workspace.ResetWorkspace()
    assert workspace.Blobs() == []
    with pytest.raises(RuntimeError, match="CreateNet"):
        workspace.RunNet(net)
    assert workspace.get_workspace("other").blob_names() == ["kept"]


# ---- nets ---------------------------------------------------------------------------------------

def _counter_net(name: str = "count") -> core.Net:
    net = core.Net(name)
    net.Add(["acc", "one"], "acc")
    return net


def test_create_net_then_run_by_name_net_and_netdef() -> None:
    workspace.FeedBlob("acc", np.zeros(2, dtype=np.float32))
    workspace.FeedBlob("one", np.ones(2, dtype=np.float32))
    net = _counter_net()
    assert workspace.CreateNet(net)
    workspace.RunNet(net.Name())
    workspace.RunNet(net)
    workspace.RunNet(net.Proto(), num_iter=3)
    np.testing.assert_array_equal(workspace.FetchBlob("acc"), [5.0, 5.0])


def test_create_net_twice_needs_overwrite() -> None:
    workspace.FeedBlob("acc", np.zeros(1, dtype=np.float32))
    workspace.FeedBlob("one", np.ones(1, dtype=np.float32))
    net = _counter_net()
    workspace.CreateNet(net)
    with pytest.raises(RuntimeError, match="already exists.*overwrite=True"):
        workspace.CreateNet(net)
    net.Add(["acc", "one"], "acc")  # later edits count only once the net is re-created
    workspace.RunNet(net)
    np.testing.assert_array_equal(workspace.FetchBlob("acc"), [1.0])
    workspace.CreateNet(net, overwrite=True)
    workspace.RunNet(net)
    np.testing.assert_array_equal(workspace.FetchBlob("acc"), [3.0])


def test_run_net_of_unknown_net_or_bad_count_raises() -> None:
    with pytest.raises(RuntimeError, match="'ghost'.*CreateNet"):
        workspace.RunNet("ghost")
    workspace.FeedBlob("acc", np.zeros(1, dtype=np.float32))
    workspace.FeedBlob("one", np.ones(1, dtype=np.float32))
    net = _counter_net()
    workspace.CreateNet(net)
    with pytest.raises(ValueError, match="num_iter"):
        workspace.RunNet(net, num_iter=-1)
    with pytest.raises(TypeError, match="Net or a NetDef"):
        workspace.CreateNet(42)


def test_run_net_once_does_not_register_the_net() -> None:
    workspace.FeedBlob("acc", np.zeros(1, dtype=np.float32))
    workspace.FeedBlob("one", np.ones(1, dtype=np.float32))
    net = _counter_net()
    assert workspace.RunNetOnce(net)
    np.testing.assert_array_equal(workspace.FetchBlob("acc"), [1.0])
    with pytest.raises(RuntimeError, match="has not been created"):
        workspace.RunNet(net)
    workspace.CreateNet(net)  # no name clash


def test_run_operator_once() -> None:
    workspace.FeedBlob("x", np.array([-1.0, 2.0], dtype=np.float32))
    assert workspace.RunOperatorOnce(core.CreateOperator("Relu", ["x"], ["y"]))
    np.testing.assert_array_equal(workspace.FetchBlob("y"), [0.0, 2.0])
    with pytest.raises(TypeError, match="OperatorDef"):
        workspace.RunOperatorOnce("Relu")


def test_workspace_objects_are_independent_of_the_module_state() -> None:
    ws = workspace.Workspace("private", seed=3)
    ws.feed_blob("x", np.array([-2.0, 3.0], dtype=np.float32))
    ws.run_operator_once(core.CreateOperator("Relu", ["x"], ["y"]))
    np.testing.assert_array_equal(ws.fetch_blob("y"), [0.0, 3.0])
    assert workspace.Blobs() == [] and "private" not in workspace.Workspaces()
    with pytest.raises(ValueError, match="seed"):
        workspace.Workspace("bad", seed=-1)


# ---- seeds ----------------------------------------------------------------------------------------

def _gaussian_net() -> core.Net:
    net = core.Net("fill")
    net.GaussianFill([], "g", shape=[64])
    net.UniformFill([], "u", shape=[64], min=-1.0, max=1.0)
    return net


def _fill_values() -> tuple[np.ndarray, np.ndarray]:
    workspace.RunNetOnce(_gaussian_net())
    return workspace.FetchBlob("g"), workspace.FetchBlob("u")


def test_fills_are_reproducible_per_workspace_seed() -> None:
    first = _fill_values()
    second = _fill_values()
    assert not np.array_equal(first[0], second[0])  # another compile, other draws
    workspace.ResetWorkspace()
    np.testing.assert_array_equal(_fill_values()[0], first[0])  # reset restarts it
    workspace.SwitchWorkspace("twin", True)
    np.testing.assert_array_equal(_fill_values()[1], first[1])  # same seed, same values
    workspace.SetSeed(7)
    seven = _fill_values()
    assert not np.array_equal(seven[0], first[0])
    workspace.SwitchWorkspace("seven", True)
    workspace.SetSeed(7)
    np.testing.assert_array_equal(_fill_values()[0], seven[0])


def test_set_seed_reseeds_created_nets() -> None:
    net = _gaussian_net()
    workspace.CreateNet(net)
    workspace.RunNet(net)
    first = workspace.FetchBlob("g")
    workspace.RunNet(net)
    workspace.SetSeed(0)
    workspace.RunNet(net)
    np.testing.assert_array_equal(workspace.FetchBlob("g"), first)
